"""``python -m composer3d.train``: the form torchrun and the SLURM recipes start; the command is
``composer3d.commands.train``."""

if __name__ == "__main__":
    from composer3d.commands.cli import train

    train()
