"""Which modules a test change leaves with fewer covered lines (docs/testing.md, "Coverage").

    python tests/coverage_compare.py before.json after.json
    python tests/coverage_compare.py before.json after.json --sources BEFORE_ROOT AFTER_ROOT

Each file is ``coverage json`` of a suite run (``coverage run -m pytest ...; coverage combine``),
before and after the change. Prints, per module that lost any, the lines covered before and not
after; exits 1 if any module lost a line. Files are matched by their path inside the package, so the
two runs may come from different checkouts.

With the same composer3d code on both sides, a line is its number. With ``--sources`` (the two
checkouts' roots), the code may differ too: a line is then its text (stripped) and which occurrence
of that text it is in its module, so a line that only moved is the same line, and a line the later
code no longer has cannot be lost. Each module's count of covered lines is printed either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def covered(path: str) -> dict[str, set[int]]:
    files = json.loads(Path(path).read_text())["files"]
    return {
        name[name.rindex("composer3d/") :]: set(data["executed_lines"])
        for name, data in files.items()
        if "composer3d/" in name
    }


def by_text(lines: dict[str, set[int]], root: Path | None) -> dict[str, set]:
    """Each module's covered lines as keys that survive edits elsewhere in it: (text, occurrence)
    where a source root is given, the line number where not."""
    if root is None:
        return lines
    keyed = {}
    for module, numbers in lines.items():
        seen: dict[str, int] = {}
        keys = set()
        for number, text in enumerate((root / module).read_text().splitlines(), start=1):
            text = text.strip()
            seen[text] = seen.get(text, 0) + 1
            if number in numbers:
                keys.add((text, seen[text]))
        keyed[module] = keys
    return keyed


def all_lines(root: Path, module: str) -> set:
    """Every (text, occurrence) key of a module's source: what a covered line can be matched to."""
    seen: dict[str, int] = {}
    keys = set()
    path = root / module
    for text in path.read_text().splitlines() if path.exists() else ():
        text = text.strip()
        seen[text] = seen.get(text, 0) + 1
        keys.add((text, seen[text]))
    return keys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--sources", nargs=2, type=Path, metavar=("BEFORE_ROOT", "AFTER_ROOT"))
    args = parser.parse_args(argv)
    before_root, after_root = args.sources or (None, None)
    before = by_text(covered(args.before), before_root)
    after = by_text(covered(args.after), after_root)
    lost = {}
    for module, keys in before.items():
        gone = keys - after.get(module, set())
        if after_root is not None:  # a line the later code no longer has is not lost coverage
            gone &= all_lines(after_root, module)
        if gone:
            lost[module] = sorted(gone, key=str)
    for module in sorted(set(before) | set(after)):
        counts = f"{len(before.get(module, ()))} -> {len(after.get(module, ()))} lines"
        print(f"{module}: {counts}" + (f"; lost {lost[module]}" if module in lost else ""))
    fewer = [m for m in before if len(after.get(m, ())) < len(before[m])]
    gained = sum(len(after[m] - before.get(m, set())) for m in after)
    print(
        f"{len(lost)} module(s) lost covered lines; {len(fewer)} module(s) with fewer covered "
        f"lines; {gained} line(s) newly covered"
    )
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
