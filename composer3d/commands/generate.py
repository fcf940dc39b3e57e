"""``composer3d-generate``: continue prompts with a checkpoint's model (or a Hugging Face model's
own weights).

    composer3d-generate checkpoint.resume=outputs/NAME/checkpoints/step-100 \\
        generate.prompt="def main("
    composer3d-generate model=hf model.path=/models/qwen \\
        generate.prompt="The capital of France is" generate.temperature=0.7 generate.top_p=0.9 \\
        launch.nproc_per_node=2 parallel.tp=2

With ``checkpoint.resume``, the model and the tokenizer are the run's: its recorded config
(composer3d.json) names them, so an override of ``model`` or ``data.tokenizer`` is refused (the
weights fix both). ``generate.prompt`` and ``generate.prompts`` run as one batch (left-padded; each
row gets what it would get alone). The prompts fill a KV cache at once, then each step runs one
token a row (``composer3d.generation``: a static cache for the native model, transformers'
StaticCache or DynamicCache for Hugging Face models; ``generate.cache=none`` recomputes the whole
sequence every step). Decoding is greedy at ``generate.temperature=0``; otherwise the next token is
drawn from softmax(logits / temperature), cut to the ``generate.top_k`` most likely and to the
smallest set of most likely tokens whose probabilities reach ``generate.top_p``, by a generator
seeded with ``generate.seed`` — so a seed and a checkpoint always give the same text, on any layout.
A row stops at its eos, at a stop string (``generate.stop``, cut from the text) or after
``generate.max_new_tokens``. It runs on one process or under tensor parallel
(``launch.nproc_per_node`` = ``parallel.tp``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from composer3d.checkpoint import META_FILE, load_model_weights, read_meta
from composer3d.commands.cli import GENERATE
from composer3d.commands.evaluate import check_weights_source
from composer3d.commands.processes import run_command
from composer3d.config.checks import resolve_model_config, validate
from composer3d.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer
from composer3d.dtypes import DTYPES
from composer3d.errors import ConfigError
from composer3d.generation import Generation, generate
from composer3d.launch import distributed
from composer3d.launch.rank import prepare_rank
from composer3d.models import MODEL_REGISTRY
from composer3d.parallel.mesh import Layout, ParallelMesh
from composer3d.peft.base import checkpoint_base
from composer3d.training import console
from composer3d.training.assemble import build_parallel_model

log = logging.getLogger("composer3d")


def encode_prompts(tokenizer: ByteTokenizer | HFTokenizer, settings) -> list[list[int]]:
    """The token ids of ``generate.prompt`` (where given) and each of ``generate.prompts``."""
    texts = ([settings.prompt] if settings.prompt else []) + list(settings.prompts)
    return [encode_prompt(tokenizer, text, settings.chat) for text in texts] or [[]]


def encode_prompt(tokenizer: ByteTokenizer | HFTokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids: through the chat template as a user message with ``generate.chat``; a
    Hugging Face tokenizer adds its own special tokens (a bos, where it has one), as transformers'
    pipelines do."""
    if chat:
        if not tokenizer.has_chat_template:
            raise ConfigError(
                "generate.chat: the run's tokenizer has no chat template. Leave "
                "generate.chat=false to continue the prompt as plain text, or set data.tokenizer "
                "to a tokenizer with one"
            )
        text = tokenizer.render_chat(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
        return tokenizer.tokenizer.encode(text, add_special_tokens=False)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.tokenizer.encode(prompt)
    return tokenizer.encode(prompt).tolist()


def adopt_checkpoint_config(cfg: DictConfig, typed_overrides: list[str]) -> None:
    """With checkpoint.resume: the model (with its LoRA adapters, ``peft``) and tokenizer of the run
    that saved it, from its recorded config."""
    resume = cfg.checkpoint.resume
    if resume in ("auto", "none"):
        return
    if not (Path(resume) / META_FILE).is_file():
        raise ConfigError(
            f"checkpoint.resume: {resume} is not a composer3d checkpoint (no {META_FILE}). Give a "
            "step-N directory, or leave it out to generate with model=hf model.path's own weights"
        )
    clashing = [
        o
        for o in typed_overrides
        if o.split("=", 1)[0].lstrip("+~").startswith(("model", "data.tokenizer"))
    ]
    if clashing:
        raise ConfigError(
            f"{clashing[0].split('=', 1)[0]}: the checkpoint's own model and tokenizer are used "
            f"(its recorded config names them). Drop {', '.join(clashing)}"
        )
    recorded = read_meta(Path(resume))["config"]
    cfg.model = OmegaConf.merge(cfg.model, recorded["model"])
    cfg.data.tokenizer = (recorded.get("data") or {}).get("tokenizer")
    if "peft" in recorded:
        cfg.peft = OmegaConf.merge(cfg.peft, recorded["peft"])


def check_generation(cfg: DictConfig, layout: Layout, prompts: list[list[int]]) -> None:
    """The layouts generation runs under, and prompts that fit the model's context."""
    others = {k: v for k, v in layout.as_dict().items() if k != "tp" and v > 1}
    if others:
        raise ConfigError(
            "parallel: composer3d-generate runs on one process or under tensor parallel alone, and "
            f"this layout has {others}. Use launch.nproc_per_node=N parallel.tp=N (N = 1 for one "
            "process)"
        )
    if cfg.generate.compile and (layout.tp > 1 or cfg.model.moe.experts > 0):
        raise ConfigError(
            "generate.compile: compiled decoding is built and tested for a dense model on one "
            "process (routed experts have data-dependent shapes; tensor parallel is untested). Use "
            "generate.compile=false"
        )
    if not all(prompts):
        key = "generate.prompts" if cfg.generate.prompts else "generate.prompt"
        raise ConfigError(
            f"{key}: empty (no tokens to continue). Give the text to continue, e.g. "
            "generate.prompt='Once upon a time' (or \"generate.prompts=['a b','c']\" for a batch)"
        )
    longest = max(map(len, prompts))
    total = longest + cfg.generate.max_new_tokens
    if total > cfg.model.max_seq_len:
        raise ConfigError(
            f"generate.max_new_tokens: the longest prompt's {longest} tokens and "
            f"{cfg.generate.max_new_tokens} new ones exceed the model's context (model.max_seq_len="
            f"{cfg.model.max_seq_len}). Use generate.max_new_tokens<="
            f"{max(cfg.model.max_seq_len - longest, 0)} or a shorter prompt"
        )


def run(cfg: DictConfig, env: distributed.Env | None) -> list[Generation]:
    console.setup_logging(env.rank if env else 0, stream=sys.stderr)
    layout, device = prepare_rank(cfg, env)
    tokenizer = build_tokenizer(cfg.data, cfg.model)
    prompts = encode_prompts(tokenizer, cfg.generate)
    check_generation(cfg, layout, prompts)
    resume = cfg.checkpoint.resume
    timeout = timedelta(minutes=cfg.launch.timeout_minutes)
    env = distributed.init_process_group(device, env, timeout)
    finished = False
    try:
        mesh = ParallelMesh(layout, device.type, timeout)
        from_checkpoint = resume not in ("auto", "none")
        model = build_parallel_model(
            cfg, mesh, device, from_checkpoint, checkpoint_base(cfg.peft, resume)
        ).model
        if from_checkpoint:
            load_model_weights(model, Path(resume))
        # The compute dtype training used where FSDP does not run (parallel.autocast and
        # parallel.cast_once act at the model's forward; the cached decoders call its modules
        # themselves): cast once for the whole generation where training would
        # (precision.cast=params), else autocast
        dtype = cfg.precision.param_dtype
        casts = getattr(model, "cast_once", None)
        with (
            casts.held() if casts else nullcontext(),
            torch.autocast(
                device.type, dtype=DTYPES[dtype], enabled=dtype != "float32" and casts is None
            ),
        ):
            results = generate(
                model.eval(), prompts, cfg.generate, tokenizer.eos_id, tokenizer.decode, device
            )
        if env.rank == 0:
            _print(results, tokenizer, cfg.generate.output)
        finished = True
        return results
    finally:
        distributed.shut_down(finished)


def _print(results: list[Generation], tokenizer, output: str) -> None:
    for result in results:
        prompt = tokenizer.decode(result.prompt_ids)
        if output == "json":
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "completion": result.completion,
                        "prompt_ids": result.prompt_ids,
                        "completion_ids": result.completion_ids,
                        "finish_reason": result.finish_reason,
                    }
                ),
                flush=True,
            )
        else:
            print(prompt + result.completion, flush=True)
    for number, result in enumerate(results, 1):
        # printed as is, it looks like no output at all
        if result.completion_ids and not result.completion.strip():
            log.warning(
                "prompt %d: the completion is whitespace only (%d tokens, %r...): the model "
                "predicts whitespace after this prompt, as a briefly trained one does under greedy "
                "decoding. Train it longer, or sample (generate.temperature>0)",
                number,
                len(result.completion_ids),
                result.completion[:8],
            )
    tokens = sum(len(result.completion_ids) for result in results)
    seconds = results[0].seconds
    log.info(
        "%d tokens in %.1f s (%.1f tokens/s), stopped at %s",
        tokens,
        seconds,
        tokens / max(seconds, 1e-9),
        ", ".join(result.finish_reason for result in results),
    )


def _settle(cfg: DictConfig) -> None:
    # The same numbers without sequence parallel, which needs a sequence length divisible by tp: a
    # growing one is not.
    cfg.parallel.sequence_parallel = False
    adopt_checkpoint_config(cfg, list(HydraConfig.get().overrides.task))
    resolve_model_config(cfg.model)


def _check(cfg: DictConfig) -> None:
    layout = validate(cfg, cfg.launch.nproc_per_node)
    check_weights_source(cfg, "composer3d-generate would generate from")
    check_generation(
        cfg, layout, encode_prompts(build_tokenizer(cfg.data, cfg.model), cfg.generate)
    )
    MODEL_REGISTRY[cfg.model.name].check_forward(cfg.model, layout.tp)


def task(cfg: DictConfig) -> None:
    run_command(GENERATE, cfg, run, settle=_settle, check=_check)


if __name__ == "__main__":  # the local workers' command line
    from composer3d.commands.cli import generate

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    generate()
