"""What is checked before any worker starts (by the launcher; by a single process before it trains):
everything that would otherwise fail on every rank alike once workers run, or only at the first
checkpoint save.

Each problem is one ConfigError naming the key and what would work (exit code 2). The workers check
again what depends on their rank (the device) and read what is too large to read twice (the corpus
beyond its first rows).
"""

from __future__ import annotations

import inspect
import json
import logging
import tempfile
from pathlib import Path

from composer3d.checkpoint import (
    META_FILE,
    check_complete,
    check_same_model,
    check_steps_left,
    checkpoint_dir,
    committed_checkpoints,
    read_meta,
    verified_checkpoints,
)
from composer3d.config.checks import validate, validate_for_device
from composer3d.config.schema import TrainConfig
from composer3d.data import check_prepared, check_same_corpus, check_sources, eval_windows
from composer3d.errors import ConfigError
from composer3d.launch import distributed
from composer3d.models import MODEL_REGISTRY, build_model
from composer3d.parallel.mesh import Layout
from composer3d.peft.apply import check_init_from, check_targets
from composer3d.peft.base import (
    base_source,
    build_with_adapters,
    check_base_from,
    check_same_base,
    describe,
)

log = logging.getLogger("composer3d")


def preflight(cfg: TrainConfig, world_size: int) -> Layout:
    """Check the run ``cfg`` describes on ``world_size`` ranks; returns the layout."""
    layout = validate(cfg, world_size)
    kind = distributed.device_type(cfg.launch.device, local_processes=cfg.launch.nproc_per_node)
    validate_for_device(cfg, layout, kind)
    cores = distributed.cpu_cores()
    if kind == "cpu" and cfg.launch.nproc_per_node > cores:
        # allowed: a layout of more ranks than cores is how a layout is tried on a small machine
        log.warning(
            "launch.nproc_per_node=%d CPU ranks on %d cores: the ranks take turns on the cores and "
            "each collective waits for those not running, so a step takes several times as long "
            "as on %d ranks. Right for trying a layout; to train, launch.nproc_per_node<=%d",
            cfg.launch.nproc_per_node,
            cores,
            cores,
            cores,
        )
    check_wandb(cfg)
    MODEL_REGISTRY[cfg.model.name].check_forward(cfg.model, layout.tp)
    # mapped, not read: its manifest, shard sizes and what it was prepared from
    if cfg.data.prepared:
        check_prepared(cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.model)
    else:
        check_sources(cfg.data, cfg.model.vocab_size, cfg.model)
    if cfg.train.eval_every:
        eval_windows(cfg.eval, cfg.data, cfg.model, cfg.train.seq_len)
    # first: a resume, too, rebuilds the base from there
    if cfg.peft.method != "none" and cfg.peft.base_from:
        check_base_from(cfg.peft, cfg.model)
    directory = checkpoint_dir(cfg.checkpoint, Path(cfg.run.dir))
    resumes_from = check_resumable(cfg, directory) if cfg.checkpoint.enabled else None
    check_fresh_start(cfg, Path(cfg.run.dir), directory)
    # what a resume continues: readable, or refused now
    if (Path(cfg.run.dir) / "metrics.jsonl").is_file():
        metrics_records(Path(cfg.run.dir) / "metrics.jsonl")
    peft = cfg.peft.method != "none"
    if peft:  # the linears the patterns name, on the model (on meta)
        check_targets(build_model(cfg.model), cfg.peft, layout.dp_shard * layout.cp)
        # a checkpoint's adapters would replace them
        if cfg.peft.init_from and resumes_from is None:
            check_init_from(build_model(cfg.model), cfg.peft, cfg.model)
        # allowed (a seed's base is reproducible: parity tests, development), said once
        if resumes_from is None and "seed" in base_source(cfg):
            log.warning(
                "peft=%s trains adapters over a random base (the initialization from "
                "train.seed=%d), not a trained model: name one with peft.base_from=<a full "
                "composer3d checkpoint> or model=hf model.path=<a Hugging Face model directory>",
                cfg.peft.method,
                cfg.train.seed,
            )
    weights = (
        None if cfg.peft.base_from else MODEL_REGISTRY[cfg.model.name].pretrained_weights(cfg.model)
    )
    # a full checkpoint's weights would replace them
    if weights is not None and (resumes_from is None or peft):
        MODEL_REGISTRY[cfg.model.name].check_pretrained(build_model(cfg.model), weights)
    # Last: these create the directories, which a refused run should not leave behind.
    check_writable("run.dir", Path(cfg.run.dir))
    if cfg.checkpoint.enabled:
        check_writable("checkpoint.dir" if cfg.checkpoint.dir else "run.dir", directory)
    return layout


