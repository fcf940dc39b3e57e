"""Layout-independent weight initialization of a model built on the meta device.

Each parameter is generated whole from its own generator, seeded by (seed, parameter name), and each
rank keeps only its shard. The values therefore depend on the seed and the name alone — not on the
world size, the mesh, or the order in which ranks or parameters are visited — which is what makes
losses match across layouts. Generating whole tensors costs one full parameter of temporary memory
at a time.
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from composer3d.peft.lora import adapter_init, base_name, copy_nf4_, is_adapter, is_nf4, to_nf4

InitRule = Callable[[tuple[int, ...], torch.Generator, torch.device], torch.Tensor]


def normal(std: float) -> InitRule:
    def rule(shape, generator, device):
        return torch.empty(shape, device=device).normal_(0.0, std, generator=generator)

    return rule


def ones() -> InitRule:
    return lambda shape, generator, device: torch.ones(shape, device=device)


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def local_shard(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that ``param`` holds on this rank.

    Tensor-parallel placements (plain ``Shard``) are cut first and FSDP's (``_StridedShard``, which
    FSDP uses when it shards a dim TP already split) last, because FSDP shards the tensor TP left on
    the rank. Both follow ``torch.chunk``, so an uneven dim leaves the last ranks short or empty, as
    DTensor and FSDP do.
    """
    if not isinstance(param, DTensor):
        return full
    mesh, placements = param.device_mesh, param.placements
    coordinate = mesh.get_coordinate()
    plain = [i for i, p in enumerate(placements) if type(p) is Shard]
    strided = [i for i, p in enumerate(placements) if isinstance(p, _StridedShard)]
    shard = full
    for mesh_dim in plain + strided:
        dim = placements[mesh_dim].dim
        chunks = torch.chunk(shard, mesh.size(mesh_dim), dim=dim)
        index = coordinate[mesh_dim]
        shard = chunks[index] if index < len(chunks) else shard.narrow(dim, 0, 0)
    return shard


@torch.no_grad()
def materialize(
    model: nn.Module,
    device: torch.device,
    seed: int,
    fsdp_roots: list[nn.Module] = (),
    init_params: bool = True,
    compute_device: torch.device | None = None,
    aliases: dict[str, str] | None = None,
    read: Callable[[str, tuple[int, ...]], torch.Tensor] | None = None,
) -> None:
    """Allocate ``model`` (on meta) on ``device`` and fill every parameter by its ``init_rule``.

    ``init_params=False`` only allocates them (pretrained weights are loaded next) and computes the
    buffers; LoRA adapters are initialized even then, since pretrained weights do not hold them.

    ``compute_device``: where the forward runs, when it is not ``device``: with FSDP's CPU offload
    the parameters live in host memory, which FSDP requires of them, while the forward runs on the
    accelerator. The buffers (rotary tables) go there, and every parameter's values are drawn there
    and copied to ``device``: each device type's generator draws its own numbers for a seed, and an
    offloaded run must start from the model it would start from on the accelerator.

    ``fsdp_roots``: FSDP roots outside the model's own tree (pipeline stage modules); FSDP
    re-registers the sharded parameters it manages only when its own module is moved.

    ``aliases``: parameters initialized as another one, by its name's seed and rule (the last
    pipeline stage's twin of a tied embedding).

    ``read``: every parameter but the adapters is the whole tensor ``read(name, shape)`` gives
    instead of its init rule's (a peft run's base from a full checkpoint), by its unwrapped and
    unaliased name.
    """
    model.to_empty(device=device)
    for root in fsdp_roots:
        root.to_empty(device=device)
    # to_empty gives each module its own new tensor, which unties shared weights
    model.tie_weights()
    compute_device = compute_device or device
    for name, param in model.named_parameters():
        if not (init_params or is_adapter(name)):
            continue
        # A LoRA-wrapped linear's base weight keeps the seed and rule of its unwrapped name
        # (``models.lora``); a tied head's twin those of the embedding (``aliases``).
        source = base_name((aliases or {}).get(name, name))
        generator = torch.Generator(device=compute_device).manual_seed(param_seed(seed, source))
        if is_adapter(name):
            rule = partial(adapter_init, name)
        elif read is not None:
            rule = lambda shape, generator, device, source=source: read(source, shape).to(device)  # noqa: E731
        else:
            rule = model.init_rule(source)
        full = rule(tuple(param.shape), generator, compute_device)
        local = param.to_local() if isinstance(param, DTensor) else param
        # the tensor FSDP gathers, not a view of it: ``copy_nf4_`` sets its inner tensors
        if is_nf4(local):
            # QLoRA: quantized whole, then cut, so every layout holds the same
            local = param._local_tensor if isinstance(param, DTensor) else param
            full = to_nf4(full)
        shard = local_shard(full, param)
        if shard.shape != local.shape:
            raise RuntimeError(
                f"init of {name}: computed shard {tuple(shard.shape)} but the rank holds "
                f"{tuple(local.shape)} under placements {param.placements}"
            )
        copy_nf4_(local, shard) if is_nf4(local) else local.copy_(shard)
    model.init_buffers(compute_device)
    if compute_device != device:  # buffers a model recomputes in place stay where to_empty put them
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                module._buffers[name] = buffer.to(compute_device)
