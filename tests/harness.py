"""Runs composer3d-train as a user would (a subprocess; N local gloo workers) and reads what it
wrote."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

# Small and fast: the tiny model on a slice of the stdlib corpus, fp32, deterministic.
FAST = [
    "model=tiny",
    "data.max_tokens=200000",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "logging.progress_bar=false",
    "train.deterministic=true",
    "launch.device=cpu",
]
# model=tiny_moe's routed experts: 3 MoE layers of 8 experts, each w1, w2, w3 of 64 × 64
TINY_MOE_EXPERT_PARAMS = 3 * 8 * 3 * 64 * 64


@dataclass
class RunResult:
    returncode: int
    output: str
    seconds: float
    run_dir: Path

    @property
    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def run_info(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def effects(self) -> list[dict]:
        """Per rank, what the switches did to the model and optimizer
        (``train(probe_effects=True)``)."""
        return [
            json.loads(p.read_text()) for p in sorted((self.run_dir / "effects").glob("rank*.json"))
        ]


FAULT_INJECTION = Path(__file__).parent / "fault_injection"
# Where the composer3d these tests import lives: the checkout under an editable install,
# site-packages under a wheel (whose mapped conf/ the checkout's own tree lacks).
PACKAGE_ROOT = Path(importlib.util.find_spec("composer3d").origin).parents[1]


def train(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    timeout: float = 600,
    check: bool = True,
    env: dict | None = None,
    faults: dict | None = None,
    probe_effects: bool = False,
) -> RunResult:
    """``faults``: COMPOSER3D_TEST_* variables for tests/fault_injection, which every process of the
    run loads; ``probe_effects``: each rank records its model's and optimizer's state after the
    first step (``effects``)."""
    if probe_effects:
        faults = {**(faults or {}), "COMPOSER3D_TEST_EFFECTS": str(Path(run_dir) / "effects")}
    began = time.monotonic()
    proc = subprocess.run(
        _command(run_dir, overrides, nproc),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(env, faults),
    )
    result = RunResult(
        proc.returncode, proc.stdout + proc.stderr, time.monotonic() - began, Path(run_dir)
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"composer3d-train {' '.join(overrides)} failed "
            f"({proc.returncode}):\n{result.output[-6000:]}"
        )
    return result


@contextlib.contextmanager
def hydra_cleared():
    """Hydra's global state cleared while the block runs (as a command's process starts), then
    as it was (a compose fixture's, while its scope lasts)."""
    from hydra.core.global_hydra import GlobalHydra

    hydra = GlobalHydra.instance()
    before = hydra.hydra if hydra.is_initialized() else None
    hydra.clear()
    try:
        yield
    finally:
        # the instance now: Hydra's initialize_config_module restores a copy of the one it found
        hydra = GlobalHydra.instance()
        hydra.clear()
        if before is not None:
            hydra.initialize(before)


def run_command(monkeypatch, module: str, *argv: str) -> int:
    """``python -m module argv...`` in this process, as the command line runs it up to where it
    would start workers, which fails the test: for what a command prints or refuses before any
    worker. Returns its exit code (0 when it returns); its output is the test's capsys/capfd.
    Hydra's global state is as it was before."""
    from composer3d.commands import cli

    def no_workers(*args, **kwargs):
        raise AssertionError(f"{module} {' '.join(argv)} started workers")

    monkeypatch.setattr("composer3d.launch.launcher.spawn_local_workers", no_workers)
    monkeypatch.setattr("sys.argv", [module, *argv])
    with hydra_cleared():
        try:
            cli.SCRIPTS[module]()
            return 0
        except SystemExit as exit_:
            return exit_.code


def command_output(module: str, *argv: str) -> subprocess.CompletedProcess:
    """``run_command`` with what it prints to sys.stdout and sys.stderr: for a command whose output
    is Python's prints (composer3d-plan's table, its one-line refusals)."""
    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        return _printed([module, *argv], lambda: run_command(monkeypatch, module, *argv))


def _printed(args: list, call) -> subprocess.CompletedProcess:
    """``call()``'s exit code and what it printed to sys.stdout and sys.stderr, as a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = call()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def train_command(monkeypatch, capfd, run_dir: Path, *overrides: str, nproc: int = 1) -> RunResult:
    """composer3d-train with ``train``'s arguments, in this process (``run_command``): for what the
    command refuses before any worker starts. ``output`` is what it printed."""
    capfd.readouterr()
    began = time.monotonic()
    code = run_command(
        monkeypatch,
        "composer3d.commands.train",
        *_command(run_dir, overrides, nproc)[3:],
    )
    out, err = capfd.readouterr()
    return RunResult(code, out + err, time.monotonic() - began, Path(run_dir))


def convert(
    *args: str, check: bool = True, umask: int = -1, cli: bool = False
) -> subprocess.CompletedProcess:
    """composer3d-convert ``args``: in this process (its ``main``), or with ``cli`` as a user runs
    it (a subprocess: the exit code the shell sees)."""
    if cli:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, "-m", "composer3d.commands.convert", *map(str, args)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            umask=umask,
        )
    else:
        from composer3d.commands.convert import main

        saved = os.umask(umask) if umask >= 0 else None
        try:
            proc = _printed(list(args), lambda: main([str(a) for a in args]))
        finally:
            if saved is not None:
                os.umask(saved)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"composer3d-convert {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def start(
    run_dir: Path, *overrides: str, nproc: int = 1, faults: dict | None = None
) -> subprocess.Popen:
    """composer3d-train in the background, in its own process group (as a shell starts a job),
    output piped."""
    return subprocess.Popen(
        _command(run_dir, overrides, nproc),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(None, faults),
        start_new_session=True,
    )


def train_in_background(
    run_dir: Path,
    *overrides: str,
    nproc: int = 1,
    env: dict | None = None,
    faults: dict | None = None,
) -> subprocess.Popen:
    """The run ``train`` makes, started in the background to act on while it trains; output in
    ``<run_dir>.out``."""
    with open(f"{run_dir}.out", "w") as out:
        return subprocess.Popen(
            _command(run_dir, overrides, nproc),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=_child_env(env, faults),
        )


def wait_until(proc: subprocess.Popen, condition, what: str, timeout: float = 300) -> None:
    """Poll ``condition()`` while ``proc`` runs; fail with its output if it ends (or time runs out)
    first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(
                f"no {what} (exit {proc.returncode}):\n{proc.communicate()[1][-4000:]}"
            )
        time.sleep(0.2)


def _command(run_dir: Path, overrides, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "composer3d.commands.train",
        f"launch.nproc_per_node={nproc}",
        f"run.dir={run_dir}",
        *overrides,
    ]


def _child_env(env: dict | None, faults: dict | None) -> dict:
    child_env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    child_env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})})
    if faults:
        child_env.update(faults)
        # The hooks import composer3d at interpreter start-up, before `python -m` puts the working
        # directory on sys.path: name the tests' own composer3d first, so the hooks patch the code
        # the run executes.
        child_env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(FAULT_INJECTION), str(PACKAGE_ROOT), child_env.get("PYTHONPATH")])
        )
    return child_env


