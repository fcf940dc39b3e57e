"""COMPOSER3D_TEST_EFFECTS=DIR — every rank writes DIR/rank{R}.json after its first optimizer step:
what the precision and memory switches did to its model, its FSDP wrapping and its optimizer, so a
test can assert a switch's effect, not only that the loss stayed close (which a switch that does
nothing passes). Loaded by sitecustomize in the ``composer3d.commands.train`` processes of a run
(``harness.train(probe_effects=True)``), or imported by the workers of
``harness.train_in_one_group(probe_effects=True)``, which set DIR per job; it only reads state.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from composer3d.memory.activation_checkpointing import checkpointed_forward
from composer3d.memory.activation_offload import OffloadedCall
from composer3d.training import loss as loss_module
from composer3d.training.metrics import local_bytes
from composer3d.training.trainer import Trainer

# dtypes of the tensors FSDP2's all-gathers and reduce-scatters carry (it calls them through
# ``dist``)
_COLLECTIVES: dict[str, Counter] = {"all_gather": Counter(), "reduce_scatter": Counter()}
# the elements they took in since this job's Trainer was built (a reduce-scatter's whole input, an
# all-gather's own slice), by the size of their group
_ELEMENTS_BY_GROUP: dict[str, Counter] = {"all_gather": Counter(), "reduce_scatter": Counter()}


def _recording(name: str, key: str):
    original = getattr(dist, name)

    def collective(*args, **kwargs):
        tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
        if isinstance(tensor, torch.Tensor):
            _COLLECTIVES[key][str(tensor.dtype)] += 1
            _ELEMENTS_BY_GROUP[key][dist.get_world_size(kwargs.get("group"))] += tensor.numel()
        return original(*args, **kwargs)

    setattr(dist, name, collective)


# torch >= 2.13 names them *_single; torch 2.11/2.12's FSDP2 calls all_gather_into_tensor /
# reduce_scatter_tensor.
for _name, _key in (
    ("all_gather_single", "all_gather"),
    ("reduce_scatter_single", "reduce_scatter"),
    ("all_gather_into_tensor", "all_gather"),
    ("reduce_scatter_tensor", "reduce_scatter"),
):
    if hasattr(dist, _name) and (
        _name.endswith("_single") or not hasattr(dist, "all_gather_single")
    ):
        _recording(_name, _key)


# expert parallel's token exchanges (models.moe sends rows with the functional all-to-all): calls
# and rows sent
_ALL_TO_ALL = Counter()


def _counting_all_to_all():
    import torch.distributed._functional_collectives as funcol

    original = funcol.all_to_all_single_autograd

    def all_to_all(tensor, output_split_sizes, input_split_sizes, group):
        _ALL_TO_ALL["calls"] += 1
        _ALL_TO_ALL["rows_sent"] += int(tensor.shape[0])
        return original(tensor, output_split_sizes, input_split_sizes, group)

    funcol.all_to_all_single_autograd = all_to_all


_counting_all_to_all()


def _moe(model) -> list[dict]:
    """Each mixture-of-experts layer of this rank: how its experts, shared experts and router are
    held."""
    from torch.distributed.fsdp import FSDPModule

    from composer3d.models.moe import moe_layers

    layers = []
    for moe in moe_layers(model):
        experts = moe.experts
        fsdp = (
            experts._get_fsdp_state()._fsdp_param_group if isinstance(experts, FSDPModule) else None
        )
        layers.append(
            {
                "experts_local_shape": list(_local(experts.w1).shape),
                "experts_placements": [str(p) for p in getattr(experts.w1, "placements", ())],
                "experts_mesh_dims": list(
                    getattr(getattr(experts.w1, "device_mesh", None), "mesh_dim_names", None) or ()
                ),
                "experts_own_fsdp_group_size": fsdp.mesh_info.mesh.size()
                if fsdp is not None
                else None,
                "shared_local_shape": list(_local(moe.shared_w1.weight).shape)
                if moe.shared_w1 is not None
                else None,
                "gate_placements": [str(p) for p in getattr(moe.gate.weight, "placements", ())],
                "ep_group_size": dist.get_world_size(moe.ep_group)
                if moe.ep_group is not None
                else 1,
                "ep_ranks": dist.get_process_group_ranks(moe.ep_group)
                if moe.ep_group is not None
                else [dist.get_rank()],
            }
        )
    return layers


def _attention(trainer: Trainer) -> dict:
    """Each block of this rank (a pipeline stage keeps some): the tokens of a sequence its attention
    held in the first step, the query and key heads it computed, the tokens of its residual stream
    (the block's input; fewer under sequence parallel), and the ranks its attention spanned under
    context parallel (only itself without) and the chunks of the sequence it held."""
    found = {}
    for layer_id, block in trainer.model.layers.items():
        attention = getattr(block, "attention", None)
        if attention is None:
            continue
        context = attention.context_parallel
        found[layer_id] = {
            "tokens": getattr(attention, "_probe_tokens", None),
            "heads": [getattr(attention, "_probe_heads", {}).get(n) for n in ("wq", "wk")],
            "residual_tokens": getattr(block, "_probe_tokens", None),
            "cp_ranks": dist.get_process_group_ranks(context.group)
            if context
            else [dist.get_rank()],
            # the global chunks this rank held in the step just run (parallel.cp_balance)
            "cp_chunks": list(context.placed.held[context.rank])
            if context and context.placed
            else None,
        }
    return found


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor):
    """A plain tensor's storage; None for a subclass's (float8 weights, torchao's low-bit state),
    which has none of its own to compare."""
    t = _local(t)
    return t.untyped_storage() if type(t) in (torch.Tensor, torch.nn.Parameter) else None


def _in_file(t: torch.Tensor) -> bool:
    """Whether ``t`` is a memory-mapped file's (parallel.offload_dir)."""
    storage = _storage(t)
    return storage is not None and storage.filename is not None


def _fsdp(trainer: Trainer) -> list[dict]:
    """The FSDP groups of this rank: the model's, and under PP its stage modules' (the roots of the
    embedding, final norm and head), which the model does not register."""
    from torch.distributed.fsdp import FSDPModule

    pipeline = trainer.pipeline
    stages = [] if pipeline is None else getattr(pipeline, "_stages", None) or [pipeline._stage]
    modules = {id(m): (fqn, m) for fqn, m in trainer.model.named_modules()}
    for i, stage in enumerate(stages):
        modules.setdefault(id(stage.submod), (f"stage{i}", stage.submod))
    found = []
    for fqn, module in modules.values():
        group = (
            module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
        )
        if group is not None:
            # Each parameter's policy: torch 2.15's groups keep none of their own (they resolve it
            # per parameter); composer3d overrides none, so a group has one.
            ((param_dtype, reduce_dtype),) = {
                (str(p.mp_policy.param_dtype), str(p.mp_policy.reduce_dtype))
                for p in group.fsdp_params
            }
            found.append(
                {
                    "fqn": fqn,
                    "param_dtype": param_dtype,
                    "reduce_dtype": reduce_dtype,
                    "offload_to_cpu": [p.offload_to_cpu for p in group.fsdp_params],
                    # frees its gathered (cast) parameters after forward, to gather them again in
                    # backward
                    "reshards_after_forward": group.post_forward_mesh_info is not None,
                }
            )
    return found


def _compiled(block: torch.nn.Module) -> bool:
    call = getattr(block, "_compiled_call_impl", None)
    # activation offload sits around the block's call, compiled or not
    if isinstance(call, OffloadedCall):
        call = call.call if call.call != block._call_impl else None
    return call is not None


def _offloaded(block: torch.nn.Module) -> bool:
    return isinstance(getattr(block, "_compiled_call_impl", None), OffloadedCall)


def _checkpointed(block: torch.nn.Module) -> bool:
    """Whether the block's forward runs under activation checkpointing (its instance forward, see
    activation.py)."""
    forward = block.__dict__.get("forward")
    return isinstance(forward, partial) and forward.func is checkpointed_forward


def _effects(trainer: Trainer) -> dict:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    model, optimizer = trainer.model, trainer.optimizer
    names = {id(p): n for n, p in model.named_parameters()}
    counters = torch._dynamo.utils.counters
    param_storages = {_storage(p).data_ptr() for p in model.parameters() if _storage(p) is not None}
    return {
        "rank": dist.get_rank(),
        "blocks": list(model.layers.keys()),  # this rank's (a pipeline stage keeps some)
        "linear_classes": {
            fqn: type(m).__name__
            for fqn, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        },
        "num_params": len(list(model.parameters())),
        "fsdp": _fsdp(trainer),
        "param_local_classes": dict(Counter(type(_local(p)).__name__ for p in model.parameters())),
        "param_devices": dict(Counter(str(_local(p).device) for p in model.parameters())),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted(
            {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        ),
        # precision.cast=params: parameters a module still shows as their low-precision copy
        # (parallel.cast_once)
        "shadowed_after_step": sum(
            name in m.__dict__
            for m in model.modules()
            for name, _ in m.named_parameters(recurse=False)
        ),
        "grad_devices": dict(
            Counter(str(_local(p.grad).device) for p in model.parameters() if p.grad is not None)
        ),
        "collective_dtypes": {k: dict(v) for k, v in _COLLECTIVES.items()},
        "collective_elements_by_group": {k: dict(v) for k, v in _ELEMENTS_BY_GROUP.items()},
        # ZeRO-1's (parallel.zero): each set of buckets' group size and the parameters' local
        # elements it carries
        "zero1_buckets": [
            {
                "group_size": buckets.ranks,
                "elements": sum(_local(p).numel() for p in buckets.params),
            }
            for buckets, _ in trainer.sharder.parts
        ]
        if trainer.sharder
        else None,
        "moe_layers": _moe(model),
        "attention": _attention(trainer),
        "all_to_all": dict(_ALL_TO_ALL),
        "optimizer_state": [
            {
                "param": names.get(id(p), "?"),
                "key": key,
                "class": type(_local(v)).__name__,
                "dtype": str(v.dtype),
                "device": str(_local(v).device),
                "numel": _local(v).numel(),
                "bytes": local_bytes(v),
                "in_file": _in_file(v),
                # the state lives apart from the parameters (offload=optimizer: host masters, not
                # the model's tensors)
                "shares_param_storage": _storage(v) is not None
                and _storage(v).data_ptr() in param_storages,
            }
            for p, state in optimizer.state.items()
            for key, v in state.items()
            if isinstance(v, torch.Tensor) and v.ndim > 0
        ],
        "optimizer_class": type(optimizer).__name__,
        # optim.implementation=compiled: calls a step
        "optimizer_chunks": len(getattr(optimizer, "_chunks", ())),
        # offload=optimizer: the host copies the step updates (masters), and the bytes this rank
        # keeps in files
        "host_masters": [
            {
                "device": str(_local(m).device),
                "in_file": _in_file(m),
                "shares_param_storage": _storage(m).data_ptr() in param_storages,
            }
            for _, m, _ in getattr(optimizer, "pairs", ())
        ],
        "host_file_bytes": getattr(optimizer, "host_file_bytes", 0),
        # the head's compute dtype, where this rank has it
        "output_dtypes": sorted(set(trainer._probe_output_dtypes)),
        "head_saved_weight_dtypes": sorted(getattr(trainer, "_probe_head_saved", ())),
        # what the (uncompiled) blocks computed from: the residual stream they got, and their
        # weights as the projections held them during the forward (FSDP's cast copies, or autocast's
        # fp32 parameters)
        "block_input_dtypes": sorted(trainer._probe_block_dtypes["input"]),
        "block_weight_dtypes": sorted(trainer._probe_block_dtypes["weight"]),
        "loss_scaler": trainer.scaler is not None,
        "compiled_blocks": [i for i, b in model.layers.items() if _compiled(b)],
        "offloaded_blocks": [i for i, b in model.layers.items() if _offloaded(b)],
        # the first step's saved tensors that went through the host copy (and back), and those kept
        # on the device
        "activation_offload": asdict(model.activation_offload.counters)
        if hasattr(model, "activation_offload")
        else None,
        "checkpointed_blocks": [i for i, b in model.layers.items() if _checkpointed(b)],
        "dynamo": {
            k: dict(counters[k]) for k in ("stats", "frames")
        },  # torchao's optimizer step compiles too
        # graphs dynamo compiled for the blocks (the caches of the frames it traces: the block's
        # forward, or under activation checkpointing the checkpointed forward that runs it; the
        # blocks', no one else's)
        "block_forward_graphs": sum(
            len(_debug_get_cache_entry_list(code))
            for code in (
                type(next(iter(model.layers.values()))).forward.__code__,
                checkpointed_forward.__code__,
            )
        ),
        # graphs compiled for the loss's forward and backward chunk kernels (on the ranks that
        # compute the loss)
        "loss_graphs": [
            len(_debug_get_cache_entry_list(kernel.__code__))
            for kernel in (loss_module._chunk_logsumexp, loss_module._chunk_grad_in_place)
        ],
        "computes_loss": trainer.pipeline is None or trainer.runs_last_stage,
    }


_init, _train_step = Trainer.__init__, Trainer.train_step


def _record_head_saves(trainer: Trainer, head) -> None:
    """The dtypes of what the head's forward saves for backward in the shape of its weight (or its
    transpose): the weight itself (fp32) or a low-precision cast of it."""
    trainer._probe_head_saved = saved = set()
    shapes = {tuple(head.weight.shape), tuple(head.weight.shape[::-1])}

    def pack(t):
        if tuple(t.shape) in shapes:
            saved.add(str(t.dtype))
        return t

    active = []  # the hooks of the head's call in progress

    def enter(module, args):
        active.append(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
        active[-1].__enter__()

    head.register_forward_pre_hook(enter)
    head.register_forward_hook(lambda module, args, output: active.pop().__exit__(None, None, None))


def __init__(self: Trainer, *args, **kwargs) -> None:
    for counter in _ELEMENTS_BY_GROUP.values():
        counter.clear()
    _init(self, *args, **kwargs)
    self._probe_output_dtypes = []
    # outside the blocks, so never inside a compiled graph
    head = getattr(self.model, "output", None)
    if head is not None:
        head.register_forward_hook(
            lambda module, inputs, output: self._probe_output_dtypes.append(str(output.dtype))
        )
        _record_head_saves(self, head)
    self._probe_block_dtypes = dtypes = {"input": set(), "weight": set()}
    first_tokens = lambda module, args: setattr(  # noqa: E731  (the tokens of a sequence, at the first call)
        module, "_probe_tokens", getattr(module, "_probe_tokens", None) or args[0].shape[1]
    )
    for block in self.model.layers.values():  # what each block's attention and residual stream hold
        attention = getattr(block, "attention", None)
        if attention is None:
            continue
        # hooks inside a compiled block would be traced into (and guard) its graphs
        if _compiled(block):
            continue
        attention.register_forward_pre_hook(first_tokens)
        block.register_forward_pre_hook(first_tokens)
        block.register_forward_pre_hook(
            lambda module, args: dtypes["input"].add(str(args[0].dtype))
        )
        attention.wq.register_forward_pre_hook(
            lambda module, args: dtypes["weight"].add(str(module.weight.dtype))
        )
        attention._probe_heads = {}
        for name in (
            "wq",
            "wk",
        ):  # the heads this rank projects (a tp rank's share under tensor parallel)
            getattr(attention, name).register_forward_hook(partial(_first_heads, attention, name))


def _first_heads(attention: torch.nn.Module, name: str, module, args, out: torch.Tensor) -> None:
    """Its projection ``name``'s heads, at the first call (returning nothing, the output stays the
    module's)."""
    attention._probe_heads.setdefault(name, out.shape[-1] // attention.head_dim)


def _tied_twin(trainer: Trainer) -> dict | None:
    """This rank's tied embedding, or its twin head on the last pipeline stage (``parallel.tied``):
    its name, its embedding group's ranks and a digest of its values and its optimizer state (equal
    twins, equal digests)."""
    from composer3d.parallel.pipeline.tied import twins_of

    twins = twins_of(trainer.model)
    if twins is None or twins.group is None:
        return None
    params = dict(trainer.model.named_parameters())
    name = twins.embedding if twins.embedding in params else twins.head

    def digest(t):
        return hashlib.sha256(_local(t).detach().cpu().contiguous().numpy().tobytes()).hexdigest()

    state = trainer.optimizer.state.get(params[name], {})
    return {
        "name": name,
        "group": dist.get_process_group_ranks(twins.group),
        "step": trainer.step,
        "placements": [str(p) for p in getattr(params[name], "placements", ())],
        "values": digest(params[name]),
        "optimizer_state": {
            k: digest(v)
            for k, v in sorted(state.items())
            if isinstance(v, torch.Tensor) and v.ndim > 0
        },
    }


def train_step(self: Trainer) -> dict:
    metrics = _train_step(self)
    # read now: a group of jobs sets it per job
    directory = Path(os.environ["COMPOSER3D_TEST_EFFECTS"])
    if self.step == 1:  # optimizer state, gradients and compiled graphs exist now
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"rank{dist.get_rank()}.json").write_text(json.dumps(_effects(self), indent=1))
    twin = _tied_twin(self)
    if twin is not None:  # after every step: the last one written is the run's end
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"twin{dist.get_rank()}.json").write_text(json.dumps(twin))
    return metrics


Trainer.__init__, Trainer.train_step = __init__, train_step
