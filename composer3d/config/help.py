"""``--help``: every key of the schema with its value in the composed config and the schema's own
comment on it, and the recipes. The comments in ``schema.py`` (and ``peft_schema.py``,
``plan_schema.py``) are the documentation; this reads them from their source, so a key documented
there is documented here, with no second copy to fall out of date.

Hydra prints the help (``hydra.help.template`` in conf/train.yaml, which lists the config groups
itself); the resolvers here fill in what it does not know, the running command's banner and examples
among them (every command reads the same config, and ``set_command`` says which one is running).

The documentation site's configuration reference is the same keys and comments as markdown:
``python -m composer3d.config.help > docs/configuration/reference.md`` (tests/test_docs.py checks it
is current).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import string
import sys
import textwrap
from importlib.resources import files
from typing import Sequence

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from composer3d.config import peft_schema, plan_schema, schema

_FIELD = re.compile(r"^    (\w+): [^#]*?(?:#\s*(.*))?$")
_COMMENT = re.compile(r"^    #\s?(.*)$")
_CLASS = re.compile(r"^class (\w+)")
KEY_WIDTH = 40
WIDTH = 118


_command = {
    "banner": "composer3d-train: train a model under any parallel layout",
    "examples": "",
    "sections": None,
}


def set_command(name: str, about: str, examples: Sequence[str], sections: Sequence[str]) -> None:
    """The command whose --help Hydra prints: its first line (``name: about``), the config sections
    whose keys it lists (those the command reads) and its examples."""
    _command["banner"] = f"{name}: {about}"
    _command["examples"] = "\n".join(
        ["Examples: " + examples[0], *("          " + e for e in examples[1:])]
    )
    _command["sections"] = tuple(sections)


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


def help_text(cfg: DictConfig) -> str:
    """The running command's --help (``hydra.help.template``) for ``cfg``, composed with
    ``hydra``."""
    return string.Template(cfg.hydra.help.template).substitute()


def config_groups() -> str:
    """conf/'s config groups and their options, one group a line."""
    groups = sorted(p.name for p in files("composer3d.conf").iterdir() if _is_group(p))
    lines = [f"{g}: {', '.join(_group_files(g))}\n" for g in groups]
    return "".join(lines).replace("$", "$$")


def _is_group(path) -> bool:
    return path.is_dir() and path.name != "hydra" and any(_group_files(path.name))


def key_help(_root_) -> str:
    """One entry per key of the running command's sections: ``section.key=<value in this composed
    config>`` and the schema's comment; then the sections it does not read."""
    comments = field_comments()
    lines, unread = [], []
    wanted = _command["sections"]
    for section in dataclasses.fields(schema.TrainConfig):
        if wanted is not None and section.name not in wanted:
            unread.append(section.name)
            continue
        lines.append(f"{section.name}:")
        lines += _entries(section.name, section.default_factory, _root_[section.name], comments)
    if unread:
        lines.append(f"(this command does not read {', '.join(unread)}: other commands' keys)")
    return "\n".join(lines).replace("$", "$$")  # Hydra fills the template with string.Template


def _group_files(group: str) -> dict:
    """A config group's options and their YAML files: the recipe group's in recipes/recipe/, the
    others' in conf/<group>/."""
    if group == "recipe":
        folder = files("composer3d.recipes") / "recipe"
    else:
        folder = files("composer3d.conf")
        for part in group.split("/"):
            folder = folder / part
    paths = sorted(folder.iterdir(), key=lambda p: p.name)
    return {p.name.removesuffix(".yaml"): p for p in paths if p.name.endswith(".yaml")}


def recipes() -> str:
    """The recipe group's options (recipe=<name>), which Hydra's own group listing does not show."""
    return ", ".join(_group_files("recipe"))


# The groups the reference lists: conf/'s and, of Hydra's, the launcher (the recipes have a table of
# their own)
GROUPS = ("model", "data", "parallel", "peft", "hydra/launcher")
REFERENCE = "docs/configuration/reference.md"
# an underscore only where it could open or close emphasis: data.text_field stays readable
_MARKDOWN = re.compile(r"[\\`*\[\]|]|(?<!\w)_|_(?!\w)")


def default_config() -> DictConfig:
    """What a plain ``composer3d-train`` composes (conf/train.yaml and its groups' defaults), with
    ``hydra.runtime.choices``: the option each group took."""
    # conf/train.yaml lists the schema first; registration stores it too, but imports this module
    ConfigStore.instance().store(name="train_schema", node=schema.TrainConfig)
    with initialize_config_module(config_module="composer3d.conf", version_base=None):
        return compose("train", return_hydra_config=True)


