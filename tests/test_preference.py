"""Preference tuning (``train.objective=dpo``, ``data.format=preference``): pairs packed whole into
rows, the losses and metrics exact against TRL, the reference model, the refusals, and the layouts.

TRL's own computation is the reference: ``DPOTrainer._compute_loss`` (sigmoid, ipo, hinge) and
``CPOTrainer.cpo_loss`` (label smoothing, simpo), called without a Trainer (a stand-in holds what
they read), on transformers' ``LlamaForCausalLM`` loaded from the same tiny directories, with one
padded sequence per completion. composer3d's side is its own path: its data pipeline (the pieces
tokenized, the pairs packed several to a row under the document mask), its Hugging Face model
(``model=hf``), its per-token log-probabilities (the chunked cross-entropy kernel) and its pair sums
and losses. The two share only the token ids (TRL's batch is built from the pairs composer3d
tokenized) and the weights' files. fp32 throughout: within 1e-5.
"""

from __future__ import annotations

import json
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import FAST, assert_follows, train_command, train_in_one_group
from hf_models import make_model
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from composer3d.config.checks import resolve_model_config, validate
from composer3d.config.registration import register_configs
from composer3d.data import (
    IGNORE_INDEX,
    GlobalBatchLoader,
    PreferenceSequences,
    build_sequences,
    build_tokenizer,
    preference_rows,
    tokenize_pairs,
)
from composer3d.data.preference import Pair
from composer3d.errors import ConfigError
from composer3d.models.moe import routing_counters
from composer3d.training.flops import embedding_params
from composer3d.training.loss import target_log_probs
from composer3d.training.preference import METRICS, pair_sums, preference_loss

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
ATOL = 1e-5
SEQ = 64
WORDS = "the quick brown fox jumps over the lazy dog while pipeline parallel splits layers".split()
PREFIX = "composer3d: invalid configuration: "


def _phrase(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(n))


def _write_pairs(path: Path, count: int) -> Path:
    with open(path, "w") as f:
        for i in range(count):
            row = {
                "prompt": _phrase(i, 2 + i % 4) + ":",
                "chosen": " " + _phrase(i + 3, 1 + i % 3),
                "rejected": " " + _phrase(i + 7, 1 + (i * 2) % 5),
            }
            f.write(json.dumps(row) + "\n")
    return path


def _write_conversations(path: Path, count: int) -> Path:
    """TRL's conversational form: a prompt of messages (a system message in some, a second turn in
    others), each reply one assistant message."""
    with open(path, "w") as f:
        for i in range(count):
            prompt = [{"role": "system", "content": "answer briefly"}] if i % 3 == 0 else []
            prompt.append({"role": "user", "content": _phrase(i, 2 + i % 3)})
            if i % 4 == 1:
                prompt += [
                    {"role": "assistant", "content": _phrase(i + 1, 2)},
                    {"role": "user", "content": _phrase(i + 2, 1)},
                ]
            row = {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": _phrase(i + 3, 1 + i % 3)}],
                "rejected": [{"role": "assistant", "content": _phrase(i + 7, 1 + (i * 2) % 4)}],
            }
            f.write(json.dumps(row) + "\n")
    return path


@pytest.fixture(scope="module")
def compose_cfg():
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        yield lambda *overrides: compose("train", overrides=["run.dir=unused", *overrides])


@pytest.fixture
def trl():
    """TRL, the reference of the exactness tests (the dev extra installs it on Python 3.11+)."""
    return pytest.importorskip("trl")


def _policy_and_reference(root: Path, model_type: str) -> dict[str, Path]:
    """A tiny ``model_type`` (the reference) and the same perturbed (the policy), each with the
    tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = make_model(root / "reference", model_type, num_hidden_layers=2)
    policy = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    policy.save_pretrained(root / "policy", safe_serialization=True)
    AutoTokenizer.from_pretrained(reference).save_pretrained(root / "policy")
    return {"reference": reference, "policy": root / "policy"}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    return _policy_and_reference(tmp_path_factory.mktemp("dpo_models"), "llama")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, Path]:
    """Qwen3-MoE: transformers' routed experts (its router loss off, as config.json has it)."""
    return _policy_and_reference(tmp_path_factory.mktemp("dpo_moe_models"), "qwen3_moe")


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    return _write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 12)


def _hf_cfg(compose_cfg, path: Path, pairs: Path, *overrides: str):
    cfg = compose_cfg(
        "model=hf",
        f"model.path={path}",
        "data=preference",
        f"data.paths=[{pairs}]",
        "train.objective=dpo",
        f"train.seq_len={SEQ}",
        "precision.param_dtype=float32",
        "launch.device=cpu",
        *overrides,
    )
    resolve_model_config(cfg.model)
    return cfg


# ------------------------------------------------------------------------------------ the packer


def _pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> Pair:
    return Pair(*(torch.tensor(ids) for ids in (prompt, chosen, rejected)))


