"""The ``composer3d-prepare`` entry point (also ``python -m composer3d.commands.prepare``): a corpus
tokenized once into token shards that ``composer3d-train`` then maps on every rank
(``data.prepared``), instead of every rank reading and tokenizing it at start-up.

It takes the training config, so the same data and model overrides prepare and train:

    composer3d-prepare data=text_files data.paths=[corpus/*.jsonl] data.tokenizer=tok \
        model.vocab_size=32000 data.prepared=corpus.prepared [data.prepare_workers=16]
    composer3d-train   data=text_files data.tokenizer=tok model.vocab_size=32000 \
        data.prepared=corpus.prepared ...

It prints one JSON line: the directory, tokens, documents, shards, dtype, seconds and tokens/s. A
directory already prepared from the same sources and tokenizer is left as it is (``"reused":
true``). Exit code 2 for a bad config.
"""

from __future__ import annotations

import json
import os
import sys

from omegaconf import DictConfig

from composer3d.config.checks import resolve_model_config, validate_data
from composer3d.data import prepare_corpus
from composer3d.errors import ConfigError
from composer3d.launch import launcher
from composer3d.training import console


def task(cfg: DictConfig) -> None:
    # each worker is one process: the Rust tokenizer's own threads would only compete with the other
    # workers
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    console.setup_logging(0, stream=sys.stderr)
    with launcher.exits_as_a_command("composer3d-prepare", None):
        resolve_model_config(cfg.model)
        validate_data(cfg)
        if not cfg.data.prepared:
            raise ConfigError(
                "data.prepared: names no directory to write the prepared corpus to. Set "
                "data.prepared=<dir> (and train with the same setting)"
            )
        manifest = prepare_corpus(cfg.data, cfg.model)
    seconds = manifest["seconds"]
    print(
        json.dumps(
            {
                "prepared": os.path.abspath(cfg.data.prepared),
                "tokens": manifest["tokens"],
                "documents": manifest["documents"],
                "shards": len(manifest["shards"]),
                "dtype": manifest["dtype"],
                "identity": manifest["identity"],
                "reused": manifest["reused"],
                "seconds": round(seconds, 3),
                "tokens_per_s": None
                if manifest["reused"]
                else round(manifest["tokens"] / max(seconds, 1e-9)),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":  # the local workers' command line
    from composer3d.commands.cli import prepare

    prepare()
