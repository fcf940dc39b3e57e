"""The schema's keys by name, and the nearest real key to a mistyped one: a typo gets one line
naming the key it most likely meant, not Hydra's hint to add it with ``+`` (a key nothing reads,
which the checks then refuse)."""

from __future__ import annotations

import difflib
import functools

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from composer3d.config.schema import TrainConfig
from composer3d.errors import ConfigError


@functools.cache
def _schema() -> DictConfig:
    return OmegaConf.structured(TrainConfig)


@functools.cache
def schema_keys() -> tuple[str, ...]:
    """Every key of the schema as ``section.key`` (sections too, e.g. ``precision.float8``)."""

    def walk(node: DictConfig, prefix: str) -> list[str]:
        keys = []
        for name in node.keys():
            child = node._get_node(name)
            keys.append(prefix + str(name))
            if isinstance(child, DictConfig) and not child._is_none():
                keys += walk(child, f"{prefix}{name}.")
        return keys

    return tuple(walk(_schema(), ""))


def names_a_setting(key: str) -> bool:
    """Whether a dotted key is in the schema, or under a section that takes any key (a free-form
    mapping)."""
    node = _schema()
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or OmegaConf.get_type(node) is dict:
            # a value, a section left None, or a free-form mapping: not the schema's to say
            return True
        # not `in node`: that is False for a key whose value is missing (???)
        if part not in node.keys():
            return False
        node = node._get_node(part)
    return True


def nearest_key(key: str) -> str | None:
    """The schema key closest in spelling to ``key``, preferring its own section's; None when none
    is close."""
    section = key.rpartition(".")[0]
    siblings = [k for k in schema_keys() if k.rpartition(".")[0] == section]
    for candidates in (siblings, schema_keys()):
        close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
        if close:
            return close[0]
    return None


def did_you_mean(key: str) -> str:
    near = nearest_key(key)
    return f"Did you mean {near}?" if near else "Check the spelling against the keys --help lists"


def check_override_keys(overrides: list[str]) -> None:
    """Refuse (ConfigError) a ``section.key=value`` override whose key the schema lacks, naming the
    nearest real key. Group choices (``model=hf``), ``hydra.*``, ``+``/``~`` and what does not parse
    are Hydra's to report."""
    try:
        parsed = OverridesParser.create().parse_overrides(
            [o for o in overrides if not o.startswith("hydra")]
        )
    except HydraException:
        return
    for override in parsed:
        key = override.key_or_group
        if (
            override.type != OverrideType.CHANGE
            or override.package is not None
            or "." not in key
            or "/" in key
        ):
            continue
        if not names_a_setting(key):
            raise ConfigError(f"{key}: is not a composer3d setting. {did_you_mean(key)}")