def train_in_one_group(
    jobs: list[tuple[Path, list[str]]], nproc: int, probe_effects: bool = False
) -> list[RunResult]:
    """Each job (run directory, overrides) trained by ``composer3d.commands.train.run`` as a
    torchrun worker runs it, one after another in the same ``nproc`` processes: the interpreter and
    import start-up (most of a tiny run's time) is paid once. For numerics across many models; the
    command line itself is what ``train`` tests. ``probe_effects``: each job's ranks record what the
    switches did (``RunResult.effects``), as ``train(probe_effects=True)``."""
    import torch.distributed as dist

    # Each job's rendezvous store is served from here, as torchrun's agent serves its workers', on a
    # port the OS picks and this process holds throughout: a port found free and let go before use
    # can be taken in between (an earlier job's client sockets draw from the same range), and the
    # job then fails to start.
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in jobs]
    processes(
        _train_jobs,
        nproc,
        nproc,
        composed_jobs(jobs, nproc),
        [s.port for s in stores],
        probe_effects,
    )
    return [RunResult(0, "", 0.0, Path(run_dir)) for run_dir, _ in jobs]


def train_job(
    run_dir: Path, *overrides: str, nproc: int = 1, probe_effects: bool = False
) -> RunResult:
    """The run ``train`` makes, without the command line: its ranks forked from the session's
    preloaded server (``train_in_one_group``), so no interpreter starts. For what a run computes
    (curves, effects, checkpoints); what the command line does (exit codes, launcher, signals) is
    what ``train`` tests. ``output`` is rank 0's log (``<run.dir>/logs/rank0.log``)."""
    began = time.monotonic()
    train_in_one_group([(Path(run_dir), list(overrides))], nproc, probe_effects)
    log = Path(run_dir, "logs", "rank0.log")
    return RunResult(
        0, log.read_text() if log.exists() else "", time.monotonic() - began, Path(run_dir)
    )