def check_wandb(cfg: TrainConfig) -> None:
    """logging.wandb=true finds its credentials now, as wandb.init would: in the workers, with none
    and no terminal to ask on, wandb.init fails with a traceback once the data and the model are
    built. An offline or disabled wandb (WANDB_MODE, `wandb offline`) needs none."""
    if not cfg.logging.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError(
            "logging.wandb: the wandb package is not installed (composer3d depends on it; an "
            "install with --no-deps leaves it out). Install it with pip install wandb, or use "
            "logging.wandb=false"
        ) from None
    from wandb.errors import AuthenticationError

    try:
        # wandb's own lookup, from its SDK's internals (wandb >= 0.31)
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:  # an older wandb: its wandb.init reports a missing login itself
        return
    if "update_session" not in inspect.signature(wbauth.authenticate_session).parameters:
        return  # the same, where the lookup cannot be made without updating the session
    # the settings wandb.init starts from (environment, settings files): offline or disabled, it
    # skips its login
    settings = wandb_setup.singleton().settings
    if settings._offline or settings._noop:
        return
    try:
        # The lookup wandb.init's login makes (WANDB_API_KEY, an identity token file, the netrc
        # file, the api_key setting) without its prompt. Not wandb.login(prompt=False): found
        # credentials, it asks the server whose they are, and rewrites the settings file.
        auth = wbauth.authenticate_session(
            host=wbauth.HostUrl(settings.base_url, app_url=settings.app_url),
            source="composer3d",
            prompt=False,
            update_session=False,
        )
    except AuthenticationError as error:  # a key of the wrong form, or two kinds of credentials
        raise ConfigError(
            f"logging.wandb: the Weights & Biases credentials are not usable ({error}). Run "
            "`wandb login --relogin`, or set WANDB_MODE=offline to log locally (`wandb sync` "
            "uploads the run later), or use logging.wandb=false"
        ) from None
    if auth is None:
        raise ConfigError(
            "logging.wandb: not logged in to Weights & Biases (no API key in WANDB_API_KEY or "
            "the netrc file). Run `wandb login` once on this machine, or set WANDB_MODE=offline "
            "to log locally (`wandb sync` uploads the run later), or use logging.wandb=false"
        )


