"""A calibration file: the rates ``composer3d-plan plan.calibrate=FILE`` measured on one device
(plan/calibrate.py), read back by the planner (``plan.calibration=FILE``) in place of the constants
its kernel times otherwise rest on (plan/kernels.py, set on an H100 and an H200).

Each kind the file holds replaces the constants for it; nothing else changes:
  - GEMMs: the seconds of each linear's three matmuls (forward, input and weight gradient) at the
    shapes it measured them at; a GEMM of one of those shapes takes its own rate, any other the rate
    interpolated in log FLOPs between the measured ones (flat beyond the smallest and the largest),
    in place of ``cluster.achievable_fraction`` of the peak and the operands' bytes over HBM;
  - attention: causal attention's forward + backward FLOP/s per kernel (plan.attention_kernel) and
    sequence length, interpolated in log length (flat beyond the ends), in place of the kernel's
    fraction of the peak (``ATTENTION_FRACTION``); a kernel it lacks keeps the fraction;
  - the optimizer step: seconds per local parameter of the gradient norm, clip and AdamW, in place
    of AdamW's 28 bytes over HBM;
  - memory bandwidth: bytes/s of a copy, the elementwise kernels' bound, in place of the device
    table's (a ``cluster.hbm_gbps`` given still wins, as it does over the table).
Float8 GEMMs and Muon's Newton–Schulz keep the constants; memory, links and the peak MFU is counted
against stay the device table's.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

from composer3d.errors import ConfigError

FORMAT = "composer3d-calibration/1"


@dataclass(frozen=True)
class Gemm:
    """One linear's [m, k] × [k, n] forward and its two backward matmuls (the same shapes
    permuted), ``seconds`` for the three."""

    names: tuple[str, ...]  # the layer's linears of this shape (wk and wv alike, w1 and w3)
    m: int
    n: int
    k: int
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return 6 * self.m * self.n * self.k / self.seconds


@dataclass(frozen=True)
class Attention:
    """Causal scaled-dot-product attention over ``batch`` sequences of ``seq_len`` tokens."""

    kernel: str  # plan.attention_kernel
    seq_len: int
    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    forward_s: float
    seconds: float  # forward and backward, timed as one

    @property
    def flops_per_s(self) -> float:
        # forward 2·s²·H·d a sequence (half the score matrix), backward 2.5× that: plan/kernels.py's
        return 3.5 * 2 * self.batch * self.seq_len**2 * self.heads * self.head_dim / self.seconds


@dataclass(frozen=True)
class OptimizerStep:
    implementation: str  # AdamW's kernels, as optim.implementation resolved on the device
    params: int
    tensors: int
    seconds: float  # the gradient norm, the clip and the step

    @property
    def seconds_per_param(self) -> float:
        return self.seconds / self.params


@dataclass(frozen=True)
class Copy:
    bytes: int  # read and written
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.seconds


@dataclass(frozen=True)
class Rates:
    device: str  # cluster.device's name for it (plan/hardware.py's table)
    device_name: str  # what torch calls it
    dtype: str  # the compute dtype the GEMMs, attention and copy ran in
    torch: str
    date: str  # UTC, ISO 8601
    layout: str  # the layout whose shapes were measured (Candidate.short)
    gemms: tuple[Gemm, ...]
    attention: tuple[Attention, ...]
    optimizer: OptimizerStep | None
    copy: Copy | None
    format: str = FORMAT

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Rates:
        """Raises KeyError, TypeError or ValueError on what is not a calibration file."""
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, not {FORMAT!r}")
        rates = cls(
            **{
                **d,
                "gemms": tuple(Gemm(**{**g, "names": tuple(g["names"])}) for g in d["gemms"]),
                "attention": tuple(Attention(**a) for a in d["attention"]),
                "optimizer": OptimizerStep(**d["optimizer"]) if d["optimizer"] else None,
                "copy": Copy(**d["copy"]) if d["copy"] else None,
            }
        )
        seconds = [
            *(g.seconds for g in rates.gemms),
            *(s for a in rates.attention for s in (a.forward_s, a.seconds)),
            *([rates.optimizer.seconds, rates.optimizer.params] if rates.optimizer else []),
            *([rates.copy.seconds, rates.copy.bytes] if rates.copy else []),
        ]
        if not all(isinstance(s, (int, float)) and s > 0 for s in seconds):
            raise ValueError("a time or size that is not positive")
        return rates

    @cached_property
    def _gemm_exact(self) -> dict[tuple[int, int, int], float]:
        return {(g.m, g.n, g.k): g.flops_per_s for g in self.gemms}

    @cached_property
    def _gemm_by_flops(self) -> list[tuple[float, float]]:
        """(FLOPs, FLOP/s) per distinct FLOP count, GEMMs of the same count pooled."""
        seconds: dict[int, list[float]] = {}
        for g in self.gemms:
            seconds.setdefault(6 * g.m * g.n * g.k, []).append(g.seconds)
        return sorted((flops, flops * len(s) / sum(s)) for flops, s in seconds.items())

    @cached_property
    def _attention_by_length(self) -> dict[str, list[tuple[float, float]]]:
        by_kernel: dict[str, list[tuple[float, float]]] = {}
        for a in self.attention:
            by_kernel.setdefault(a.kernel, []).append((a.seq_len, a.flops_per_s))
        return {kernel: sorted(points) for kernel, points in by_kernel.items()}

    def gemm_rate(self, m: float, n: float, k: float) -> float | None:
        """FLOP/s of a [m, k] × [k, n] GEMM (and its backward ones); None without GEMMs."""
        if not self.gemms:
            return None
        exact = self._gemm_exact.get((m, n, k))
        return exact if exact is not None else _interpolated(self._gemm_by_flops, 6 * m * n * k)

    def attention_rate(self, kernel: str, seq_len: int) -> float | None:
        """FLOP/s of ``kernel``'s causal forward + backward at ``seq_len``; None where the file has
        no measurement of the kernel."""
        points = self._attention_by_length.get(kernel)
        return _interpolated(points, seq_len) if points else None

    @cached_property  # said beside every estimate of a search
    def note(self) -> str:
        """What came from the file."""
        measured = [f"GEMMs ({len(self.gemms)} shapes)"] if self.gemms else []
        for kernel, points in self._attention_by_length.items():
            lengths = "/".join(f"{int(s):,}" for s, _ in points)
            measured.append(f"{kernel} attention at {lengths} tokens")
        if self.optimizer:
            measured.append("the optimizer step")
        if self.copy:
            measured.append("memory bandwidth")
        return (
            f"rates measured on {self.device_name} ({self.device}, {self.dtype}, torch "
            f"{self.torch}, {self.date}) from plan.calibration: {', '.join(measured) or 'none'}; "
            "the rest (float8 GEMMs, Muon's Newton-Schulz, what the file lacks) at the constants"
        )


def _interpolated(points: list[tuple[float, float]], x: float) -> float:
    """y at x, linear in log x between the (x, y) points (sorted by x), flat beyond the ends."""
    i = bisect.bisect_left(points, (x,))
    if i < len(points) and points[i][0] == x:  # measured there: its own rate, unrounded
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def read_rates(path: str, device: str, dtype: str) -> Rates:
    """``plan.calibration``'s file, for a plan on ``device`` (cluster.device) computing in
    ``dtype``; refused in one line where it is missing, is not a calibration file, or was measured
    on another device or in another dtype."""
    write = f"Write one on the device planned for: composer3d-plan plan.calibrate={path}"
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"plan.calibration: no file at {path}. {write}")
    try:
        rates = Rates.from_json(json.loads(file.read_text()))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"plan.calibration: {path} is not a calibration file composer3d-plan plan.calibrate "
            f"writes ({type(e).__name__}: {e}). {write}"
        ) from None
    if rates.device != device:
        raise ConfigError(
            f"plan.calibration: {path} was measured on {rates.device_name} ({rates.device}), not "
            f"cluster.device={device}. Plan with cluster.device={rates.device}, or calibrate on a "
            f"{device} (composer3d-plan plan.calibrate=FILE there)"
        )
    if rates.dtype != dtype:
        raise ConfigError(
            f"plan.calibration: {path} was measured in {rates.dtype}, and this plan computes in "
            f"{dtype} (precision.param_dtype). Plan with precision.param_dtype={rates.dtype}, or "
            f"calibrate with precision.param_dtype={dtype}"
        )
    return rates
