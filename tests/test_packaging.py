"""The top-level conf/ and recipes/ reach Hydra as `composer3d.conf` / `composer3d.recipes` in every
install.

pyproject.toml maps them into the package (`package-dir`). The wheel test builds a wheel, installs
it into a fresh virtualenv and runs its `composer3d-train --cfg job` (compose and print the config,
nothing else) from a directory outside the repository. The virtualenv sees this machine's packages
(torch, hydra …: nothing is downloaded), but its own site-packages come first, so it imports the
wheel's composer3d, not the editable install; the test checks.
"""

import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[1]
RECIPE = "qwen3_8b"
MODEL_PATH = "/models/Qwen3-8B"  # only printed: --cfg job does not read the model


def _env() -> dict[str, str]:
    # Nothing may point Python back at the checkout.
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(a) for a in args],
        check=False,
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    command = " ".join(map(str, args))
    assert proc.returncode == 0, (
        f"{command} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return proc


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _get(cfg: dict, dotted: str):
    for part in dotted.split("."):
        cfg = cfg[part]
    return cfg


def _check_recipe_config(stdout: str) -> None:
    cfg = yaml.safe_load(stdout)
    recipe = yaml.safe_load((REPO / "recipes" / "recipe" / f"{RECIPE}.yaml").read_text())
    recipe.pop("defaults")
    leaves = _leaves(recipe)
    assert leaves, "the recipe sets no keys"
    for key, value in leaves.items():
        assert _get(cfg, key) == value, f"{key}: composed {_get(cfg, key)!r}, recipe says {value!r}"
    # the recipe's group overrides
    assert cfg["model"]["name"] == "hf" and cfg["data"]["name"] == "text_files"
    assert cfg["model"]["path"] == MODEL_PATH


@pytest.mark.timeout(300)
def test_wheel_in_fresh_virtualenv_runs_recipe(tmp_path):
    # Build from a copy of what the wheel is made of, so the build leaves nothing (build/, egg-info)
    # in the checkout.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("composer3d", "conf", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            tmp_path / "dist",
            src,
        ],
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("composer3d-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    for required in (
        "composer3d/conf/train.yaml",
        "composer3d/conf/model/tiny.yaml",
        f"composer3d/recipes/recipe/{RECIPE}.yaml",
    ):
        assert required in names, f"{required} is not in the wheel"
    # Every config file, and every module of every subpackage (pyproject lists the packages by
    # hand).
    expected = {
        f"composer3d/conf/{p.relative_to(REPO / 'conf').as_posix()}"
        for p in (REPO / "conf").rglob("*.yaml")
    }
    expected |= {
        f"composer3d/recipes/recipe/{p.name}" for p in (REPO / "recipes" / "recipe").glob("*.yaml")
    }
    expected |= {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "composer3d").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    python, train = env_dir / "bin" / "python", env_dir / "bin" / "composer3d-train"
    # pip comes from the system site-packages; --ignore-installed: never touch the machine's own
    # composer3d.
    _run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "-q",
            wheel,
        ],
        cwd=tmp_path,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    code = (
        "import composer3d, composer3d.conf, composer3d.recipes as r; print(composer3d.__file__, "
        "composer3d.conf.__file__, r.__file__, sep='\\n')"
    )
    where = _run([python, "-c", code], cwd=work)
    for line in where.stdout.split():
        assert Path(line).resolve().is_relative_to(env_dir.resolve()), (
            f"imported {line}, not the wheel's copy"
        )

    default = _run([train, "--cfg", "job"], cwd=work)
    assert default.stdout.startswith("model:"), default.stdout[:500]
    assert yaml.safe_load(default.stdout)["model"]["name"] == "llama"
    _check_recipe_config(
        _run(
            [train, f"recipe={RECIPE}", f"model.path={MODEL_PATH}", "--cfg", "job"], cwd=work
        ).stdout
    )
    # `python -m` (how local workers and torchrun start) finds the same configs.
    _check_recipe_config(
        _run(
            [
                python,
                "-m",
                "composer3d.commands.train",
                f"recipe={RECIPE}",
                f"model.path={MODEL_PATH}",
                "--cfg",
                "job",
            ],
            cwd=work,
        ).stdout
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "module",
    ["composer3d.commands.train", "composer3d.commands.evaluate", "composer3d.commands.generate"],
)
def test_this_install_composes_from_any_directory(module, tmp_path):
    """The install the suite runs against (editable in development and CI): `python -m` as the
    workers start."""
    _check_recipe_config(
        _run(
            [
                sys.executable,
                "-m",
                module,
                f"recipe={RECIPE}",
                f"model.path={MODEL_PATH}",
                "--cfg",
                "job",
            ],
            cwd=tmp_path,
        ).stdout
    )


def test_the_suite_runs_on_versions_the_pins_declare():
    """pyproject's pins are the range the tests ran with (docs/performance.md: what ran on each): a
    suite run on a torch, torchao or transformers outside them is a version to declare (and record)
    or not to claim."""
    from importlib.metadata import version

    import tomllib
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = map(
        Requirement, project["dependencies"] + project["optional-dependencies"]["hf"]
    )
    pins = {req.name: req.specifier for req in requirements}
    for package in ("torch", "torchao", "transformers"):
        assert pins[package].contains(version(package), prereleases=True), (
            package,
            version(package),
            pins[package],
        )
        assert any(spec.operator in ("<", "<=") for spec in pins[package]), (
            f"{package} is not bounded above"
        )