def check_writable(key: str, directory: Path) -> None:
    """Create ``directory`` and a file in it now, rather than fail at the first log line or
    checkpoint save."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ConfigError(
            f"{key}: cannot write into {directory} ({error.strerror or error}). Choose a directory "
            "this user can create and write"
        ) from None


def check_fresh_start(cfg: TrainConfig, run_dir: Path, directory: Path) -> None:
    """checkpoint.resume=none in a run.dir that holds an earlier run is refused: the fresh start
    would overwrite that run's metrics.jsonl and config.yaml, and keep_last would prune the new
    run's checkpoints for the old run's (newer by step). The way out is a run directory of its
    own."""
    if cfg.checkpoint.resume != "none":
        return
    metrics = run_dir / "metrics.jsonl"
    records = len(metrics.read_text().splitlines()) if metrics.is_file() else 0
    saved = [p.name for p in committed_checkpoints(directory)] + [
        p.name for p in directory.glob("step-*.partial")
    ]
    if not records and not saved:
        return
    held = ", ".join(
        filter(
            None,
            [
                f"metrics.jsonl with {records} records" if records else "",
                f"checkpoints {', '.join(sorted(saved))} in {directory}" if saved else "",
            ],
        )
    )
    raise ConfigError(
        f"checkpoint.resume: none starts afresh, but run.dir {run_dir} holds an earlier run "
        f"({held}); starting over there would overwrite its metrics and config, and "
        "checkpoint.keep_last would prune this run's checkpoints for that run's. Give this run a "
        "new run.name (or run.dir), or resume that run with checkpoint.resume=auto"
    )


def check_resumable(cfg: TrainConfig, directory: Path) -> Path | None:
    """The checkpoint a resume would load fits this run: complete (an explicit one), the same model
    shapes, and steps left to train. (Its data position is checked against the corpus when a worker
    loads it.) Returns that checkpoint; None where the run starts afresh."""
    mode = cfg.checkpoint.resume
    if mode == "none":
        return None
    # the newest training checkpoint that passes verification (as Checkpointer.resume takes it)
    if mode == "auto":
        path = next(
            (p for p in verified_checkpoints(directory) if not read_meta(p)["model_only"]), None
        )
        if path is None:
            return None
    else:
        path = Path(mode)
        if not (path / META_FILE).is_file():
            raise ConfigError(
                f"checkpoint.resume: {path} is not a complete composer3d checkpoint (no "
                f"{META_FILE}). Give a step-N directory, or use auto/none"
            )
        check_complete(path)
    try:
        meta = read_meta(path)
    except ValueError as error:  # a foreign format version, or JSON that does not parse
        raise ConfigError(
            f"checkpoint.resume: {path / META_FILE} is unreadable ({error}). Give another step-N "
            "directory, or start afresh in a new run.dir with checkpoint.resume=none"
        ) from None
    if cfg.peft.method != "none":
        if (meta["config"].get("peft") or {}).get("method", "none") == "none":
            raise ConfigError(
                f"checkpoint.resume: {path} is a full checkpoint (trained without peft), and this "
                f"run trains peft={cfg.peft.method} adapters. To train them on its weights, start "
                f"with peft.base_from={path} (checkpoint.resume continues a run of the same kind)"
            )
        check_same_base(path, meta, cfg)
    check_same_reference(path, meta, cfg)
    try:
        check_same_model(path, build_with_adapters(cfg.model, cfg.peft))
    except ConfigError:
        raise
    # an unreadable index: resume=auto falls back to an older checkpoint when it loads
    except Exception:
        if mode != "auto":
            raise
    if not meta["model_only"]:
        check_steps_left(meta, cfg.train.steps, path)
        check_same_optimizer(path, meta, cfg)
        # its data position points into the windows of the corpus it was saved with
        if cfg.data.prepared:
            check_same_corpus(
                meta["data"],
                check_prepared(
                    cfg.data, cfg.model.vocab_size, cfg.train.seq_len, cfg.model
                ).identity,
            )
    return path


def check_same_optimizer(path: Path, meta: dict, cfg: TrainConfig) -> None:
    """Muon's state (a momentum per hidden matrix) and AdamW's (two moments per parameter) do not
    continue each other: a checkpoint resumes under the optimizer kind that saved it."""
    before = (meta["config"].get("optim") or {}).get("name", "adamw")
    now = cfg.optim.name
    if before != now and "muon" in (before, now):
        raise ConfigError(
            f"optim.name: {path} holds the state of optim.name={before}, which optim.name={now} "
            f"cannot continue. Resume with optim.name={before}, or start a new run.dir from its "
            "weights: export them (composer3d-convert export) and train the export with model=hf "
            "model.path=<the export>"
        )


def check_same_reference(path: Path, meta: dict, cfg: TrainConfig) -> None:
    """A DPO run's reference is rebuilt from this config's initial weights, never from a checkpoint:
    resuming one is right only where it trained from those weights, as a DPO run from its start."""
    if cfg.train.objective != "dpo" or cfg.preference.loss_type == "simpo":
        return
    before = meta["config"]
    objective = (before.get("train") or {}).get("objective", "sft")
    now = base_source(cfg)
    if objective != "dpo":
        raise ConfigError(
            f"checkpoint.resume: {path} was saved by a train.objective={objective} run, and "
            f"train.objective=dpo takes its reference from this run's initial weights "
            f"({describe(now)}), not from the checkpoint it continues. To tune its weights, "
            "export them (composer3d-convert export) and start a new run from them with model=hf "
            "model.path=<the export>"
        )
    start, init_from = base_source(before), (before.get("peft") or {}).get("init_from")
    # (model.path may name another directory: the weights may have moved)
    same = start.keys() == now.keys() and ("pretrained" in now or start == now)
    if not same or init_from != cfg.peft.init_from:
        raise ConfigError(
            f"checkpoint.resume: {path} trained against the reference of {describe(start)}"
            + (f" with the adapters of peft.init_from={init_from}" if init_from else "")
            + ", and this run's config would build its reference from another start. Resume with "
            "the settings it was saved with (its composer3d.json has them)"
        )


def metrics_records(path: Path) -> list[tuple[str, int]]:
    """The (line, step) records of a run's metrics.jsonl. A last line that is not JSON was cut short
    by a process that died mid-write: it is dropped, with a warning. Any other unreadable line is no
    crash's trace, and is refused (a ConfigError naming run.dir, found before any worker starts)
    rather than dropped."""
    lines = [line for line in path.read_text().splitlines() if line]
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append((line, int(json.loads(line)["step"])))
        except (json.JSONDecodeError, TypeError, KeyError, ValueError):
            if number < len(lines):
                raise ConfigError(
                    f"run.dir: {path}, line {number}, is not a metrics record ({line[:80]!r}). "
                    "Repair or delete that line to resume this run, or give a fresh run a new "
                    "run.name"
                ) from None
            log.warning(
                "%s: dropped its last line, cut short mid-write by the run that wrote it: %r",
                path,
                line[:100],
            )
    return records
