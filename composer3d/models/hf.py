"""Any Hugging Face causal LM as a composer3d model (``model=hf model.path=<dir>``).

transformers builds the model on the meta device (``AutoModelForCausalLM.from_config``); ``HFCausalLM`` keeps its
base model (``model``) and head (``lm_head``) as children, so every parameter keeps the checkpoint's own name
(``model.layers.3.self_attn.q_proj.weight``): loading, saving and exporting need no name mapping. It offers the
protocol every composer3d model has — ``tok_embeddings``, ``layers`` (a ModuleDict by index), ``norm``,
``output``, and a ``forward`` that can run a slice of layers — so the same ``parallelize()`` (PP split, TP/SP,
activation checkpointing, compile, FSDP) applies, with no second code path.

The forward is the decoder loop of transformers' text models (embed → masks and rotary embeddings → decoder
layers → norm → head), written once over the modules transformers built, so a pipeline stage can start at any
layer. Attention masks come from transformers' own mask functions, per layer type (full or sliding window), and
from ``position_ids``: positions that restart mark packed documents, which the mask functions keep apart.

Tensor parallel comes from the model's own ``base_model_tp_plan``, translated in ``TP_STYLES`` (the one table);
the embedding, final norm, head (vocab-parallel, loss parallel) and sequence-parallel norms are ours.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from composer3d.errors import ConfigError
from composer3d.models.init import InitRule

# --------------------------------------------------------------------------------------------- config


def resolve_model_dir(path: str | None) -> str:
    """A local directory for ``model.path``: the directory itself, or a hub id's snapshot in the local cache."""
    if not path:
        raise ConfigError("model.path: model=hf needs the Hugging Face model to train. Set model.path=<local "
                          "directory with config.json and *.safetensors> (or a hub id already in the local cache)")
    if os.path.isdir(path):
        return os.path.abspath(path)
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)  # never downloads
    except Exception:  # noqa: BLE001 — any failure means "not available locally"
        raise ConfigError(f"model.path: {path!r} is neither a local directory nor a model in the local Hugging Face "
                          "cache (nothing is downloaded at run time). Download it first (huggingface-cli download) "
                          "or point model.path at a directory holding config.json") from None


def load_hf_config(path: str, attn_implementation: str | None = None):
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(path, "config.json")):
        raise ConfigError(f"model.path: {path} has no config.json. Point it at a Hugging Face model directory")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    return config


def fill_model_config(m) -> None:
    """Resolve ``model.path`` and copy the sizes from its config.json into the model config (what validation,
    pipeline splitting and logging read). Runs at launch, in the launcher and in every worker alike."""
    m.path = resolve_model_dir(m.path)
    c = load_hf_config(m.path)
    m.dim = c.hidden_size
    m.n_layers = c.num_hidden_layers
    m.n_heads = c.num_attention_heads
    m.n_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    m.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    m.vocab_size = c.vocab_size
    m.ffn_hidden_dim = getattr(c, "intermediate_size", None)
    m.max_seq_len = getattr(c, "max_position_embeddings", None) or m.max_seq_len
    m.tie_embeddings = bool(getattr(c, "tie_word_embeddings", False))


def tp_split_sizes(m) -> list[tuple[str, int]]:
    sizes = [("num_attention_heads", m.n_heads), ("num_key_value_heads", m.n_kv_heads or m.n_heads),
             ("vocab_size", m.vocab_size)]
    if m.ffn_hidden_dim:
        sizes.append(("intermediate_size", m.ffn_hidden_dim))
    return sizes


def tensor_parallel_problem(m) -> str | None:
    """Why this model cannot run tensor parallel (no plan, or a style the table does not know), else None."""
    config = load_hf_config(m.path)
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        return (f"{config.model_type} defines no tensor-parallel plan (base_model_tp_plan) in transformers; "
                "it trains with FSDP and pipeline parallel only")
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            return (f"module {pattern} of {config.model_type} asks for tensor-parallel style {style!r}, which "
                    f"composer3d does not translate (known: {sorted(TP_STYLES)})")
    return None


# ---------------------------------------------------------------------------------------------- model