def train_config(*overrides: str):
    """composer3d-train's config of ``overrides``, composed by Hydra in this process. Hydra does not
    nest: a Hydra the caller holds (a fixture's ``initialize_config_module``, or one an earlier test
    left) is set aside meanwhile and put back."""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from composer3d.config.registration import register_configs

    register_configs()
    held = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="composer3d.conf", version_base=None):
            return compose("train", overrides=list(overrides))
    finally:
        if held is not None:
            GlobalHydra.instance().initialize(held)


def composed_jobs(jobs: list[tuple[Path, list[str]]], nproc: int) -> list[tuple[str, object]]:
    """Each job's (run directory, overrides) composed into the config its ``nproc`` ranks train,
    here, once: composing in every rank cost each rank about half a second a job."""
    return [
        (
            str(run_dir),
            train_config(f"launch.nproc_per_node={nproc}", f"run.dir={run_dir}", *overrides),
        )
        for run_dir, overrides in jobs
    ]


def _train_jobs(
    rank: int, nproc: int, jobs: list[tuple[str, object]], ports: list[int], probe_effects: bool
) -> None:
    """Each of ``composed_jobs``'s jobs, one after another, on this rank."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    from composer3d.commands.train import run
    from composer3d.config.checks import resolve_model_config
    from composer3d.launch import distributed

    for (run_dir, cfg), port in zip(jobs, ports):
        _rank_env(rank, nproc, port)
        # DTensor caches its sharding decisions by op and mesh, and an earlier job's mesh of the
        # same ranks and names compares equal to this job's: its cached outputs would carry that
        # mesh, whose process groups are gone ("Could not resolve the process group") unless
        # they happened to get the same names.
        _clear_sharding_prop_cache()  # the Python cache and the C++ dispatch's
        if probe_effects:
            os.environ["COMPOSER3D_TEST_EFFECTS"] = str(Path(run_dir) / "effects")
            if str(FAULT_INJECTION) not in sys.path:
                sys.path.insert(0, str(FAULT_INJECTION))
            import effects_probe  # noqa: F401  (patches the Trainer of this process, once)
        resolve_model_config(cfg.model)
        run(cfg, distributed.job_env(), Path(run_dir))


def _rank_env(rank: int, nproc: int, port: int) -> None:
    """The environment torchrun gives a worker, its rendezvous store served by the test."""
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )


def command_job(module: str, *overrides: str, nproc: int = 1) -> list[str]:
    """What composer3d-eval or -generate (``module``) computes on ``nproc`` ranks, without the
    command line: the ranks forked from the session's preloaded server (``processes``), each
    settling the config as the command's workers do and running its ``run``. Returns what each rank
    printed to stdout. For the numbers a command computes; its exit codes, its refusals before any
    worker and the launcher are what the command-line tests test."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory() as out:
        processes(_command_rank, nproc, nproc, module, list(overrides), store.port, out)
        return [Path(out, f"rank{rank}.stdout").read_text() for rank in range(nproc)]


def _command_rank(
    rank: int, nproc: int, module: str, overrides: list[str], port: int, out: str
) -> None:
    import importlib

    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from composer3d.config.registration import register_configs
    from composer3d.launch import distributed

    _rank_env(rank, nproc, port)
    command = importlib.import_module(module)
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose(
            "train",
            overrides=[f"launch.nproc_per_node={nproc}", *overrides],
            return_hydra_config=True,
        )
    # what Hydra's run gives the command: its overrides as typed (HydraConfig), the job's config
    # without the hydra node
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    command._settle(cfg)
    with open(Path(out, f"rank{rank}.stdout"), "w") as stdout, contextlib.redirect_stdout(stdout):
        command.run(cfg, distributed.job_env())


