"""Parameter-efficient fine-tuning: everything LoRA/QLoRA (the schema stays with the config)."""
