"""The suite's tiers (docs/testing.md): each test is ``unit`` (one process), ``multiprocess``
(starts processes: forked gloo ranks, a tool) or ``cli`` (starts a composer3d command as a user
does), read from what the test and its fixtures call, so a marker cannot fall out of date; ``slow``
and ``accelerator`` are marked by hand. Each test is held to its tier while it runs: a unit test
that starts ranks, or a test outside ``cli`` that starts a command, fails naming the tier it belongs
in.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

TIERS = ("unit", "multiprocess", "cli")
# harness's functions that start a composer3d command, and those that fork ranks
STARTS_A_COMMAND = {"train", "start", "train_in_background"}
STARTS_PROCESSES = {
    "spawn",
    "processes",
    "train_in_one_group",
    "train_job",
    "compiled_jobs",
    "command_job",
}
# a composer3d command: its console script or its module (python -m)
COMMAND = re.compile(r"composer3d(-[a-z]+\b|\.commands\.[a-z]+|\.train\b)")
# harness's functions that take a command's module and run it without its command line
RUNS_A_MODULE = {"run_command", "command_output", "command_job"}


def pytest_configure(config):
    for line in (
        "unit: in one process: no rank, no command started (seconds; run on every change)",
        "multiprocess: starts processes (forked gloo ranks, a tool), not a composer3d command",
        "cli: starts a composer3d command as a user types it (exit codes, launcher, signals)",
        "accelerator: needs an accelerator (CUDA/XPU/MPS): skipped without one",
        "timing: measures wall time: runs alone, not beside pytest-xdist's other worker",
    ):
        config.addinivalue_line("markers", line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Before ``-m`` selects: every test gets its tier marker; without an accelerator, those that
    need one are skipped."""
    import torch

    no_accelerator = pytest.mark.skip(reason="needs an accelerator")
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(_tier(item))
        if item.get_closest_marker("accelerator") and not torch.accelerator.is_available():
            item.add_marker(no_accelerator)


def _tier(item) -> str:
    function = getattr(item, "function", None)
    if function is None:
        return "unit"
    module = inspect.getmodule(function)
    fixtures = item._fixtureinfo.name2fixturedefs
    sources = [function] + [
        defs[-1].func for name, defs in fixtures.items() if name in item.fixturenames and defs
    ]
    found = set()
    for source in sources:
        found |= _calls_of(source, module)
    if "command" in found:
        return "cli"
    return "multiprocess" if "processes" in found else "unit"


def _calls_of(function, module, seen=None) -> set[str]:
    """'command' and/or 'processes': what ``function`` starts, following the functions of the tests'
    own modules it calls."""
    seen = seen if seen is not None else set()
    if function in seen:
        return set()
    seen.add(function)
    tree = _tree(function)
    if tree is None:
        return set()
    found = set()
    names_a_command = any(COMMAND.search(text) for text in _strings(tree))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else None
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else None
        owner = getattr(node.func, "value", None)
        owner = owner.id if isinstance(owner, ast.Name) else None
        if name in STARTS_A_COMMAND or (owner == "harness" and attr in STARTS_A_COMMAND):
            found.add("command")
        elif name in STARTS_PROCESSES or (owner == "harness" and attr in STARTS_PROCESSES):
            found.add("processes")
        elif name == "convert" and any(k.arg == "cli" for k in node.keywords):
            found.add("command")
        elif (owner == "subprocess" and attr != "CompletedProcess") or owner == "mp":
            found.add("processes")
        elif attr == "getfixturevalue" and module is not None:  # the fixtures it may ask for
            for named in ast.walk(node):
                if isinstance(named, ast.Constant) and isinstance(named.value, str):
                    fixture = getattr(module, named.value, None)
                    if hasattr(fixture, "_get_wrapped_function"):
                        found |= _calls_of(fixture._get_wrapped_function(), module, seen)
        elif name and module is not None:
            callee = getattr(module, name, None)
            if inspect.isfunction(callee) and _in_tests(callee):
                found |= _calls_of(callee, inspect.getmodule(callee), seen)
    # processes started with a composer3d command's name among the arguments (here or passed to a
    # helper that starts them)
    return found | {"command"} if names_a_command and "processes" in found else found


def _strings(tree) -> list[str]:
    """The string constants of ``tree``'s code (docstrings left out, and the modules handed to
    harness's functions that run them in a process of the test's: RUNS_A_MODULE)."""
    left_out = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    left_out |= {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) in RUNS_A_MODULE
        for arg in node.args
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in left_out
    ]


def _in_tests(function) -> bool:
    """A function of the tests' own modules (a test module, harness, plan_measure), whose calls
    count as the test's."""
    try:
        return Path(inspect.getsourcefile(function)).parent == Path(__file__).parent
    except TypeError:
        return False


@cache
def _tree(function):
    try:
        return ast.parse(inspect.cleandoc("\n" + inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None


@pytest.fixture(autouse=True)
def _alone_when_timed(request):
    """A test that times its ranks fails in a pytest-xdist worker: the other worker's runs take its
    cores and the times with them. CI runs them after the parallel run (``.ci/run``)."""
    if request.node.get_closest_marker("timing") and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(
            "a timing test measures wall time and runs alone: pytest -q -m 'timing and not slow' "
            "tests (without -n)",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def _held_to_its_tier(request, monkeypatch):
    tier = next(t for t in TIERS if request.node.get_closest_marker(t))
    if tier == "cli":
        return
    popen_init = subprocess.Popen.__init__

    def checked_popen(self, args, *rest, **kwargs):
        if COMMAND.search(" ".join(map(str, args if isinstance(args, (list, tuple)) else [args]))):
            raise AssertionError(
                f"a {tier} test started a composer3d command ({args}): it belongs in the cli tier "
                "(tests/conftest.py reads the tier from what the test calls)"
            )
        popen_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", checked_popen)
    if tier == "unit":
        import torch.multiprocessing

        def no_ranks(*args, **kwargs):
            raise AssertionError(
                "a unit test started processes: it belongs in the multiprocess tier "
                "(tests/conftest.py reads the tier from what the test calls)"
            )

        monkeypatch.setattr(torch.multiprocessing, "start_processes", no_ranks)