def compiled_jobs(
    rank: int, nproc: int, jobs: list[tuple[str, object]], ports: list[int], report: str
) -> None:
    """``_train_jobs`` with compiled blocks, failing on any recompile, and each rank's dynamo counts
    written to ``report``/rank{rank}.json: the reasons its graphs broke and how many graphs it
    compiled."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    # a graph compiled again at a later step fails the run
    torch._dynamo.config.error_on_recompile = True
    _train_jobs(rank, nproc, jobs, ports, False)
    Path(report, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "graph_breaks": dict(counters["graph_break"]),
                "graphs": counters["stats"]["unique_graphs"],
            }
        )
    )


def spawn(fn, world_size: int, tmp_path: Path, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; a worker's traceback
    fails the test."""
    processes(_worker, world_size, fn, world_size, str(tmp_path / "store"), args)


# What every in-process worker imports: loaded once, in the server the workers are forked from.
FORKSERVER_PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.distributed.checkpoint",
    "transformers",
    "composer3d.commands.train",
    "composer3d.commands.evaluate",
    "composer3d.commands.generate",
    "composer3d.evaluation.harness",  # lm-eval's (4 s a process)
    "harness",
    "preloaded",  # last: freezes what the imports above created
]


def processes(fn, nprocs: int, *args) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a process's traceback fails the test
    (``mp.spawn``).

    The processes are forked from a server process that imported torch, transformers and composer3d
    once for the session (multiprocessing's forkserver): a spawned process would spend ~6 s of CPU
    on its own imports first, which is most of what a tiny run costs on 2 cores. The server is a
    fresh interpreter (no threads, no process group), so its forks are as clean as spawned
    processes."""
    import multiprocessing
    from multiprocessing import forkserver

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    server_env = {
        # OpenMP reads OMP_NUM_THREADS when torch loads, which is in the server: one thread per
        # worker from there on.
        "OMP_NUM_THREADS": "1",
        # the tests' own modules preloaded too: Python 3.11's server ignores the sys.path it is
        # handed, and a preload it cannot import is skipped without a word
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
        ),
        # the workers read local files only, and keep datasets' cache out of the home directory
        # (what the server's environment is, every worker's is: the test's own is not passed on)
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        # one cache per pytest-xdist worker
        "HF_DATASETS_CACHE": str(
            Path(
                tempfile.gettempdir(),
                f"composer3d-tests-datasets{os.environ.get('PYTEST_XDIST_WORKER', '')}",
            )
        ),
    }
    with mock.patch.dict(os.environ, server_env):
        forkserver.ensure_running()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _worker(rank: int, fn, world_size: int, store: str, args) -> None:
    import torch.distributed as dist

    from composer3d.launch.distributed import shut_down

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    finished = False
    try:
        fn(rank, world_size, *args)
        finished = True
    finally:
        # as training ends: without it gloo aborted at exit in ~1 of 10 runs of a FSDP test
        shut_down(finished)


@contextlib.contextmanager
def logged(level: int = logging.INFO):
    """The messages composer3d's logger gives at ``level`` or above inside the block, read on the
    logger itself (a run's console setup stops its records from reaching pytest's caplog)."""
    said: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("composer3d")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level, previous) if previous else level)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def assert_follows(reference: RunResult, run: RunResult, what: str) -> None:
    """``run`` on the one-process curve over 10 steps: losses within 1e-4, gradient norms within
    1e-3."""
    assert len(reference.losses) == len(run.losses) == 10, what
    diffs = [abs(a - b) for a, b in zip(reference.losses, run.losses)]
    assert max(diffs) < 1e-4, f"{what}: per-step |Δloss| {diffs}"
    grad_diffs = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(reference.metrics, run.metrics)
    ]
    assert max(grad_diffs) < 1e-3, f"{what}: grad norms differ {grad_diffs}"
