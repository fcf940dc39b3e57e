"""composer3d: FSDP2, tensor/sequence, pipeline and expert parallel composed on one DeviceMesh (docs/architecture.md)."""

__version__ = "0.1.0"