def _text(text: str) -> str:
    """Text for a markdown table cell: HTML's and markdown's characters escaped outside code spans
    (a | would end the cell, a <run.dir> would be a tag)."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick opens no code span
        parts = [text]
    escaped = [
        part
        if i % 2
        else _MARKDOWN.sub(lambda m: "\\" + m[0], part.replace("&", "&amp;").replace("<", "&lt;"))
        for i, part in enumerate(parts)
    ]
    return "`".join(escaped)


def _code(value: str) -> str:
    return f"`{value}`" if value else '`""`'


def _about(path) -> str:
    """What an option's YAML says of itself: its opening comment, up to a blank or indented line (a
    command to run), less the ``group=option:`` it may open with and a sentence that leads into a
    command."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("# @package"):
            continue
        if not line.startswith("# ") or line.startswith("#  "):
            break
        lines.append(line[2:])
    text = re.sub(r"^\S+=\S+( \([^)]*\))?: ", "", " ".join(lines))
    return text[: text.rfind(". ") + 1] if text.endswith(":") else text


def _options_table(groups, choices) -> list[str]:
    lines = ["| option | what it sets |", "|---|---|"]
    for group in groups:
        for option, path in _group_files(group).items():
            default = " (default)" if choices[group] == option else ""
            lines.append(f"| `{group}={option}`{default} | {_text(_about(path))} |")
    return lines


def _section(name: str, cls, values: dict, defaults: dict, comments, about: str) -> list[str]:
    """A section's table, then its nested sections by their dotted paths; ``values`` and
    ``defaults`` unresolved (a missing value is ``???``)."""
    lines = [f"## {name}", ""] + ([_text(about), ""] if about else [])
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    nested = []
    for key in dataclasses.fields(cls):
        comment = comments.get((cls.__name__, key.name), "")
        if dataclasses.is_dataclass(key.default_factory):
            nested += _section(
                f"{name}.{key.name}",
                key.default_factory,
                values[key.name],
                defaults[key.name],
                comments,
                comment,
            )
            continue
        value, default = _value(values[key.name]), _value(defaults[key.name])
        cell = _code(value) + ("" if value == default else f" (schema: {_code(default)})")
        lines.append(f"| `{name}.{key.name}` | {_text(key.type)} | {cell} | {_text(comment)} |")
    return [*lines, "", *nested]


def reference_markdown() -> str:
    """The configuration reference (docs/configuration/reference.md): the config groups and the
    recipes, then a table per section of the schema: each key, its type, its value in what a plain
    composer3d-train composes (and the schema's default where that differs), its comment."""
    cfg = default_config()
    choices = cfg.hydra.runtime.choices
    chosen = ", ".join(f"`{g}={choices[g]}`" for g in GROUPS if choices[g] in _group_files(g))
    unchosen = ", ".join(
        f"`{g}` (" + (f"Hydra's own `{choices[g]}`" if choices[g] else "none") + ")"
        for g in (*GROUPS, "recipe")
        if choices[g] not in _group_files(g)
    )
    lines = [
        f"<!-- Generated by `python -m composer3d.config.help > {REFERENCE}` from the comments "
        "in composer3d/config/*schema.py and conf/: edit those, not this file. -->",
        "",
        "# Configuration reference",
        "",
        "Every key the commands read, as typed on the command line (`key=value`), in the schema's "
        "order: its type, its default and what it means. The default is what a plain "
        f"`composer3d-train` composes: conf/train.yaml with its groups' defaults ({chosen}). "
        "Where that differs from the schema's own default (what an option that leaves the key "
        "unset gets), the schema's follows it; `???`: no default, the key must be set. How the "
        "config is composed and overridden: [Configuration](index.md).",
        "",
        "## Config groups",
        "",
        f"An option is picked as `group=option`. With none picked: {unchosen}.",
        "",
        *_options_table(GROUPS, choices),
        "",
        "## Recipes",
        "",
        "A recipe (`recipe=<name>`) sets a whole experiment: it beats the defaults, and the "
        "command line beats it.",
        "",
        *_options_table(["recipe"], choices),
        "",
    ]
    values = OmegaConf.to_container(cfg, resolve=False)
    defaults = OmegaConf.to_container(OmegaConf.structured(schema.TrainConfig), resolve=False)
    comments = field_comments()
    for section in dataclasses.fields(schema.TrainConfig):
        name = section.name
        lines += _section(name, section.default_factory, values[name], defaults[name], comments, "")
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference_markdown())
