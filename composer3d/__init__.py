"""composer3d: FSDP2, tensor/sequence, pipeline and expert parallel composed on one DeviceMesh
(docs/architecture.md)."""

import logging

__version__ = "0.1.0"


class _KnownHarmless(logging.Filter):
    """Drops warnings a user can do nothing about, logged on every run by libraries composer3d
    imports, and keeps every other record of theirs: torchao's optional C++ kernels built for
    another Python or CUDA (its Python paths serve), and torch's deprecation of the Enum constants
    torchao registers with pytree."""

    MESSAGES = {
        "torchao": ("Failed to load ",),
        "torch.utils._pytree": ("is an Enum subclass and is now natively",),
    }

    def __init__(self, logger: str):
        super().__init__()
        self.fragments = self.MESSAGES[logger]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


# before either library is imported: the filters sit on their loggers
for _name in _KnownHarmless.MESSAGES:
    logging.getLogger(_name).addFilter(_KnownHarmless(_name))
