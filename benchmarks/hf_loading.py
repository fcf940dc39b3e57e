"""How much of a Hugging Face checkpoint each rank reads and holds when ``model=hf`` loads it into
its shards.

Saves a random Llama-shaped model (default ~0.2B parameters, fp32 safetensors) to a temporary
directory, then for world sizes 1, 2 and 4 (FSDP over all ranks) builds the model on meta,
parallelizes it and loads the weights through composer3d's loader (DCP's HuggingFaceStorageReader),
in fresh gloo processes. Prints, per world size, the fraction of the checkpoint's elements each rank
read, the rank's peak RSS growth during build+load (Linux), and the wall time of the load. Side by
side in one run; CPU only.

    python benchmarks/hf_loading.py [--hidden 1024 --layers 12 --vocab 32000] [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def save_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        vocab_size=vocab,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS mark (Linux: clear_refs 5) and return the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_bytes("VmRSS")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def _worker(rank: int, world: int, path: str, store: str, results) -> None:
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from composer3d.config.checks import resolve_model_config, validate
    from composer3d.config.schema import TrainConfig
    from composer3d.launch.distributed import shut_down
    from composer3d.parallel.mesh import ParallelMesh
    from composer3d.training.assemble import build_parallel_model

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    read = {"elements": 0}
    original = HuggingFaceStorageReader._process_read_request

    def counting(self, f, req, planner):
        read["elements"] += math.prod(req.lengths)
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counting
    cfg = OmegaConf.structured(TrainConfig)
    cfg.model = OmegaConf.merge(
        cfg.model,
        {"name": "hf", "path": path, "dim": 0, "n_layers": 0, "n_heads": 0, "vocab_size": 0},
    )
    cfg.run.dir, cfg.precision.param_dtype = "unused", "float32"
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 8, 1
    resolve_model_config(cfg.model)
    rss_before = _reset_peak_rss()
    dist.barrier()
    start = time.perf_counter()
    built = build_parallel_model(
        cfg, ParallelMesh(validate(cfg, world), "cpu"), torch.device("cpu")
    )
    dist.barrier()
    seconds = time.perf_counter() - start
    total = sum(math.prod(s) for s in built.model.full_shapes.values())
    grown = _peak_rss() - rss_before
    results.put((rank, read["elements"] / total, grown, seconds))
    shut_down(finished=True)  # collect and wait first: gloo can abort at exit otherwise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes to load into"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        params = save_model(path, args.hidden, args.layers, args.vocab)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(
            f"model: {params / 1e6:.0f}M params, checkpoint {size / 2**20:.0f} MiB (fp32 "
            "safetensors)"
        )
        print(
            "| ranks | read per rank (of the checkpoint) | peak RSS growth per rank (max) | load "
            "wall time |"
        )
        print("|---|---|---|---|")
        for world in args.worlds:
            context = mp.get_context("spawn")
            results = context.Queue()
            store = Path(tmp) / f"store{world}"
            procs = [
                context.Process(target=_worker, args=(r, world, str(path), str(store), results))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            rows = [results.get() for _ in procs]
            for p in procs:
                p.join()
            share = max(r[1] for r in rows)
            grown = max(r[2] for r in rows)
            seconds = max(r[3] for r in rows)
            print(
                f"| {world} | {share:.1%} | {grown / 2**20:.0f} MiB ({grown / size:.2f}× the "
                "checkpoint) | "
                f"{seconds:.2f} s |",
                flush=True,
            )
    sys.exit(0)


if __name__ == "__main__":
    main()
