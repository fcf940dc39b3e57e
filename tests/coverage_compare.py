"""Which modules a test change leaves with fewer covered lines (docs/testing.md, "Coverage").

    python tests/coverage_compare.py before.json after.json

Each file is ``coverage json`` of a suite run (``coverage run -m pytest ...; coverage combine``),
before and after the change. Prints, per module that lost any, the lines covered before and not
after; exits 1 if any module lost a line. Files are matched by their path inside the package, so the
two runs may come from different checkouts.
"""

from __future__ import annotations

import json
import sys


def covered(path: str) -> dict[str, set[int]]:
    files = json.loads(open(path).read())["files"]
    return {
        name[name.rindex("composer3d/") :]: set(data["executed_lines"])
        for name, data in files.items()
        if "composer3d/" in name
    }


def main(before_path: str, after_path: str) -> int:
    before, after = covered(before_path), covered(after_path)
    lost = {m: sorted(lines - after.get(m, set())) for m, lines in before.items()}
    lost = {m: lines for m, lines in lost.items() if lines}
    for module, lines in sorted(lost.items()):
        counts = f"{len(before[module])} -> {len(after.get(module, ()))} lines"
        print(f"{module}: {counts}; lost {lines}")
    gained = sum(len(after[m] - before.get(m, set())) for m in after)
    print(f"{len(lost)} module(s) lost covered lines; {gained} line(s) newly covered")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