_REQUIRED = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head")


class HFCausalLM(nn.Module):
    """A transformers causal LM (built on meta) behind composer3d's model protocol; names stay transformers'."""

    def __init__(self, cfg):
        super().__init__()
        from transformers import AutoModelForCausalLM

        config = load_hf_config(resolve_model_dir(cfg.path), cfg.attn_implementation)
        causal = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        missing = [name for name in _REQUIRED if not _has_submodule(causal, name)]
        if missing:
            raise ConfigError(f"model.path: {type(causal).__name__} lacks {missing}; composer3d runs decoder-only "
                              "text models laid out as transformers' Llama family (model.embed_tokens, model.layers, "
                              "model.norm, model.rotary_emb, lm_head)")
        self.config = causal.config
        self.model = causal.model
        self.lm_head = causal.lm_head
        # A dict keyed by layer index keeps names ("model.layers.3…") when a pipeline stage drops layers.
        self.model.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(self.model.layers)})
        self.sequence_shards = 1  # the residual stream is split over this many ranks (set by sequence parallel)
        self.tie_weights()
        self.full_shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        # Each parameter's owner, copied while still whole and on meta: its init runs on that copy (init_rule).
        self._owners = {name: copy.deepcopy(self.get_submodule(name.rpartition(".")[0]))
                        for name in self.full_shapes}
        self._rotary_by_type = "layer_type" in inspect.signature(self.model.rotary_emb.forward).parameters

    # The protocol's names for transformers' modules (a pipeline stage sets those it does not run to None).
    @property
    def tok_embeddings(self):
        return self.model.embed_tokens

    @tok_embeddings.setter
    def tok_embeddings(self, module):
        self.model.embed_tokens = module

    @property
    def layers(self) -> nn.ModuleDict:
        return self.model.layers

    @property
    def norm(self):
        return self.model.norm

    @norm.setter
    def norm(self, module):
        self.model.norm = module

    @property
    def output(self):
        return self.lm_head

    @output.setter
    def output(self, module):
        self.lm_head = module

    def tie_weights(self) -> None:
        if getattr(self.config, "tie_word_embeddings", False) and self.tok_embeddings is not None \
                and self.lm_head is not None:
            self.lm_head.weight = self.tok_embeddings.weight

    def init_rule(self, name: str) -> InitRule:
        """transformers' own ``_init_weights`` for the parameter's module, on a whole CPU copy of that module, with
        the global RNG seeded by (seed, name): the model's init scheme, independent of the layout."""
        owner, attr = self._owners[name], name.rpartition(".")[2]

        def rule(shape, generator, device):
            module = copy.deepcopy(owner).to_empty(device="cpu")
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(generator.initial_seed())
                self.model._init_weights(module)
            return getattr(module, attr).detach().to(device)
        return rule

    @torch.no_grad()
    def init_buffers(self, device: torch.device) -> None:
        """Recompute buffers (rotary frequencies, embedding scales) that ``to_empty`` left uninitialized, through
        transformers' ``_init_weights`` with every parameter marked initialized so only buffers are written."""
        params = list(self.parameters())
        for p in params:
            p._is_hf_initialized = True
        try:
            for module in self.modules():
                if any(True for _ in module.buffers(recurse=False)):
                    self.model._init_weights(module)
        finally:
            for p in params:
                del p._is_hf_initialized

    def _layer_type(self, layer_id: str) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[int(layer_id)]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) else "full_attention"

    def _masks(self, reference: torch.Tensor, position_ids: torch.Tensor, kinds: set[str]) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        makers = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {kind: makers[kind](config=self.config, inputs_embeds=reference, attention_mask=None,
                                   past_key_values=None, position_ids=position_ids) for kind in kinds}

    def forward(self, x: torch.Tensor, layer_ids: list[str] | None = None, embed: bool = True, head: bool = True,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (or a previous stage's hidden states) → logits (or hidden states) over ``layer_ids``."""
        h = self.tok_embeddings(x) if embed else x
        layer_ids = list(self.layers.keys()) if layer_ids is None else layer_ids
        if layer_ids:
            # Under sequence parallel a stage's input holds a slice of the sequence; masks and rotary
            # embeddings are built for the whole of it (attention all-gathers the sequence).
            seq = x.shape[1] if embed else h.shape[1] * self.sequence_shards
            if position_ids is None:
                position_ids = torch.arange(seq, device=h.device).unsqueeze(0)
            local = h.to_local() if isinstance(h, DTensor) else h
            reference = local.new_empty((local.shape[0], seq, 0))  # masks read batch, length, dtype, device
            kinds = {self._layer_type(i) for i in layer_ids}
            masks = self._masks(reference, position_ids, kinds)
            if self._rotary_by_type:
                rotary = {kind: self.model.rotary_emb(reference, position_ids, kind) for kind in kinds}
            else:
                shared = self.model.rotary_emb(reference, position_ids)
                rotary = {kind: shared for kind in kinds}
            for i in layer_ids:
                kind = self._layer_type(i)
                out = self.layers[i](h, attention_mask=masks[kind], position_embeddings=rotary[kind],
                                     position_ids=position_ids)
                h = out[0] if isinstance(out, tuple) else out
        if not head:
            return h
        logits = self.lm_head(self.norm(h))
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _has_submodule(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


# ---------------------------------------------------------------------------------------- tensor parallel


class _GatherSequence(ParallelStyle):
    """Sequence parallel: all-gather a sequence-sharded residual stream on entry to attention or the MLP.

    transformers passes the hidden states positionally to some modules and as ``hidden_states=`` to others, so
    this takes either (``PrepareModuleInput`` needs to know which)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def gather(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, DTensor):
                t = DTensor.from_local(t, device_mesh, [Shard(1)], run_check=False)
            return t.redistribute(placements=[Replicate()]).to_local()

        def hook(_module, args, kwargs):
            if "hidden_states" in kwargs:
                kwargs = {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}
            else:
                args = (gather(args[0]), *args[1:])
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _styles(float8: bool):
    if float8:
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

        return Float8ColwiseParallel, Float8RowwiseParallel
    return ColwiseParallel, RowwiseParallel


# transformers' style name → our DTensor style, given (residual layout, float8). Style names differ across
# transformers versions (colwise_rep / colwise_gather_output, …); all spellings land here.
TP_STYLES: dict[str, Callable[[Any, bool], ParallelStyle | None]] = {
    "colwise": lambda residual, f8: _styles(f8)[0](),
    "rowwise": lambda residual, f8: _styles(f8)[1](output_layouts=residual),
    # Fused projections (Phi-3's qkv_proj, gate_up_proj) are sliced by global sizes: full output on every rank.
    "colwise_gather_output": lambda residual, f8: _styles(f8)[0](output_layouts=Replicate()),
    "colwise_rep": lambda residual, f8: _styles(f8)[0](output_layouts=Replicate()),
    "rowwise_split_input": lambda residual, f8: _styles(f8)[1](input_layouts=Replicate(), output_layouts=residual),
    "rowwise_rep": lambda residual, f8: _styles(f8)[1](input_layouts=Replicate(), output_layouts=residual),
    # Per-head norms (Qwen3's q_norm/k_norm) see only this rank's heads: replicated weights whose gradients are
    # summed over the tp group — what a replicated DTensor parameter fed a head-sharded input does.
    "replicated_with_grad_allreduce": lambda residual, f8: SequenceParallel(sequence_dim=2, use_local_output=True),
    "sequence_parallel": lambda residual, f8: SequenceParallel(use_local_output=True),
    "embedding_rowwise": lambda residual, f8: RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
    "replicate": lambda residual, f8: None,
    "local": lambda residual, f8: None,
}

_LAYER_PREFIX = "layers.*."


def tensor_parallel_plan(model: HFCausalLM, sequence_parallel: bool, float8: bool = False
                         ) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle]]:
    """(root plan, per-layer plan) from the model's ``base_model_tp_plan``.

    Ours on top of transformers' plan: a vocab-parallel embedding, a head whose logits stay vocab-sharded (the loss
    runs on the shards: ``composer3d.loss``), and with sequence parallel every norm on the residual stream (the decoder
    layer's own norm children and the final norm) on a slice of the sequence, with attention and MLP inputs
    all-gathered on entry (their row-parallel outputs are reduce-scattered back by the plan).
    """
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    residual = Shard(1) if sequence_parallel else Replicate()
    block: dict[str, ParallelStyle] = {}
    root: dict[str, ParallelStyle] = {}
    for pattern, name in plan.items():
        if name not in TP_STYLES:
            raise ConfigError(f"parallel.tp: module {pattern} asks for tensor-parallel style {name!r}, which "
                              f"composer3d does not translate (known: {sorted(TP_STYLES)}). Use parallel.tp=1")
        style = TP_STYLES[name](residual, float8)
        if style is None:
            continue
        if pattern.startswith(_LAYER_PREFIX):
            block[pattern[len(_LAYER_PREFIX):]] = style
        elif pattern not in ("embed_tokens", "norm"):
            root[f"model.{pattern}"] = style
    root["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    root["lm_head"] = ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)
    if sequence_parallel:
        root["model.norm"] = SequenceParallel(use_local_output=True)
        layer = next(iter(model.layers.values()))
        for child_name, child in layer.named_children():
            if "norm" in type(child).__name__.lower():
                block[child_name] = SequenceParallel(use_local_output=True)
            elif any(key.startswith(child_name + ".") for key in block):
                block[child_name] = _GatherSequence()  # attention, MLP: they hold the planned projections
    return root, block


# ---------------------------------------------------------------------------------------- weight loading


def safetensors_index(path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name → (shape, file) of every tensor in the directory's safetensors files (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: {path} holds no *.safetensors weights (composer3d reads only safetensors). "
                          "Convert the checkpoint with save_pretrained(safe_serialization=True), or use "
                          "model.pretrained=false to train from a random init")
    index: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                index[key] = (tuple(f.get_slice(key).get_shape()), file.name)
    return index


def check_checkpoint_keys(model: HFCausalLM, index: dict[str, tuple[tuple[int, ...], str]], path: str) -> None:
    """Missing, unexpected and mis-shaped tensors, against the whole model (every rank checks the same)."""
    expected = model.full_shapes
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = sorted(set(expected) - set(index))
    unexpected = sorted(set(index) - set(expected) - ({"lm_head.weight"} if tied else set()))
    wrong = sorted(f"{k}: file {index[k][0]} vs model {expected[k]}" for k in set(expected) & set(index)
                   if index[k][0] != expected[k])
    problems = []
    if missing:
        hint = (" (config.json says tie_word_embeddings=false, but the file has no separate head)"
                if missing == ["lm_head.weight"] else "")
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:4]}{hint}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensors, e.g. {unexpected[:4]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches, e.g. {wrong[:3]} (config.json does not match the weights: "
                        "check num_key_value_heads, head_dim, intermediate_size, vocab_size)")
    if problems:
        raise ConfigError(f"model.path: the weights in {path} do not fit the model its config.json describes: "
                          + "; ".join(problems) + ". Use the directory save_pretrained wrote, unmodified")


def load_pretrained(model: HFCausalLM, path: str) -> None:
    """Read each rank's shards of its parameters straight from the safetensors files (DCP's Hugging Face reader
    reads only the slices a rank holds; no rank ever holds the whole model). Tied heads load with the embedding."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader, load

    check_checkpoint_keys(model, safetensors_index(path), path)
    state = dict(model.named_parameters())  # this rank's parameters (a pipeline stage has only its own)
    load(state, storage_reader=HuggingFaceStorageReader(path), no_dist=not dist.is_initialized())


def export_files(path: str) -> list[str]:
    """Files of the model directory that travel with exported weights (config, tokenizer, generation config)."""
    keep = []
    for name in sorted(os.listdir(path)):
        if name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name == "model.safetensors.index.json":
            continue
        if os.path.isfile(os.path.join(path, name)) and (name.endswith((".json", ".model", ".txt", ".jinja"))):
            keep.append(name)
    return keep
