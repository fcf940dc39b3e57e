"""``--help``: every key of the schema with its value in the composed config and the schema's own
comment on it, and the recipes. The comments in ``schema.py`` (and ``peft_schema.py``,
``plan_schema.py``) are the documentation; this reads them from their source, so a key documented
there is documented here, with no second copy to fall out of date.

Hydra prints the help (``hydra.help.template`` in conf/train.yaml, which lists the config groups
itself); the resolvers here fill in what it does not know, the running command's banner and examples
among them (every command reads the same config, and ``set_command`` says which one is running).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import textwrap
from importlib.resources import files

from omegaconf import OmegaConf

from composer3d.config import peft_schema, plan_schema, schema

_FIELD = re.compile(r"^    (\w+): [^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^    #\s?(.*)$")
_CLASS = re.compile(r"^class (\w+)")
KEY_WIDTH = 40
WIDTH = 118


_command = {"banner": "composer3d-train: train a model under any parallel layout", "examples": ""}


def set_command(name: str, about: str, examples: list[str]) -> None:
    """The command whose --help Hydra prints: its first line (``name: about``) and its examples."""
    _command["banner"] = f"{name}: {about}"
    _command["examples"] = "\n".join(
        ["Examples: " + examples[0], *("          " + e for e in examples[1:])]
    )


def banner() -> str:
    return _command["banner"].replace("$", "$$")  # Hydra fills the template with string.Template


def examples() -> str:
    return _command["examples"].replace("$", "$$")


def field_comments() -> dict[tuple[str, str], str]:
    """(dataclass name, field) → the comment above the field and at the end of its line, joined."""
    comments: dict[tuple[str, str], str] = {}
    owner, pending = None, []
    for line in "".join(
        inspect.getsource(m) for m in (schema, peft_schema, plan_schema)
    ).splitlines():
        if match := _CLASS.match(line):
            owner, pending = match.group(1), []
        elif match := _COMMENT.match(line):
            pending.append(match.group(1))
        elif owner and (match := _FIELD.match(line)):
            comments[owner, match.group(1)] = " ".join([*pending, match.group(2) or ""]).strip()
            pending = []
        else:
            pending = []
    return comments


def _value(value) -> str:
    plain = OmegaConf.to_container(value, resolve=False) if OmegaConf.is_config(value) else value
    return plain if isinstance(plain, str) else json.dumps(plain)


def _entries(prefix: str, cls, node, comments) -> list[str]:
    lines = []
    for key in dataclasses.fields(cls):
        name = f"{prefix}.{key.name}"
        # a nested section (precision.float8): its keys
        if dataclasses.is_dataclass(key.default_factory):
            lines += _entries(name, key.default_factory, node[key.name], comments)
            continue
        value = "???" if OmegaConf.is_missing(node, key.name) else _value(node[key.name])
        entry, indent = f"  {name}={value}", " " * KEY_WIDTH
        comment = comments.get((cls.__name__, key.name), "")
        if not comment:
            lines.append(entry)
            continue
        if len(entry) >= KEY_WIDTH:  # the comment starts on the next line
            lines.append(entry)
            entry = ""
        lines.append(
            textwrap.fill(
                comment, WIDTH, initial_indent=entry.ljust(KEY_WIDTH), subsequent_indent=indent
            )
        )
    return lines


def key_help(_root_) -> str:
    """One entry per key: ``section.key=<value in this composed config>`` and the schema's
    comment."""
    comments = field_comments()
    lines = []
    for section in dataclasses.fields(schema.TrainConfig):
        lines.append(f"{section.name}:")
        lines += _entries(section.name, section.default_factory, _root_[section.name], comments)
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the template with string.Template


def recipes() -> str:
    """The recipe group's options (recipe=<name>), which Hydra's own group listing does not show."""
    names = sorted(
        p.name.removesuffix(".yaml")
        for p in (files("composer3d.recipes") / "recipe").iterdir()
        if p.name.endswith(".yaml")
    )
    return ", ".join(names)
