"""Data parallel: FSDP2 (ZeRO-3/2, HSDP), replicate, and ZeRO-1 with its gradient buckets."""
