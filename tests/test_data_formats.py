"""Data for real use: .txt/.jsonl/.parquet corpora, the model's own tokenizer, packing with document
boundaries (position restarts, masked boundary targets), chat SFT (only assistant tokens trained),
and the masked loss."""

import json
import math

import pytest
import torch
from harness import FAST, spawn, train_in_one_group, train_job
from hf_models import make_model, make_tokenizer
from omegaconf import OmegaConf

from composer3d.data import (
    IGNORE_INDEX,
    ByteTokenizer,
    GlobalBatchLoader,
    HFTokenizer,
    PackedSequences,
    build_sequences,
    build_tokenizer,
    chat_conversations,
    check_sources,
    conversation_stream,
    document_positions,
    document_stream,
    text_file_documents,
)
from composer3d.errors import ConfigError

DOCS = [
    "the quick brown fox",
    "jumps over",
    "the lazy dog!",
    "a",
    "pipeline parallel splits layers",
]
CHATS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "the quick fox"},
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "jumps over the lazy dog"},
    ],
    [
        {"role": "user", "content": "what shards parameters?"},
        {"role": "assistant", "content": "fully sharded data parallel"},
    ],
    [{"role": "user", "content": "no reply here"}],  # nothing to learn: left out
    [
        {"role": "user", "content": "def train"},
        {"role": "assistant", "content": "loss.backward()"},
        {"role": "user", "content": "ok"},
    ],  # a trailing user turn is context, never a target
]


def data_cfg(**kw):
    return OmegaConf.create(
        {
            "name": "text_files",
            "paths": [],
            "format": "text",
            "text_field": "text",
            "messages_field": "messages",
            "tokenizer": None,
            "document_masking": True,
            "max_tokens": 0,
            "synthetic_sequences": 16,
            **kw,
        }
    )


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory):
    """Keep Hugging Face datasets' cache out of the home directory, here and in the CLI's
    processes."""
    import datasets

    cache = tmp_path_factory.mktemp("hf_datasets_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
        yield {"HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _write_parquet(path, columns: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("formats")
    (root / "docs.jsonl").write_text(
        "".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(DOCS))
    )
    _write_parquet(root / "docs.parquet", {"body": DOCS, "n": list(range(len(DOCS)))})
    (root / "txt").mkdir()
    for i, doc in enumerate(DOCS):
        (root / "txt" / f"{i}.txt").write_text(doc + "\nsecond line", encoding="utf-8")
    (root / "chats.jsonl").write_text(
        "".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(CHATS))
    )
    _write_parquet(root / "chats.parquet", {"dialog": CHATS})
    (root / "mixed").mkdir()
    (root / "mixed" / "a.txt").write_text("x")
    _write_parquet(root / "mixed" / "b.parquet", {"text": ["y"]})
    (root / "table.csv").write_text("text\nz\n")
    return root


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_tok")
    make_tokenizer(path)
    return path


# ------------------------------------------------------------------------------------------ corpora


@pytest.mark.parametrize(
    "name, field, expected",
    [
        ("docs.jsonl", "body", DOCS),
        ("docs.parquet", "body", DOCS),
        (
            "txt",
            "text",
            [d + "\nsecond line" for d in DOCS],
        ),  # one document per .txt file, in sorted order
    ],
)
def test_each_kind_of_file_reads_one_document_per_row_or_file(
    hf_cache, corpus, name, field, expected
):
    assert list(text_file_documents([str(corpus / name)], field)) == expected


def test_parquet_corpus_packs_like_the_same_jsonl(hf_cache, corpus):
    a, b = (
        build_sequences(
            data_cfg(paths=[str(corpus / f"docs.{kind}")], text_field="body"), 512, 8, 0
        )
        for kind in ("jsonl", "parquet")
    )
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.starts, b.starts)


