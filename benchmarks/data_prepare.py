"""Preparing a corpus once (composer3d-prepare) against reading it in memory on every rank, side by
side in one run.

Generates a synthetic JSON Lines corpus of ``--size-mb`` (documents of Zipf-distributed made-up
words; the issue's scale is ``--size-mb 1024``), trains a byte-level BPE tokenizer on a sample of it
(``--vocab``), then prints:

- preparation: tokens/s of ``composer3d-prepare``'s code with ``--workers`` processes and with 1;
- serving: for a process that trains from the prepared directory (``data.prepared``) and one that
  takes today's in-memory path (``build_sequences``: read, tokenize and pack the whole corpus), the
  start-up time to the first batch and the peak RSS, each in a fresh process (``--same-process``: in
  this one, for a quick smoke run).

    python benchmarks/data_prepare.py [--size-mb 50] [--workers N] [--seq-len 1024] [--batch 32]
    python benchmarks/data_prepare.py --size-mb 1024          # the issue's 1 GB
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def make_corpus(root: Path, size_mb: float, files: int = 8, seed: int = 0) -> int:
    """``files`` .jsonl files of about ``size_mb`` MB in all; returns the number of bytes
    written."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20_000)]
    target, written = int(size_mb * (1 << 20)), 0
    for index in range(files):
        with open(root / f"part-{index:03d}.jsonl", "w") as f:
            while written < target * (index + 1) / files:
                ids = np.minimum(rng.zipf(1.2, size=int(rng.integers(50, 500))), len(words)) - 1
                line = json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n"
                f.write(line)
                written += len(line)
    return written


def make_tokenizer(root: Path, path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sample = [
        json.loads(line)["text"] for line in (root / "part-000.jsonl").open().readlines()[:2000]
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(sample, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(path)


def data_cfg(corpus: Path, tokenizer: Path, prepared: Path | None, workers: int = 1):
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "name": "text_files",
            "paths": [str(corpus)],
            "format": "text",
            "text_field": "text",
            "messages_field": "messages",
            "tokenizer": str(tokenizer),
            "document_masking": True,
            "max_tokens": 0,
            "synthetic_sequences": 0,
            "prepared": str(prepared) if prepared else None,
            "prepare_workers": workers,
            "prepare_overwrite": True,
        }
    )


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def serve(corpus: Path, tokenizer: Path, prepared: Path | None, seq_len: int, batch: int) -> dict:
    """Start-up to the first batch and peak RSS of one side (this process; Linux)."""
    from composer3d.data import GlobalBatchLoader, build_sequences

    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark
    before = _status_bytes("VmRSS")
    began = time.perf_counter()
    sequences = build_sequences(data_cfg(corpus, tokenizer, prepared), 1 << 20, seq_len, 0)
    first = GlobalBatchLoader(sequences, batch, 0, 1, 0).next_batch()
    seconds = time.perf_counter() - began
    assert first.inputs.shape == (batch, seq_len)
    return {
        "first_batch_s": seconds,
        "peak_rss_bytes": _status_bytes("VmHWM"),
        "rss_growth_bytes": _status_bytes("VmHWM") - before,
        "sequences": len(sequences),
    }


def serve_in_fresh_process(args, corpus: Path, tokenizer: Path, prepared: Path | None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--serve",
        str(corpus),
        str(tokenizer),
        str(prepared or ""),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-mb", type=float, default=50.0, help="corpus size (the issue's scale: 1024)"
    )
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count(), help="processes of the parallel prepare"
    )
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument(
        "--batch", type=int, default=32, help="global batch of the first batch served"
    )
    parser.add_argument(
        "--same-process", action="store_true", help="serve both sides in this process (smoke run)"
    )
    parser.add_argument(
        "--serve", nargs=3, metavar=("CORPUS", "TOKENIZER", "PREPARED"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    # processes, not the tokenizer's threads, in parallel
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.serve:
        corpus, tokenizer, prepared = args.serve
        print(
            json.dumps(
                serve(
                    Path(corpus),
                    Path(tokenizer),
                    Path(prepared) if prepared else None,
                    args.seq_len,
                    args.batch,
                )
            )
        )
        return

    from composer3d.data import prepare_corpus

    with tempfile.TemporaryDirectory(prefix="composer3d-data-bench-") as tmp:
        root = Path(tmp)
        # the in-memory path's reader writes a cache
        os.environ["HF_DATASETS_CACHE"] = str(root / "hf_cache")
        corpus, tokenizer = root / "corpus", root / "tokenizer"
        corpus.mkdir()
        size = make_corpus(corpus, args.size_mb)
        make_tokenizer(corpus, tokenizer, args.vocab)
        print(
            f"corpus: {size / (1 << 20):.1f} MB of JSON Lines in 8 files; BPE vocabulary "
            f"{args.vocab}; "
            f"{os.cpu_count()} CPU cores"
        )

        prepared = {}
        for workers in dict.fromkeys([args.workers, 1]):
            manifest = prepare_corpus(
                data_cfg(corpus, tokenizer, root / f"prepared-{workers}", workers),
                piece_bytes=max(1 << 16, size // (4 * args.workers)),
            )
            prepared[workers] = manifest
        first = next(iter(prepared.values()))
        assert all(m["identity"] == first["identity"] for m in prepared.values()), (
            "the same shards either way"
        )
        print(
            f"\nprepare: {first['tokens']:,} tokens ({first['dtype']}), {first['documents']:,} "
            "documents"
        )
        print("| workers | seconds | tokens/s |\n|---|---|---|")
        for workers, manifest in prepared.items():
            print(
                f"| {workers} | {manifest['seconds']:.2f} | "
                f"{manifest['tokens'] / manifest['seconds']:,.0f} |"
            )
        if len(prepared) > 1:
            one, many = prepared[1]["seconds"], prepared[args.workers]["seconds"]
            print(f"speed-up with {args.workers} workers: {one / many:.2f}x")

        print(
            f"\nfirst batch of {args.batch} x {args.seq_len} tokens "
            f"({'this process' if args.same_process else 'a fresh process each'}):"
        )
        print(
            "| path | start-up to first batch (s) | peak RSS (MB) | RSS growth (MB) "
            "|\n|---|---|---|---|"
        )
        sides = [
            ("prepared (data.prepared)", root / f"prepared-{args.workers}"),
            ("in memory (build_sequences)", None),
        ]
        for name, directory in sides:
            if args.same_process:
                result = serve(corpus, tokenizer, directory, args.seq_len, args.batch)
            else:
                result = serve_in_fresh_process(args, corpus, tokenizer, directory)
            print(
                f"| {name} | {result['first_batch_s']:.2f} | "
                f"{result['peak_rss_bytes'] / 2**20:,.0f} | "
                f"{result['rss_growth_bytes'] / 2**20:,.0f} |"
            )


if __name__ == "__main__":
    main()
