"""composer3d: FSDP2, tensor/sequence parallel and (soon) pipeline parallel composed on one DeviceMesh."""

__version__ = "0.1.0"