@pytest.mark.parametrize(
    "paths, field, key, fragment",
    [
        (["mixed"], "text", "data.paths", "mixes .txt and .parquet files. Use one kind per run"),
        (["docs.jsonl", "docs.parquet"], "body", "data.paths", "mixes .jsonl and .parquet files"),
        (["table.csv"], "text", "data.paths", "is not a .txt, .jsonl/.json or .parquet file"),
        (["nothing_here/*.parquet"], "text", "data.paths", "matches no file"),
        (["docs.parquet"], "text", "data.text_field", "'text' is not a field of"),
    ],
)
def test_corpus_errors_name_the_key_and_fix(hf_cache, corpus, paths, field, key, fragment):
    with pytest.raises(ConfigError) as error:
        list(text_file_documents([str(corpus / p) for p in paths], field))
    assert str(error.value).startswith(key + ": ") and fragment in str(error.value), error.value
    if key == "data.text_field":
        assert "['body', 'n']" in str(error.value) and "Set data.text_field" in str(error.value)


# ---------------------------------------------------------------------------------------- tokenizer


def test_hf_model_without_data_tokenizer_uses_the_models_tokenizer(tmp_path, chat_tok):
    model_dir = tmp_path / "model"
    make_tokenizer(model_dir, vocab_size=300)  # only a tokenizer is needed for this
    hf = OmegaConf.create({"name": "hf", "path": str(model_dir)})
    tok = build_tokenizer(data_cfg(), hf)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(tok.tokenizer) < 512
    assert tok.encode("the quick").tolist() == tok.tokenizer.encode(
        "the quick", add_special_tokens=False
    )
    assert tok.tokenizer.bos_token_id not in tok.encode("the quick").tolist(), (
        "encode adds no special tokens"
    )
    # data.tokenizer, when set, wins; a native model without one is byte-level
    assert build_tokenizer(data_cfg(tokenizer=str(chat_tok)), hf).vocab_size == len(
        HFTokenizer(str(chat_tok)).tokenizer
    )
    assert isinstance(
        build_tokenizer(data_cfg(), OmegaConf.create({"name": "llama", "path": None})),
        ByteTokenizer,
    )
    with pytest.raises(ConfigError, match=r"^model\.path: .* is not a directory"):
        build_tokenizer(
            data_cfg(), OmegaConf.create({"name": "hf", "path": str(tmp_path / "missing")})
        )
    with pytest.raises(ConfigError, match=r"^model\.path: no tokenizer could be loaded from"):
        build_tokenizer(data_cfg(), OmegaConf.create({"name": "hf", "path": str(tmp_path)}))


# -------------------------------------------------------------------------- packing with boundaries


def test_document_masking_restarts_positions_and_masks_boundary_targets():
    eos = ByteTokenizer.eos_id
    # "ab" | "cde" | "f" | "ghij" → a b E c d e E f E g h i j E  (E = eos)
    stream = document_stream(iter(["ab", "cde", "", "f", "ghij"]), ByteTokenizer(), 0)
    a, b, c, d, e, f, g, h, i, j = (ord(ch) for ch in "abcdefghij")
    assert stream.tokens.tolist() == [a, b, eos, c, d, e, eos, f, eos, g, h, i, j, eos]
    assert stream.starts.nonzero().flatten().tolist() == [0, 3, 7, 9]
    masked = PackedSequences.from_stream(stream, 6, document_masking=True).batch([0, 1])
    M = IGNORE_INDEX
    assert masked.inputs.tolist() == [[a, b, eos, c, d, e], [eos, f, eos, g, h, i]]
    assert masked.targets.tolist() == [[b, eos, M, d, e, eos], [M, eos, M, h, i, j]], (
        "an input holding eos does not predict the next document's first token"
    )
    assert masked.position_ids.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 0, 1, 2]], (
        "positions restart after each eos and at the window start"
    )
    for t in (masked.inputs, masked.targets, masked.position_ids):
        assert t.dtype == torch.int64 and t.shape == (2, 6)
    plain = PackedSequences.from_stream(stream, 6, document_masking=False).batch([0, 1])
    assert torch.equal(plain.inputs, masked.inputs)
    assert plain.targets.tolist() == [[b, eos, c, d, e, eos], [f, eos, g, h, i, j]], (
        "no masking without it"
    )
    assert plain.position_ids.tolist() == [list(range(6))] * 2