def test_pairs_are_packed_whole_with_only_their_completions_as_targets():
    eos = 2
    pairs = [
        _pair([10, 11, 12], [20, 21, eos], [30, eos]),  # 11 tokens
        _pair([13], [22, eos], [31, 32, 33, eos]),  # 9: no room beside the first
        _pair([14, 15, 16, 17, 18], [23, eos], [34, eos]),  # 14: a row of its own
        _pair([19], [eos], [eos]),  # 4: the tightest fit is the first row (5 left)
    ]
    packed = PreferenceSequences.pack(pairs, seq_len=15, pad_id=eos)
    assert packed.pairs.tolist() == [2, 1, 1]
    assert packed.target_count([0, 2]) == 3 and packed.target_count([1]) == 1
    batch = packed.batch([0, 1, 2])
    assert batch.segment.shape == batch.targets.shape == (3, 15)
    # row 0: P0 + chosen, P0 + rejected, P3 + chosen, P3 + rejected, one padding token
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 1, 0, 1]
    trained = batch.targets != IGNORE_INDEX
    assert torch.equal(trained, batch.segment >= 0)
    by_segment = {
        s: batch.targets[0][batch.segment[0] == s].tolist()
        for s in batch.segment[0].unique().tolist()
    }
    assert by_segment == {
        -1: [IGNORE_INDEX] * 8,
        0: [20, 21, eos],
        1: [30, eos],
        2: [eos],
        3: [eos],
    }
    assert batch.targets[1][batch.segment[1] == 1].tolist() == [31, 32, 33, eos]
    assert batch.targets[2][batch.segment[2] == 0].tolist() == [23, eos]
    # the pair slots of a row and the pairs it holds: pair_sums's sums per side are the token counts
    counts = pair_sums((batch.segment >= 0).float(), batch.segment)
    assert counts[0, :3].tolist() == [[3.0, 2.0], [1.0, 1.0], [0.0, 0.0]]


def test_a_pair_longer_than_a_row_is_refused_naming_train_seq_len():
    with pytest.raises(ConfigError) as error:
        PreferenceSequences.pack([_pair([1, 2, 3], [4, 5], [6])], seq_len=7, pad_id=0)
    assert str(error.value).startswith("train.seq_len: preference row 0 takes 9 tokens"), (
        error.value
    )
    assert "train.seq_len>=8" in str(error.value)


def test_the_global_batch_of_pairs_is_the_same_under_any_data_parallel_layout():
    """Packed before any rank takes its slice: the dp slices of a step make up the one-process
    batch, every row holds both sides of each of its pairs, and every rank counts the global
    batch's pairs."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 200, (n,), generator=generator).tolist()

    pairs = [_pair(ids(1 + i % 5), ids(i % 3) + [2], ids(i % 4) + [2]) for i in range(60)]
    packed = PreferenceSequences.pack(pairs, seq_len=31, pad_id=2)
    again = PreferenceSequences.pack(pairs, seq_len=31, pad_id=2)
    assert all(
        torch.equal(a, b)
        for a, b in zip(vars(packed).values(), vars(again).values())
        if a is not None or b is not None  # the reference's sums: set before training
    )
    assert int(packed.pairs.sum()) == 60 and packed.pairs.max() > 1  # several pairs a row
    for row in range(len(packed)):
        held = set(packed.segment[row][packed.segment[row] >= 0].tolist())
        assert held == set(range(2 * int(packed.pairs[row]))), row
    one = GlobalBatchLoader(packed, 8, 0, 1, seed=3)
    ranks = [GlobalBatchLoader(packed, 8, r, 4, seed=3) for r in range(4)]
    for _ in range(3):
        whole, parts = one.next_batch(), [rank.next_batch() for rank in ranks]
        for field in ("inputs", "targets", "position_ids", "segment"):
            joined = torch.cat([getattr(part, field) for part in parts])
            assert torch.equal(getattr(whole, field), joined), field
        assert all(part.global_targets == whole.global_targets for part in parts)
        held = sum(len(set(row[row >= 0].tolist())) for row in whole.segment)
        assert whole.global_targets == held // 2  # a pair: two sides


# ---------------------------------------------------------------------------- against TRL


def _trl_batch(pairs: list[Pair]) -> dict:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    examples = [
        {
            "prompt_ids": p.prompt.tolist(),
            "chosen_ids": p.chosen.tolist(),
            "rejected_ids": p.rejected.tolist(),
        }
        for p in pairs
    ]
    return DataCollatorForPreference(pad_token_id=0)(examples)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()


def _trl_dpo(policy, reference, pairs: list[Pair], loss_type: str, beta: float):
    """TRL's DPO loss, the policy's gradients and TRL's logged metrics on ``pairs``."""
    from accelerate import Accelerator
    from trl import DPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(policy, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    add_fused_lm_head(reference)
    trainer = types.SimpleNamespace(
        accelerator=Accelerator(cpu=True),
        model=policy,
        ref_model=reference,
        precompute_ref_logps=False,
        aux_loss_enabled=False,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        f_alpha_divergence_coef=0.5,
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None, discopop_tau=0.05),
    )
    policy.zero_grad()
    loss = DPOTrainer._compute_loss(trainer, policy, _trl_batch(pairs), return_outputs=False)
    loss.backward()
    metrics = {name: trainer._metrics["train"][name][-1] for name in METRICS}
    return float(loss), _grads(policy), metrics


