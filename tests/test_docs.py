"""The documentation site's generated page: the configuration reference is a fresh render of the
schema's comments and conf/, and documents every key a run composes. In-process, about a second."""

import re
from pathlib import Path

from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from composer3d.config.help import REFERENCE, reference_markdown
from composer3d.config.registration import register_configs

ROOT = Path(__file__).parents[1]


def test_configuration_reference_is_current():
    assert (ROOT / REFERENCE).read_text() == reference_markdown(), (
        f"{REFERENCE} is out of date: regenerate it with "
        f"`python -m composer3d.config.help > {REFERENCE}`"
    )


def _leaf_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in node.items():
        if isinstance(value, dict):
            keys += _leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def test_reference_documents_every_composed_key():
    register_configs()
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        cfg = compose("train")
    keys = _leaf_keys(OmegaConf.to_container(cfg, resolve=False))
    meanings = {}
    for line in (ROOT / REFERENCE).read_text().splitlines():
        # a key's row: | `key` | type | default | meaning | (an escaped \| inside a cell)
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)]
        if len(cells) == 6 and cells[1].startswith("`"):
            meanings[cells[1].strip("`")] = cells[4]
    assert {"model.moe.top_k", "precision.float8.recipe"} <= set(keys)  # nested sections walked
    assert [key for key in keys if key not in meanings] == [], f"keys missing from {REFERENCE}"
    assert [key for key in keys if not meanings[key]] == [], (
        "keys with no comment in the schema (composer3d/config/*schema.py): comment them and "
        f"regenerate {REFERENCE}"
    )