def test_document_positions_jump_where_transformers_sees_a_new_sequence():
    from transformers.masking_utils import find_packed_sequence_indices

    starts = torch.tensor([[False, False, True, True, False, False, True, False]])
    positions = document_positions(starts)
    assert positions.tolist() == [[0, 1, 0, 0, 1, 2, 0, 1]]
    assert find_packed_sequence_indices(positions).tolist() == [[0, 0, 1, 2, 2, 2, 3, 3]]


def test_hf_model_attends_within_each_packed_document(tmp_path):
    """transformers' own model, given our position_ids, gives each document the logits it has
    alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        make_model(tmp_path / "m", "llama", tokenizer=False)
    ).eval()
    docs = [torch.tensor([5, 6, 7, 2]), torch.tensor([9, 2]), torch.tensor([11, 12, 13, 14, 2])]
    starts = torch.zeros(11, dtype=torch.bool)
    starts[[0, 4, 6]] = True
    packed = torch.cat(docs)[None]
    with torch.no_grad():
        # (transformers looks for packed sequences only without a KV cache: training, or
        # use_cache=False)
        got = model(packed, position_ids=document_positions(starts[None]), use_cache=False).logits[
            0
        ]
        alone = torch.cat([model(doc[None]).logits[0] for doc in docs])
        causal = model(packed, use_cache=False).logits[0]
    assert torch.allclose(got, alone, atol=1e-5), (got - alone).abs().max()
    assert not torch.allclose(causal[4:], alone[4:], atol=1e-3), (
        "without position_ids documents would see each other"
    )


def test_masked_batches_are_layout_independent():
    stream = document_stream(iter(DOCS * 4), ByteTokenizer(), 0)
    sequences = PackedSequences.from_stream(stream, 16, document_masking=True)
    assert len(sequences) >= 8

    def global_batch(dp, steps=3):
        loaders = [GlobalBatchLoader(sequences, 8, r, dp, seed=3) for r in range(dp)]
        out = []
        for _ in range(steps):
            parts = [loader.next_batch() for loader in loaders]
            out.append(
                [
                    torch.cat([getattr(p, k) for p in parts])
                    for k in ("inputs", "targets", "position_ids")
                ]
            )
        return out

    reference = global_batch(1)
    for dp in (2, 4):
        for got, want in zip(global_batch(dp), reference):
            assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert (reference[0][1] == IGNORE_INDEX).any() and (reference[0][2][:, 1:] == 0).any()


# ----------------------------------------------------------------------------------------- chat SFT


def _runs(mask):
    """(start, stop) of each run of True in a 1-d bool tensor."""
    runs, start = [], None
    for k, value in enumerate(mask.tolist() + [False]):
        if value and start is None:
            start = k
        elif not value and start is not None:
            runs.append((start, k))
            start = None
    return runs


@pytest.mark.parametrize("file, field", [("chats.jsonl", "messages"), ("chats.parquet", "dialog")])
def test_chat_trains_only_on_assistant_tokens(hf_cache, corpus, chat_tok, file, field):
    tok = HFTokenizer(str(chat_tok))
    conversations = list(chat_conversations([str(corpus / file)], field))
    assert conversations == CHATS
    stream = conversation_stream(iter(conversations), tok, 0)
    replies = [m["content"] for c in CHATS for m in c if m["role"] == "assistant"]
    spans = _runs(stream.trainable)
    assert [tok.decode(stream.tokens[a:b]) for a, b in spans] == [r + "</s>" for r in replies], (
        "each trained span is one assistant reply and its end-of-turn token, nothing else"
    )
    assert [tok.decode(stream.tokens[a:b], skip_special_tokens=True) for a, b in spans] == replies
    # The whole stream is the conversations as the template renders them (the one without a reply
    # left out).
    kept = [c for c in CHATS if any(m["role"] == "assistant" for m in c)]
    starts = stream.starts.nonzero().flatten().tolist() + [len(stream)]
    rendered = [tok.decode(stream.tokens[s:e]) for s, e in zip(starts, starts[1:])]
    assert rendered == [tok.render_chat(c) for c in kept]

    # Packed into windows: a target takes a loss exactly where its token is trainable and starts no
    # conversation.
    cfg = data_cfg(
        paths=[str(corpus / file)], format="chat", messages_field=field, tokenizer=str(chat_tok)
    )
    sequences = build_sequences(cfg, 512, 8, 0)
    batch = sequences.batch(list(range(len(sequences))))
    n = batch.targets.numel()
    flat = stream.tokens[1 : n + 1]
    expected = torch.where(
        stream.trainable[1 : n + 1] & ~stream.starts[1 : n + 1], flat, IGNORE_INDEX
    )
    assert torch.equal(batch.targets.flatten(), expected)
    assert torch.equal(batch.inputs.flatten(), stream.tokens[:n])
    # position_ids restart at each conversation (and window)
    flat_starts = stream.starts[:n].view(-1, 8).clone()
    assert torch.equal(batch.position_ids, document_positions(flat_starts))


def test_chat_template_that_is_not_prefix_stable_is_refused(tmp_path, chat_tok):
    from transformers import AutoTokenizer

    unstable = AutoTokenizer.from_pretrained(str(chat_tok))
    # changes with every turn
    unstable.chat_template = "[{{ messages|length }} turns]" + unstable.chat_template
    unstable.save_pretrained(tmp_path)
    with pytest.raises(
        ConfigError, match=r"^data\.format: the tokenizer's chat template is not prefix-stable"
    ):
        HFTokenizer(str(tmp_path)).encode_chat(CHATS[1])


def test_chat_needs_a_chat_template_and_message_rows(hf_cache, tmp_path, corpus, chat_tok):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(chat_tok))
    plain.chat_template = None
    plain.save_pretrained(tmp_path / "plain")
    chat = dict(paths=[str(corpus / "chats.jsonl")], format="chat")
    with pytest.raises(
        ConfigError, match=r"^data\.tokenizer: data\.format=chat .* has none\. Set data\.tokenizer"
    ):
        check_sources(data_cfg(**chat, tokenizer=str(tmp_path / "plain")), 512)
    with pytest.raises(
        ConfigError, match=r"^data\.tokenizer: .* the byte-level tokenizer has none"
    ):
        check_sources(data_cfg(**chat), 512)
    with pytest.raises(
        ConfigError, match=r"^data\.messages_field: 'conversation' is not a field of"
    ):
        list(chat_conversations([str(corpus / "chats.jsonl")], "conversation"))
    with pytest.raises(
        ConfigError, match=r"^data\.messages_field: row 0 .* not a list of \{role, content\}"
    ):
        list(chat_conversations([str(corpus / "docs.jsonl")], "body"))
    with pytest.raises(
        ConfigError, match=r"^data\.format: chat reads a list of messages .* \.txt files"
    ):
        list(chat_conversations([str(corpus / "txt")], "messages"))


@pytest.fixture(scope="module")
def compose_cfg():
    from hydra import compose, initialize_config_module

    from composer3d.config.registration import register_configs

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        yield lambda *overrides: compose("train", overrides=["run.dir=unused", *overrides])


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["data.format=sft"], "data.format", "Choose one of ('text', 'chat', 'preference')"),
        (["data.format=chat"], "data.format", "Use data=text_files"),
        (["data=chat", "data.paths=[c.jsonl]"], "data.tokenizer", "or use model=hf"),
        (
            ["data=text_files", "data.paths=[c.jsonl]", "data.text_field="],
            "data.text_field",
            "Use e.g. text",
        ),
    ],
)
def test_data_config_errors_name_the_key(compose_cfg, overrides, key, hint):
    from composer3d.config.checks import validate

    with pytest.raises(ConfigError) as error:
        validate(compose_cfg(*overrides), 1)
    assert str(error.value).startswith(key + ": ") and hint in str(error.value), error.value


def test_chat_data_group_composes(compose_cfg):
    cfg = compose_cfg("data=chat", "data.paths=[c.jsonl]", "data.tokenizer=/tok")
    assert cfg.data.name == "text_files" and cfg.data.format == "chat" and cfg.data.document_masking
    from composer3d.config.checks import validate

    validate(cfg, 1)


# ---------------------------------------------------------------------------------- the masked loss


def _masked_loss_worker(rank, world, corpus_path, out_path):
    """Trainer's first step on dp_shard=world vs. the loss computed by hand on the whole global
    batch."""
    import torch.distributed as dist
    from hydra import compose, initialize_config_module
    from torch.distributed.tensor import DTensor

    from composer3d.config.checks import validate
    from composer3d.config.registration import register_configs
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.trainer import Trainer

    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=[
                "run.dir=unused",
                "checkpoint.enabled=false",
                "data=text_files",
                f"data.paths=[{corpus_path}]",
                *FAST,
            ],
        )
    cfg.precision.param_dtype = "float32"
    layout = validate(cfg, world)
    sequences = build_sequences(
        cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.train.seed, cfg.model
    )
    trainer = Trainer(cfg, ParallelMesh(layout, "cpu"), torch.device("cpu"), sequences)
    # The whole global batch of step 1 (the loader's seeded order), as raw token windows.
    probe = GlobalBatchLoader(sequences, cfg.train.global_batch_size, 0, 1, cfg.train.seed)
    rows = [probe._index(p) for p in range(cfg.train.global_batch_size)]
    windows = sequences.tokens[rows]
    inputs, targets = windows[:, :-1], windows[:, 1:]
    # attending within documents, as the trainer's model does (data.document_masking)
    with torch.no_grad():
        logits = trainer.model(inputs, position_ids=sequences.batch(rows).position_ids).float()
    # By hand, from the token ids alone: every next token is a target except the one after an eos.
    keep = inputs != ByteTokenizer.eos_id
    nll = -torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    result = {
        "by_hand": (nll[keep].sum() / keep.sum()).item(),
        "unmasked": nll.mean().item(),
        "count": int(keep.sum()),
    }
    metrics = trainer.train_step()
    loss = trainer.read_back([(1, metrics)], window_start=0.0)[0][
        "loss"
    ]  # summed over the ranks' shares
    result.update(loss=loss, target_tokens=metrics["target_tokens"], tokens=metrics["tokens"])
    # A global batch whose every target is masked is skipped on every rank alike, without an update.
    trainer.zero_grad()
    local = lambda p: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()  # noqa: E731
    before = [local(p) for p in trainer.model.parameters()]
    trainer.loader.loader.sequences.trainable = torch.zeros_like(sequences.tokens, dtype=torch.bool)
    # drop the batches prefetched with the old masks
    trainer.loader.load_state_dict(trainer.loader.state_dict())
    skipped = trainer.train_step()
    assert skipped["target_tokens"] == 0 and skipped["loss"] == 0.0 and trainer.step == 2, skipped
    assert all(torch.equal(a, local(b)) for a, b in zip(before, trainer.model.parameters()))
    dist.barrier()
    if rank == 0:
        torch.save(result, out_path)


@pytest.fixture(scope="module")
def short_docs(tmp_path_factory):
    """Many short jsonl documents: about one target in ten sits on a document boundary."""
    root = tmp_path_factory.mktemp("short_docs")
    words = "the quick brown fox jumps over a lazy dog while pipelines split layers".split()
    docs = [" ".join(words[(i * 7 + k) % len(words)] for k in range(2 + i % 5)) for i in range(600)]
    path = root / "short.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_masked_loss_equals_hand_computation_under_fsdp(tmp_path, hf_cache, short_docs):
    spawn(_masked_loss_worker, 2, tmp_path, str(short_docs), str(tmp_path / "result.pt"))
    result = torch.load(tmp_path / "result.pt")
    assert result["target_tokens"] == result["count"] < 8 * 64, result
    assert result["tokens"] == 8 * 64
    assert abs(result["loss"] - result["by_hand"]) < 1e-5, result
    assert abs(result["unmasked"] - result["by_hand"]) > 1e-3, "the boundary targets should matter"


# Both on 4 ranks, one after another in one process group (start-up paid once).
DOCUMENT_LAYOUTS = {
    "fsdp2_tp2_sp_op_ac": [
        "parallel.dp_shard=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "memory.activation_checkpointing=selective",
        "memory.ac_every=0",
    ],
    "pp2_tp2_sp": [
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.dp_shard=1",
    ],
}


def test_document_masking_loss_parity_fsdp_tp_sp_pp(tmp_path, hf_cache, short_docs):
    """The native llama attends within documents under every layout: a layout where a document saw
    the one before it would leave the single-process curve by about 1e-3 from the first step."""
    data = [
        "data=text_files",
        f"data.paths=['{short_docs}']",
        "train.steps=6",
        "optim.warmup_steps=2",
        "checkpoint.enabled=false",
    ]
    ref = train_job(tmp_path / "ref", *FAST, *data)
    runs = train_in_one_group(
        [(tmp_path / name, [*FAST, *data, *layout]) for name, layout in DOCUMENT_LAYOUTS.items()],
        nproc=4,
    )
    for name, run in zip(DOCUMENT_LAYOUTS, runs):
        assert len(ref.losses) == len(run.losses) == 6, name
        diffs = [abs(a - b) for a, b in zip(ref.losses, run.losses)]
        assert max(diffs) < 1e-4, (name, ref.losses, run.losses)
    assert all(math.isfinite(x) for x in ref.losses) and ref.losses[-1] < ref.losses[0]


def test_chat_sft_on_hf_model_uses_its_tokenizer_with_parity(tmp_path, hf_cache):
    """model=hf, data=chat, no data.tokenizer: the model directory's tokenizer and chat template;
    packed conversations (position_ids into the HF model); FSDP over 2 ranks follows the
    single-process curve."""
    model_dir = make_model(tmp_path / "model", "llama")
    words = (
        "the quick brown fox jumps over a lazy dog while pipelines split layers across ranks"
    ).split()
    rows = []
    for i in range(120):
        ask, reply = (
            " ".join(words[(i * k + j) % len(words)] for j in range(2 + i % 4)) for k in (3, 5)
        )
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": ask},
                    {"role": "assistant", "content": reply},
                ]
            }
        )
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [o for o in FAST if not o.startswith("model=")] + [
        "model=hf",
        f"model.path={model_dir}",
        "data=chat",
        f"data.paths=['{chats}']",
        "train.seq_len=32",
        "train.steps=4",
        "optim.lr=3e-3",
        "optim.warmup_steps=1",
        "checkpoint.enabled=false",
    ]
    ref = train_job(tmp_path / "ref", *common)
    run = train_job(tmp_path / "fsdp2", *common, "parallel.dp_shard=2", nproc=2)
    assert len(ref.losses) == len(run.losses) == 4, ref.output[-3000:]
    assert max(abs(a - b) for a, b in zip(ref.losses, run.losses)) < 1e-4, (ref.losses, run.losses)
    assert all(math.isfinite(x) and x > 0 for x in ref.losses)