def _trl_cpo(policy, reference, pairs: list[Pair], loss_type: str, pref: dict):
    """TRL's CPO loss (its label-smoothed sigmoid, or SimPO) on the log-probabilities its own
    ``get_batch_logps`` takes from transformers' logits; for sigmoid, fed the log-ratios to the
    reference (the cDPO loss: its rewards are then DPO's)."""
    from trl.experimental.cpo import CPOTrainer

    batch = _trl_batch(pairs)
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    forward = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    average = loss_type == "simpo"
    policy.zero_grad()
    logps = CPOTrainer.get_batch_logps(policy(**forward).logits, labels, average_log_prob=average)
    chosen, rejected = logps.chunk(2)
    shown = {"logps/chosen": chosen.mean().item(), "logps/rejected": rejected.mean().item()}
    if loss_type != "simpo":
        with torch.no_grad():
            ref = CPOTrainer.get_batch_logps(reference(**forward).logits, labels)
        chosen, rejected = chosen - ref.chunk(2)[0], rejected - ref.chunk(2)[1]
    stand_in = types.SimpleNamespace(
        alpha=0.0, loss_type=loss_type, accelerator=types.SimpleNamespace(device="cpu"), **pref
    )
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stand_in, chosen, rejected)
    loss = losses.mean()
    loss.backward()
    metrics = {
        "rewards/chosen": chosen_rewards.mean().item(),
        "rewards/rejected": rejected_rewards.mean().item(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
        **shown,
    }
    return float(loss), _grads(policy), metrics


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _composer3d_model(cfg):
    """composer3d's model=hf model of ``cfg``, its weights loaded (one process, no layout)."""
    from composer3d.models import MODEL_REGISTRY, build_model
    from composer3d.models.init import materialize

    model = build_model(cfg.model)
    cpu = torch.device("cpu")
    materialize(model, cpu, 0, fsdp_roots=[], init_params=False, compute_device=cpu)
    spec = MODEL_REGISTRY["hf"]
    spec.load_pretrained(model, spec.pretrained_weights(cfg.model))
    return model.train()


def _composer3d_dpo(compose_cfg, models, pairs_file, *overrides: str):
    """composer3d's loss over every packed row, its gradients and metrics; and the pairs its data
    pipeline tokenized (TRL's batch is made of the same ids)."""
    cfg = _hf_cfg(compose_cfg, models["policy"], pairs_file, *overrides)
    sequences = build_sequences(cfg.data, cfg.model.vocab_size, SEQ, 0, cfg.model)
    pairs = tokenize_pairs(
        preference_rows(list(cfg.data.paths)), build_tokenizer(cfg.data, cfg.model), 0
    )
    rows = list(range(len(sequences)))
    assert len(rows) < len(pairs), "several pairs share a row"
    batch = sequences.batch(rows)
    policy = _composer3d_model(cfg)
    reference = _composer3d_model(_hf_cfg(compose_cfg, models["reference"], pairs_file))
    with torch.no_grad():
        ref = target_log_probs(
            reference(batch.inputs, position_ids=batch.position_ids), batch.targets
        )
    logits = policy(batch.inputs, position_ids=batch.position_ids)
    logps = target_log_probs(logits, batch.targets, in_place=True)
    loss, sums = preference_loss(logps, ref, batch.segment, cfg.preference)
    count = sequences.target_count(rows)
    (loss / count).backward()
    metrics = dict(zip(METRICS, (sums / count).tolist()))
    return float(loss) / count, _grads(policy), metrics, pairs


def _assert_same(ours, theirs, what: str) -> None:
    loss, grads, metrics = ours
    trl_loss, trl_grads, trl_metrics = theirs
    assert abs(loss - trl_loss) < ATOL, f"{what}: loss {loss} vs TRL's {trl_loss}"
    assert grads.keys() == trl_grads.keys(), what
    worst = max((grads[n] - trl_grads[n]).abs().max().item() for n in grads)
    assert worst < ATOL, f"{what}: max |Δgrad| = {worst:.3g}"
    assert max(g.abs().max().item() for g in grads.values()) > 1e-3, "the gradients are not zero"
    for name in METRICS:
        assert abs(metrics[name] - trl_metrics[name]) < ATOL, (what, name, metrics, trl_metrics)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_loss_gradients_and_metrics_equal_trls_dpo(trl, compose_cfg, models, pairs_file, loss_type):
    _assert_equals_trls_dpo(compose_cfg, models, pairs_file, loss_type)


def test_a_mixture_of_experts_equals_trls_dpo(trl, compose_cfg, moe_models, pairs_file):
    """transformers' routed experts (Qwen3-MoE) through composer3d's DPO, experts' gradients
    included."""
    _assert_equals_trls_dpo(compose_cfg, moe_models, pairs_file, "sigmoid")


def _assert_equals_trls_dpo(compose_cfg, models, pairs_file, loss_type: str) -> None:
    beta = 0.5
    *ours, pairs = _composer3d_dpo(
        compose_cfg,
        models,
        pairs_file,
        f"preference.loss_type={loss_type}",
        f"preference.beta={beta}",
    )
    theirs = _trl_dpo(
        _hf_model(models["policy"]), _hf_model(models["reference"]), pairs, loss_type, beta
    )
    _assert_same(ours, theirs, loss_type)
    assert 0 < ours[2]["rewards/accuracies"] < 1, "the pairs disagree: the strict > matters"


def test_parquet_rows_read_as_their_jsonl(compose_cfg, models, pairs_file, tmp_path):
    """The same rows, text or conversations, as .parquet (datasets' writer): the same pairs."""
    from datasets import Dataset

    cfg = _hf_cfg(compose_cfg, models["policy"], pairs_file)
    tokenizer = build_tokenizer(cfg.data, cfg.model)

    def ids(path: Path) -> list[list[list[int]]]:
        pairs = tokenize_pairs(preference_rows([str(path)]), tokenizer, 0)
        return [[p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()] for p in pairs]

    for jsonl in (pairs_file, _write_conversations(tmp_path / "conversations.jsonl", 6)):
        rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
        parquet = tmp_path / f"{jsonl.stem}.parquet"
        Dataset.from_list(rows).to_parquet(parquet)
        assert len(ids(jsonl)) == len(rows) and ids(jsonl) == ids(parquet), jsonl.stem


def test_conversations_tokenize_and_train_as_trls(trl, compose_cfg, models, tmp_path):
    """TRL's conversational form through the chat template: the prompt's, chosen's and rejected's
    token ids are those TRL's DPOTrainer makes of the same rows (its own dataset preparation), and
    the loss, gradients and metrics TRL's on them."""
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOTrainer

    conversations = _write_conversations(tmp_path / "conversations.jsonl", 12)
    cfg = _hf_cfg(compose_cfg, models["policy"], conversations)
    ours = tokenize_pairs(
        preference_rows([str(conversations)]), build_tokenizer(cfg.data, cfg.model), 0
    )
    tokenizer = AutoTokenizer.from_pretrained(models["policy"])
    Accelerator(cpu=True)  # TRL's preparation asks accelerate's process state
    theirs = DPOTrainer._prepare_dataset(
        types.SimpleNamespace(_tokenizer=tokenizer),
        Dataset.from_list([json.loads(line) for line in conversations.read_text().splitlines()]),
        tokenizer,
        types.SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start"),
        "train",
    )
    assert len(ours) == len(theirs) == 12
    for pair, row in zip(ours, theirs):
        assert pair.prompt.tolist() == row["prompt_ids"]
        assert pair.chosen.tolist() == row["chosen_ids"]
        assert pair.rejected.tolist() == row["rejected_ids"]
    _assert_equals_trls_dpo(compose_cfg, models, conversations, "sigmoid")


@pytest.mark.parametrize(
    "loss_type, pref",
    [
        ("sigmoid", {"beta": 0.5, "label_smoothing": 0.2, "simpo_gamma": 0.5}),
        ("simpo", {"beta": 2.0, "label_smoothing": 0.1, "simpo_gamma": 0.7}),
    ],
    ids=["label_smoothing", "simpo"],
)
def test_label_smoothing_and_simpo_equal_trls_cpo(
    trl, compose_cfg, models, pairs_file, loss_type, pref
):
    *ours, pairs = _composer3d_dpo(
        compose_cfg,
        models,
        pairs_file,
        f"preference.loss_type={loss_type}",
        *(f"preference.{key}={value}" for key, value in pref.items()),
    )
    theirs = _trl_cpo(
        _hf_model(models["policy"]), _hf_model(models["reference"]), pairs, loss_type, pref
    )
    _assert_same(ours, theirs, loss_type)


# --------------------------------------------------------------- the trainer, in one process


def _pairs_of(batch) -> list[Pair]:
    """The pairs a packed batch holds, read back from its rows (documents by their positions,
    completions by their segments)."""
    pairs = []
    for r in range(batch.inputs.shape[0]):
        tokens = torch.cat([batch.inputs[r], batch.targets[r, -1:]]).tolist()
        side_of = [-1] + batch.segment[r].tolist()  # per token: its segment as a target
        starts = (batch.position_ids[r] == 0).nonzero().flatten().tolist() + [len(tokens)]
        sides: dict[int, tuple[list[int], list[int]]] = {}
        for begin, end in zip(starts, starts[1:]):
            completion = [i for i in range(begin, end) if side_of[i] >= 0]
            if completion:
                segment = side_of[completion[0]]
                sides[segment] = (tokens[begin : completion[0]], [tokens[i] for i in completion])
        for slot in range(len(sides) // 2):
            (prompt, chosen), (_, rejected) = sides[2 * slot], sides[2 * slot + 1]
            pairs.append(_pair(prompt, chosen, rejected))
    return pairs


@pytest.fixture
def one_process_group():
    """A process group of one rank (torch's fake backend: a collective of one leaves its
    values), for a Trainer in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    yield
    dist.destroy_process_group()


def _trainer(cfg, from_checkpoint: bool = False):
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    layout = validate(cfg, 1)
    sequences = build_sequences(
        cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
    )
    mesh, cpu = ParallelMesh(layout, "cpu"), torch.device("cpu")
    return Trainer(cfg, mesh, cpu, sequences, from_checkpoint=from_checkpoint), sequences


STEPS = [
    "train.global_batch_size=4",
    "train.micro_batch_size=2",  # two micro-batches a step, summed
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "optim.weight_decay=0",
    "train.grad_clip=0",  # the gradients as computed
    "checkpoint.enabled=false",
]


@pytest.mark.parametrize("reference", ["copy", "precomputed"])
def test_the_trainers_steps_equal_trls_against_the_initial_policy(
    trl, compose_cfg, models, pairs_file, one_process_group, reference
):
    """Two steps of the Trainer (its second after an update, so the log-ratios are not 0): the
    logged loss and metrics, and the gradients, are TRL's on the same pairs, against a frozen copy
    of the initial policy or against the log-probabilities the untrained policy took of every pair
    before the first step. The copy holds no gradient and no optimizer state, and stays the initial
    policy; the precomputed run holds no model but the policy."""
    beta = 0.5
    cfg = _hf_cfg(
        compose_cfg,
        models["policy"],
        pairs_file,
        *STEPS,
        f"preference.beta={beta}",
        f"preference.reference={reference}",
    )
    trainer, sequences = _trainer(cfg)
    probe = GlobalBatchLoader(sequences, 4, 0, 1, cfg.train.seed)  # the loader's seeded order
    try:
        for step in (1, 2):
            pairs = _pairs_of(probe.next_batch())
            policy = _hf_model(models["policy"])  # TRL patches its head: a fresh one each step
            with torch.no_grad():
                policy.load_state_dict({n: p.detach() for n, p in trainer.model.named_parameters()})
            theirs = _trl_dpo(policy, _hf_model(models["policy"]), pairs, "sigmoid", beta)
            metrics = trainer.train_step()
            record = trainer.read_back([(step, metrics)], 0.0)[0]
            assert metrics["target_tokens"] == len(pairs)
            ours = (record["loss"], _grads(trainer.model), {k: record[k] for k in METRICS})
            _assert_same(ours, theirs, f"step {step}")
            trainer.zero_grad()
        assert record["rewards/margins"] != 0, "the policy has moved from the reference"
        initial = _hf_model(models["policy"]).state_dict()
        assert not torch.equal(trainer.model.lm_head.weight, initial["lm_head.weight"])
        reference = trainer.preference.reference
        if reference is None:  # precomputed: every pair's sums, kept with the data
            assert sequences.reference.shape == (int(sequences.pairs.sum()), 2)
            assert (sequences.reference < 0).all()
            return
        trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
        assert not any(p.requires_grad or p.grad is not None for p in reference.parameters())
        assert not any(id(p) in trained for p in reference.parameters())
        assert all(torch.equal(p, initial[n]) for n, p in reference.named_parameters())
    finally:
        trainer.close()


def test_a_resumed_runs_reference_is_the_initial_policy(
    compose_cfg, models, pairs_file, one_process_group
):
    """A resume builds the policy to be filled from the checkpoint (its weights only allocated), and
    the frozen copy from the run's initial weights (model.path) all the same."""
    cfg = _hf_cfg(compose_cfg, models["policy"], pairs_file, *STEPS)
    trainer, _ = _trainer(cfg, from_checkpoint=True)
    try:
        initial = _hf_model(models["policy"]).state_dict()
        reference = dict(trainer.preference.reference.named_parameters())
        assert reference.keys() == initial.keys()
        assert all(torch.equal(p, initial[n]) for n, p in reference.items())
    finally:
        trainer.close()


def test_a_resumed_run_precomputes_its_reference_with_a_copy_it_lets_go(
    compose_cfg, models, pairs_file, one_process_group
):
    """preference.reference=precomputed: a resumed run (its policy's weights only allocated, to be
    filled from the checkpoint) takes the pass with a frozen copy of the initial policy, and gets
    what the untrained policy took; the copy is not kept."""
    cfg = _hf_cfg(
        compose_cfg, models["policy"], pairs_file, *STEPS, "preference.reference=precomputed"
    )
    tables = []
    for resumed in (False, True):
        trainer, sequences = _trainer(cfg, from_checkpoint=resumed)
        try:
            trainer.step = 5 if resumed else 0
            trainer._precompute_reference()
            tables.append(sequences.reference)
            assert trainer.preference.reference is None
            assert trainer.preference.pending_pass is None
        finally:
            trainer.close()
    assert torch.allclose(tables[0], tables[1], rtol=0, atol=1e-5), (
        (tables[0] - tables[1]).abs().max()
    )
    assert (tables[0] < 0).all()


@pytest.mark.parametrize(
    ("extra", "share"),
    [
        ([], 4 / 3),
        (["peft=lora"], None),
        (["preference.loss_type=simpo"], 1),
        (["preference.reference=precomputed"], 1),
    ],
    ids=["copy", "adapters_off", "simpo", "precomputed"],
)
def test_the_flops_count_the_references_forward(compose_cfg, one_process_group, extra, share):
    """TFLOP/s and MFU count what runs: a full DPO step is a training step of the policy and a
    forward of its copy, 4/3 of SFT's FLOPs (a forward is a third of forward and backward); under
    LoRA the base's forward (2·N + the attention's) on top of LoRA's step; SimPO runs no
    reference. The planner's TFLOP/s count the same FLOPs a token (full weights: its LoRA count
    leaves out that frozen weights get no weight gradient)."""
    from composer3d.launch.rank import resolve_precision
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.plan import Workload, candidate_from_config, estimate
    from composer3d.plan.hardware import cluster_from_config
    from composer3d.training.assemble import build_parallel_model

    native = ["model=tiny", "train.seq_len=64", *extra]
    sft, dpo = (
        compose_cfg(*native, *more)
        for more in ([], ["data=preference", "data.paths=[unused]", "train.objective=dpo"])
    )
    cpu = torch.device("cpu")
    for c in (sft, dpo):  # each settled as a rank settles it
        resolve_precision(c, cpu, 1)
    mesh = ParallelMesh(validate(dpo, 1), "cpu")
    trained, preferred = (build_parallel_model(c, mesh, cpu) for c in (sft, dpo))
    if share is not None:
        assert dpo_flops(preferred) == round(share * dpo_flops(trained)), (preferred, trained)
        cluster = cluster_from_config(dpo.cluster, dpo.precision.param_dtype)
        planned = estimate(Workload.from_config(dpo), candidate_from_config(dpo, 1), cluster)
        planned_flops = planned.tflops_per_gpu * 1e12 / planned.tokens_per_s_per_gpu
        assert planned_flops == pytest.approx(dpo_flops(preferred), rel=1e-12)
    else:  # the reference is the base alone: its matmuls (no adapter) and its attention
        m = sft.model
        attention = 2 * m.n_layers * m.n_heads * (m.head_dim or m.dim // m.n_heads) * 64
        base = preferred.active_params - embedding_params(preferred.model)
        assert dpo_flops(preferred) - dpo_flops(trained) == 2 * base + attention


def dpo_flops(built) -> int:
    return built.flops_per_token


def test_lora_adapters_off_is_the_base_model(compose_cfg, models, pairs_file, one_process_group):
    """preference.reference=adapters_off: after a step has moved the adapters, the reference's
    log-probabilities are transformers' base model's (the policy's directory, no adapters), and the
    policy's are not."""
    cfg = _hf_cfg(
        compose_cfg,
        models["policy"],
        pairs_file,
        *STEPS,
        "peft=lora",
        "peft.alpha=64",
        "preference.reference=adapters_off",
    )
    trainer, sequences = _trainer(cfg)
    try:
        trainer.train_step()
        batch = sequences.batch(list(range(4)))
        args = (batch.inputs, batch.targets, batch.position_ids)
        reference = pair_sums(trainer.preference._reference_log_probs(*args), batch.segment)
        with torch.no_grad():
            logits = trainer.model(batch.inputs, position_ids=batch.position_ids)
        policy = pair_sums(target_log_probs(logits, batch.targets), batch.segment)
    finally:
        trainer.close()
    base = _hf_model(models["policy"]).eval()
    expected = []
    for pair in _pairs_of(batch):
        for completion in (pair.chosen, pair.rejected):
            ids = torch.cat([pair.prompt, completion])
            with torch.no_grad():
                logp = base(ids[None]).logits[0, :-1].log_softmax(-1)
            targets = ids[1:, None]
            expected.append(logp.gather(1, targets)[pair.prompt.numel() - 1 :].sum())
    held = pair_sums((batch.segment >= 0).float(), batch.segment)[..., 0] > 0
    ours, theirs = reference[held].flatten(), torch.stack(expected)
    assert (ours - theirs).abs().max() < ATOL, (ours, theirs)
    assert (policy[held].flatten() - theirs).abs().max() > 1e-3, "the adapters changed nothing"


@pytest.mark.parametrize(
    "extra",
    [[], ["peft=lora", "preference.reference=adapters_off", "model.moe.bias_update_rate=0"]],
    ids=["copy", "adapters_off"],
)
def test_a_mixture_of_experts_counts_and_balances_by_the_policys_routing(
    compose_cfg, pairs_file, one_process_group, extra
):
    """The reference's forwards route tokens too, but only the policy's count: the step's load is
    every token's top_k choices once per MoE layer, the auxiliary loss trains the policy's router
    (a full run) and the balancing bias moves; the frozen copy's stays as it started."""
    cfg = compose_cfg(
        "model=tiny_moe",
        "data=preference",
        f"data.paths=[{pairs_file}]",
        "train.objective=dpo",
        "train.seq_len=192",  # the tiny model's tokenizer spends more tokens a pair
        "precision.param_dtype=float32",
        "launch.device=cpu",
        *STEPS,
        *extra,
    )
    trainer, _ = _trainer(cfg)
    try:
        trainer.train_step()
        load = trainer.expert_load
        routed = load.window.sum(-1)
        assert routed.tolist() == [4 * 192 * cfg.model.moe.top_k] * len(load.layers)
        if trainer.preference.reference is trainer.model:  # LoRA: the router is frozen
            return
        routers = [layer.gate.weight for layer in load.layers]
        assert all(r.grad is not None and r.grad.abs().max() > 0 for r in routers)
        bias = [layer.expert_bias for layer in load.layers]
        assert all(b.abs().max() > 0 for b in bias), "the balancing bias moved"
        copy = [m.expert_bias for m in routing_counters(trainer.preference.reference)]
        assert len(copy) == len(bias) and all(not b.any() for b in copy)
    finally:
        trainer.close()


# ------------------------------------------------------------------------------- refusals


DPO = ["data=preference", "data.paths=[pairs.jsonl]", "train.objective=dpo", "model=tiny"]
LORA_OFF = [*DPO, "peft=lora", "preference.reference=adapters_off"]
REFUSALS = [
    # (id, overrides, world size, key, fragment)
    ("dpo_without_pairs", ["train.objective=dpo"], 1, "train.objective", "data=preference"),
    ("pairs_without_dpo", DPO[:2], 1, "data.format", "train.objective=dpo"),
    ("unknown_loss", [*DPO, "preference.loss_type=orpo"], 1, "preference.loss_type", "unknown"),
    ("beta", [*DPO, "preference.beta=0"], 1, "preference.beta", "> 0"),
    ("smoothing", [*DPO, "preference.label_smoothing=0.5"], 1, "preference.label_smoothing", "[0"),
    (
        "smoothing_hinge",
        [*DPO, "preference.loss_type=hinge", "preference.label_smoothing=0.1"],
        1,
        "preference.label_smoothing",
        "hinge",
    ),
    ("off_full", [*DPO, "preference.reference=adapters_off"], 1, "preference.reference", "peft"),
    (
        "off_saved",
        [*LORA_OFF, "peft.modules_to_save=[output]"],
        1,
        "preference.reference",
        "modules_to_save",
    ),
    ("off_init", [*LORA_OFF, "peft.init_from={adapter}"], 1, "preference.reference", "init_from"),
    (
        "pp_v_shaped",
        [*DPO, "parallel.pp=2", "parallel.pp_schedule=dualpipev", "model.n_layers=4"],
        2,
        "parallel.pp_schedule",
        "forward only, which torch's dualpipev cannot",
    ),
    ("fused", [*DPO, "train.loss_impl=fused"], 1, "train.loss_impl", "fused"),
    ("tile_loss", [*DPO, "memory.tile_loss=2"], 1, "memory.tile_loss", "tiles"),
    ("compile", [*DPO, "compile.enabled=true"], 1, "compile.enabled", "compiled"),
    (
        "off_moe_bias",
        [*DPO[:3], "model=tiny_moe", *LORA_OFF[4:]],
        1,
        "preference.reference",
        "model.moe.bias_update_rate=0",
    ),
    ("unmasked", [*DPO, "data.document_masking=false"], 1, "data.document_masking", "attend"),
    ("prepared", [*DPO, "data.prepared=/corpus"], 1, "data.prepared", "composer3d-prepare"),
]


@pytest.mark.parametrize(
    "overrides, world, key, fragment", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
def test_what_dpo_does_not_run_is_refused_naming_the_key(
    compose_cfg, tmp_path, overrides, world, key, fragment
):
    adapter = tmp_path / "adapter"  # what the peft checks read of a PEFT adapter directory
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg(*(o.format(adapter=adapter) for o in overrides)), world)
    message = str(error.value)
    assert message.startswith(key + ": ") and fragment in message, message


CONVERSATION = {
    "prompt": [{"role": "user", "content": "hi"}],
    "chosen": [{"role": "assistant", "content": "a"}],
    "rejected": [{"role": "assistant", "content": "b"}],
}


@pytest.mark.parametrize(
    "rows, key, fragment",
    [
        # model=tiny's byte-level tokenizer has no chat template to render them
        ([CONVERSATION], "data.tokenizer", "byte-level tokenizer has none"),
        ([{"prompt": "hi", "chosen": "a"}], "data.format", "rejected: NoneType"),
        ([{**CONVERSATION, "chosen": "a"}], "data.format", "chosen: str"),
        (
            [{"prompt": "hi", "chosen": "a", "rejected": "b"}, CONVERSATION],
            "data.paths",
            "mix text and conversational",
        ),
        ([{**CONVERSATION, "tools": [{"name": "f"}]}], "data.format", "['tools']"),
    ],
    ids=["conversations_without_template", "no_rejected", "mixed_row", "mixed_rows", "tools"],
)
def test_the_command_refuses_rows_it_cannot_read_before_any_worker(
    monkeypatch, capfd, tmp_path, rows, key, fragment
):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = [o for o in DPO if not o.startswith("data.paths")]
    run = train_command(
        monkeypatch,
        capfd,
        tmp_path / "run",
        *overrides,
        f"data.paths=[{pairs}]",
        "launch.device=cpu",
        nproc=2,
    )
    assert run.returncode == 2 and run.output.count(PREFIX) == 1, run.output
    assert "Traceback" not in run.output, run.output
    message = run.output[run.output.index(PREFIX) + len(PREFIX) :]
    assert message.startswith(key + ": ") and fragment in message, run.output


def test_resuming_a_checkpoint_of_another_objective_is_refused(compose_cfg):
    """A DPO run's reference is its initial weights: a checkpoint saved by an SFT run (or one that
    started elsewhere) would continue against the wrong one."""
    from composer3d.launch.preflight import check_same_reference

    dpo = compose_cfg(*DPO)
    sft = {"config": OmegaConf.to_container(compose_cfg("model=tiny"), resolve=True)}
    with pytest.raises(ConfigError) as error:
        check_same_reference(Path("step-5"), sft, dpo)
    assert str(error.value).startswith(
        "checkpoint.resume: step-5 was saved by a train.objective=sft"
    )
    other_seed = {"config": OmegaConf.to_container(compose_cfg(*DPO, "train.seed=7"), resolve=True)}
    with pytest.raises(ConfigError) as error:
        check_same_reference(Path("step-5"), other_seed, dpo)
    assert "train.seed=7" in str(error.value)
    same = {"config": OmegaConf.to_container(dpo, resolve=True)}
    check_same_reference(Path("step-5"), same, dpo)


# ------------------------------------------------------------------------------- the layouts


def test_dpo_follows_one_process_under_every_layout(tmp_path):
    """Full DPO (a frozen copy as the reference) under FSDP, DDP, HSDP, TP + SP, cp and PP, LoRA
    DPO against its base (adapters off) under FSDP, PP and PP × FSDP, QLoRA's under FSDP, DPO
    against precomputed reference log-probabilities under FSDP, PP and cp, and mixtures of experts
    (composer3d's, and a Hugging Face Qwen3-MoE) under EP × FSDP and PP, each on the one-process
    curve (a frozen copy's for the precomputed) over 10 steps; the metrics too. Resumed from step
    5: exact under the same layout, on the curve under another (precomputed: the pass taken again
    by a frozen copy)."""
    pairs = _write_pairs(tmp_path / "pairs.jsonl", 80)
    common = [
        *(o for o in FAST if not o.startswith(("train.seq_len", "model="))),
        "data=preference",
        f"data.paths=[{pairs}]",
        "train.objective=dpo",
        "train.seq_len=192",
        "train.steps=10",
        "precision.param_dtype=float32",
        "checkpoint.enabled=false",
        "optim.lr=3e-3",
        "optim.warmup_steps=2",
    ]
    full = ["model=tiny", *common, "preference.beta=0.5"]
    lora = [
        "model=tiny",
        *common,
        "peft=lora",
        "optim.lr=1e-2",
        "preference.reference=adapters_off",
    ]
    moe = ["model=tiny_moe", *common, "preference.beta=0.5"]
    qwen3_moe = make_model(tmp_path / "qwen3_moe", "qwen3_moe", num_hidden_layers=2)
    hf_moe = ["model=hf", f"model.path={qwen3_moe}", *common, "preference.beta=0.5"]
    # NF4 quantizes blocks of 64 with scales in blocks of 256: every base weight a multiple of both
    qlora = [
        *(o if o != "peft=lora" else "peft=qlora" for o in lora),
        "model.dim=256",
        "model.ffn_hidden_dim=1024",
    ]
    models = {"full": full, "lora": lora, "qlora": qlora, "moe": moe, "hf_moe": hf_moe}
    one = dict(
        zip(models, train_in_one_group([(tmp_path / f"one_{n}", o) for n, o in models.items()], 1))
    )
    pp = ["parallel.pp=2", "parallel.dp_shard=1"]
    precomputed = ["preference.reference=precomputed"]
    saves = ["checkpoint.enabled=true", "checkpoint.interval=5", "checkpoint.keep_last=0"]
    layouts = {
        "fsdp_full": ("full", [*full, "parallel.dp_shard=2"]),
        "tp_full": (
            "full",
            [*full, "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.dp_shard=1"],
        ),
        "fsdp_lora": ("lora", [*lora, "parallel.dp_shard=2"]),
        "fsdp_qlora": ("qlora", [*qlora, "parallel.dp_shard=2"]),
        "ddp_full": ("full", [*full, "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        # each rank a share of every row's tokens: a pair's sums completed over cp
        "cp_full": ("full", [*full, "parallel.cp=2", "parallel.dp_shard=1"]),
        # the reference's pipeline forward first, then the policy's step: the copy's stages, or
        # the policy's own with the adapters off
        "pp_full": ("full", [*full, *pp, *saves]),
        "pp_lora": ("lora", [*lora, *pp, "parallel.pp_schedule=gpipe"]),
        # the reference's sums taken in one pass before the first step, by the untrained policy
        "fsdp_precomputed": ("full", [*full, *precomputed, "parallel.dp_shard=2", *saves]),
        "pp_precomputed": ("full", [*full, *precomputed, *pp]),
        "cp_precomputed": ("full", [*full, *precomputed, "parallel.cp=2", "parallel.dp_shard=1"]),
        "ep_moe": ("moe", [*moe, "parallel.dp_shard=2", "parallel.ep=2"]),
        # transformers' routed experts
        "ep_hf_moe": ("hf_moe", [*hf_moe, "parallel.dp_shard=2", "parallel.ep=2"]),
        "pp_hf_moe": ("hf_moe", [*hf_moe, *pp]),
    }
    # after the runs they resume (a group's jobs run one after another): the step-5 checkpoint of
    # (the run, under these overrides)
    resumed = {
        "resumed_pp_full": ("pp_full", [*full, *pp]),
        # the pass again, by a frozen copy, and the checkpoint resharded onto another mesh
        "resumed_precomputed_as_pp": ("fsdp_precomputed", [*full, *precomputed, *pp]),
    }
    jobs = [(tmp_path / name, overrides) for name, (_, overrides) in layouts.items()]
    jobs += [
        (
            tmp_path / name,
            [
                *o,
                "checkpoint.enabled=true",
                f"checkpoint.resume={tmp_path / saved / 'checkpoints' / 'step-00000005'}",
            ],
        )
        for name, (saved, o) in resumed.items()
    ]
    runs = dict(zip([*layouts, *resumed], train_in_one_group(jobs, 2)))
    # on 4 ranks: the replicas' and the shards' mesh together, and a pipeline of sharded stages
    on_four = {
        "hsdp_full": ("full", [*full, "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
        "pp_fsdp_lora": ("lora", [*lora, "parallel.pp=2", "parallel.dp_shard=2"]),
    }
    runs |= dict(
        zip(
            on_four,
            train_in_one_group([(tmp_path / n, o) for n, (_, o) in on_four.items()], 4),
        )
    )
    layouts |= on_four
    for name, (saved, _) in resumed.items():
        # steps 6-10, exactly those of the run that saved (the same layout), or on its curve
        ours = {m["step"]: m for m in runs[name].metrics}
        theirs = {m["step"]: m for m in runs[saved].metrics}
        assert sorted(ours) == [6, 7, 8, 9, 10], (name, ours)
        exact = name == "resumed_pp_full"
        for step, record in ours.items():
            for key in ("loss", *METRICS):
                diff = abs(record[key] - theirs[step][key])
                assert diff == 0 if exact else diff < 1e-4, (name, step, key, record, theirs)
    for name, (of, _) in layouts.items():
        run = runs[name]
        reference = one[of]
        assert_follows(reference, run, name)

        # cp's attention merges the ring's blocks in another order: each token's log-probability
        # moves by about 1e-6 of itself, and a completion's sum of a hundred of them (-113) by
        # 2e-4, so there the metrics are held to 1e-4 of their size. DDP's all-reduce sums the
        # replicas' gradients in another order than a reduce-scatter: its logps (-115 a pair) moved
        # by 1.2e-4 (1e-6 of themselves), held to 1e-4 and 2e-6 of their size.
        def tolerance(v: float) -> float:
            if name.startswith("cp"):
                return 1e-4 * max(1.0, abs(v))
            return 1e-4 + (2e-6 * abs(v) if name.startswith("ddp") else 0.0)

        for a, b in zip(reference.metrics, run.metrics):
            # At step 1 the policy is the reference: every reward 0 in one process (the copy
            # computes what the policy does), but under cp the pass placed its rows otherwise than
            # the step, and the rewards are that rounding (|r| < 2e-4), their accuracy a coin flip
            tied = name == "cp_precomputed" and a["step"] == 1
            shown = [k for k in METRICS if not (tied and k.startswith("rewards/"))]
            assert all(abs(a[k] - b[k]) < tolerance(a[k]) for k in shown), (name, a, b)
            if tied:
                assert all(abs(b[k]) < 2e-4 for k in METRICS if "rewards/" in k and "acc" not in k)
    assert one["full"].losses[-1] < one["full"].losses[0] - 1e-3, "DPO moved the loss"
    assert one["lora"].metrics[-1]["rewards/margins"] != 0, "the adapters moved off their base"
    for name in ("moe", "hf_moe"):
        assert one[name].losses[-1] < one[name].losses[0] - 1e-3, f"DPO moved {name}'s loss"
