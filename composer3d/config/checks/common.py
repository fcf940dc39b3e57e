"""What every check module shares: ``_require``, the one way a check fails (a ConfigError naming the
key, the problem and the fix), the divisors a fix suggests, and the dtype names the precision and
checkpoint keys accept."""

from __future__ import annotations

from composer3d.dtypes import DTYPES
from composer3d.errors import ConfigError

DTYPE_NAMES = tuple(DTYPES)


def _require(ok: bool, key: str, problem: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}. {fix}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
