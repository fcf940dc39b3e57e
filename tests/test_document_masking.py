"""Document masking in the native Llama: packed documents (restarting position_ids) attend only
within themselves.

Checked against transformers' LlamaForCausalLM holding the same weights
(``llama.hf_state_dict_from_native``), fp32 on the CPU: fed the packed rows with their position_ids,
and fed each document alone (the independent reference). The multi-process layouts (FSDP, TP+SP, PP)
are checked in test_data_formats.py on a corpus of short documents.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import find_packed_sequence_indices

from composer3d.config.schema import ModelConfig
from composer3d.data.packing import document_positions
from composer3d.models import build_model, llama
from composer3d.models.init import materialize

pytestmark = pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile:UserWarning"
)
ATOL = 1e-5
# init_std 0.1: attention sharp enough that a token seeing another document moves its logits by ~1,
# far above ATOL.
TINY = ModelConfig(
    name="llama",
    dim=64,
    n_layers=2,
    n_heads=8,
    n_kv_heads=4,
    vocab_size=512,
    ffn_hidden_dim=96,
    max_seq_len=64,
    init_std=0.1,
)
SEQ = 40
# Documents per row, as (first token, length): row 0 holds two, row 1 three (one of a single token).
DOCUMENTS = [[(0, 15), (15, 25)], [(0, 30), (30, 1), (31, 9)]]


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, LlamaForCausalLM]:
    native = build_model(TINY)
    materialize(native, torch.device("cpu"), seed=0)
    hf = LlamaForCausalLM(LlamaConfig(**llama.hf_config_from_native(TINY))).eval()
    hf.load_state_dict(llama.hf_state_dict_from_native(native.state_dict(), TINY))
    return native.eval(), hf


def _packed() -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows and their position_ids as data.document_masking makes them (restarting at each
    document)."""
    tokens = torch.randint(
        0, TINY.vocab_size, (len(DOCUMENTS), SEQ), generator=torch.Generator().manual_seed(0)
    )
    starts = torch.zeros(tokens.shape, dtype=torch.bool)
    for row, documents in enumerate(DOCUMENTS):
        starts[row, [first for first, _ in documents]] = True
    return tokens, document_positions(starts)


@torch.no_grad()
def test_packed_documents_match_transformers(models):
    native, hf = models
    tokens, positions = _packed()
    logits = native(tokens, position_ids=positions)
    # transformers finds the packed documents from position_ids only with neither attention_mask nor
    # a cache (in eval mode use_cache defaults to true, and its forward then masks causally over the
    # whole row).
    packed = hf(tokens, position_ids=positions, use_cache=False).logits
    assert (logits - packed).abs().max() < ATOL
    for row, documents in enumerate(DOCUMENTS):
        for first, length in documents:
            alone = hf(tokens[row : row + 1, first : first + length]).logits[0]
            assert (logits[row, first : first + length] - alone).abs().max() < ATOL, (row, first)


@torch.no_grad()
def test_document_masking_changes_attention_and_plain_positions_keep_causal(models):
    native, _ = models
    tokens, positions = _packed()
    causal = native(tokens)
    masked = native(tokens, position_ids=positions)
    plain = torch.arange(SEQ).expand(tokens.shape)
    # no restart: the causal kernel, RoPE from 0
    assert torch.equal(native(tokens, position_ids=plain), causal)
    second = DOCUMENTS[0][1][0]
    # the first document sees what it saw
    assert (masked[0, :second] - causal[0, :second]).abs().max() < ATOL
    # the second no longer sees the first
    assert (masked[0, second:] - causal[0, second:]).abs().max() > 0.1


def test_document_ids_follow_transformers_packed_sequence_rule():
    positions = torch.tensor(
        [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 5, 6, 7, 2, 3, 4], [3, 4, 5, 6, 7, 8, 9, 10]]
    )
    expected = find_packed_sequence_indices(positions[:2])
    assert torch.equal(llama.document_ids(positions[:2]), expected)
    # one document: transformers returns None for it
    assert not llama.document_ids(positions[2:]).any()


@torch.no_grad()
def test_flex_block_mask_gives_the_sdpa_mask_logits(models, monkeypatch):
    """The flex-attention path (taken on Triton accelerators), run here eagerly on the CPU: the same
    logits as the boolean mask SDPA takes, grouped-query heads included."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    native, _ = models
    tokens, positions = _packed()
    fallback = native(tokens, position_ids=positions)
    monkeypatch.setattr(llama.attention, "_flex_fits", lambda device_type, head_dim: True)
    # eager: no CPU compile
    monkeypatch.setattr(llama.attention, "_compiled_flex", (flex_attention, create_block_mask))
    assert isinstance(llama.document_mask(llama.document_ids(positions), head_dim=16), BlockMask)
    flex = native(tokens, position_ids=positions)
    assert (flex - fallback).abs().max() < ATOL


def test_flex_is_taken_only_where_its_kernels_exist(monkeypatch):
    """Flex attention on a Triton accelerator for heads of 16 dims and more; the tiny model's 8-dim
    heads (and the CPU) take the exact SDPA mask: inductor's flex kernels refuse heads under 16
    ("NYI"), which failed the tiny model with document masking on CUDA."""
    fits = llama.attention._flex_fits.__wrapped__
    monkeypatch.setattr(llama.attention, "has_triton", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert fits("cuda", 64) and fits("cuda", 16)
    assert not fits("cuda", 8) and not fits("cpu", 64)
