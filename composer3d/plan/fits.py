"""What fits (``composer3d-plan plan.what_fits=true``): for the config's layout on its cluster, the
longest sequence each combination of the memory options trains, and the largest model (layers at the
config's width) each combination of model-state offload and activation checkpointing holds — and
which options it takes.

The options: activation checkpointing (none, op-level selective, full), sequence tiling of the MLP
and the loss (one tile per ``TILE_TOKENS`` tokens a rank holds), activation offload, and
ZeRO-Offload (optimizer, cpu). A combination that training refuses is left out (tiled loss under PP
or with train.objective=dpo, eager op-level selective with activation offload, ZeRO-1 with
offload, offload=optimizer with an optimizer other than AdamW, any offload with Muon). Device and
host memory both bound what fits (``estimate``'s ``fits``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product

from composer3d.config.schema import TrainLoopConfig
from composer3d.errors import ConfigError
from composer3d.plan.estimate import Estimate, Workload, estimate
from composer3d.plan.hardware import Cluster
from composer3d.plan.layouts import Candidate, micro_batch_sizes

TILE_TOKENS = 2048  # sequence tiling: the tokens of one tile (ALST's tiles are of this order)
SEQ_LIMIT = 2**24  # 16M tokens: the longest sequence the search tries
LAYER_LIMIT = 2048


def micro_batch_size(t: TrainLoopConfig, dp: int, given: bool) -> tuple[int, str | None]:
    """The micro-batch size to answer for on a layout of ``dp`` data-parallel ranks, by the search's
    rule (``micro_batch_sizes``: the global batch is the run's, the micro-batch the layout's): the
    config's where the layout runs it, else the largest below it that the layout runs, with why.
    Refused: a global batch the ranks cannot share, and a micro-batch ``given`` on the command line
    that does not divide a rank's share (not answered for another)."""
    if t.global_batch_size < 1 or t.micro_batch_size < 1:
        return t.micro_batch_size, None  # validate names what is wrong
    sizes = micro_batch_sizes(t.global_batch_size, dp)
    if not sizes:
        raise ConfigError(
            f"train.global_batch_size: {t.global_batch_size} sequences do not split over the "
            f"layout's {dp} data-parallel ranks. Use a multiple of {dp}, e.g. "
            f"{dp * max(1, t.global_batch_size // dp)}, or a layout with fewer data-parallel ranks "
            "(parallel.tp, parallel.pp or parallel.cp above 1)"
        )
    if t.micro_batch_size in sizes:
        return t.micro_batch_size, None
    runs = max(m for m in sizes if m <= t.micro_batch_size)  # sizes holds 1
    local = t.global_batch_size // dp
    why = (
        f"train.micro_batch_size: {t.micro_batch_size} does not divide the {local} sequences each "
        f"of the {dp} data-parallel ranks gets (train.global_batch_size {t.global_batch_size})"
    )
    if given:
        raise ConfigError(
            f"{why}. Use a divisor of {local}, e.g. {runs}, or a train.global_batch_size that is a "
            f"multiple of {t.micro_batch_size * dp}"
        )
    return runs, f"{why}: answered at train.micro_batch_size={runs}"


@dataclass(frozen=True)
class Options:
    activation_checkpointing: str
    tiled: bool
    activation_offload: bool
    offload: str

    def label(self) -> str:
        parts = [f"ac:{self.activation_checkpointing}"]
        if self.tiled:
            parts.append("tiled mlp+loss")
        if self.activation_offload:
            parts.append("act-offload")
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        return " ".join(parts)


def option_sets(
    c: Candidate,
    compiled: bool,
    tiling: bool = True,
    activation_offload: bool = True,
    optimizer: str = "adamw",
) -> list[Options]:
    """The memory options training accepts on ``c`` with ``optimizer`` (optim.name): no offload
    under ZeRO-1 or Muon, offload=optimizer (the host's AdamW) only for AdamW."""
    offloads = (
        ("none",)
        if c.zero_stage == 1 or optimizer == "muon"
        else ("none", "optimizer", "cpu")
        if optimizer == "adamw"
        else ("none", "cpu")
    )
    found = []
    for ac, tiled, act_off, offload in product(
        ("none", "selective", "full"),
        (False, True) if tiling else (False,),
        (False, True) if activation_offload else (False,),
        offloads,
    ):
        if act_off and ac == "selective" and not compiled:
            # refused by checks: eager op-level selective hides its saved tensors from the offload
            continue
        found.append(Options(ac, tiled, act_off, offload))
    return found


def with_options(
    c: Candidate, o: Options, seq_len: int, objective: str = "sft"
) -> Candidate | None:
    """``c`` with the options applied at ``seq_len`` for ``objective`` (train.objective); None where
    tiling cannot cut the tokens a rank holds."""
    tiles = 0
    if o.tiled:
        held = seq_len // c.cp // (c.tp if c.sequence_parallel else 1)
        tiles = held // TILE_TOKENS
        if tiles < 2 or held % tiles:
            return None
    # the tiled loss is refused under PP and with train.objective=dpo; the MLP's is not
    loss_tiles = tiles if c.pp == 1 and objective != "dpo" else 0
    return replace(
        c,
        activation_checkpointing=o.activation_checkpointing,
        ac_every=0,
        tile_mlp=tiles,
        tile_loss=loss_tiles,
        activation_offload=o.activation_offload,
        offload=o.offload,
    )


def _granule(c: Candidate) -> int:
    """Sequence lengths the search steps by: what cp's chunks, SP's split and the tiles all
    divide."""
    return TILE_TOKENS * 2 * c.cp * c.tp


def _largest(fitting, step: int, limit: int) -> tuple[int, Estimate] | None:
    """The largest multiple of ``step`` up to ``limit`` where ``fitting`` gives an estimate (memory
    grows with it)."""
    best = fitting(step)
    if best is None:
        return None
    low, high = 1, limit // step  # in steps: low fits
    while low < high:
        middle = (low + high + 1) // 2
        e = fitting(middle * step)
        if e is not None:
            low, best = middle, e
        else:
            high = middle - 1
    return low * step, best


def longest_sequence(
    work: Workload, c: Candidate, o: Options, cluster: Cluster
) -> tuple[int, Estimate] | None:
    """The longest sequence (a multiple of ``_granule``) that fits with ``o``, and its estimate;
    None if none does."""
    batch = c.dp * c.micro_batch_size * c.microbatches

    def fitting(seq: int) -> Estimate | None:
        candidate = with_options(c, o, seq, work.objective)
        if candidate is None:
            return None
        e = estimate(replace(work, seq_len=seq, global_batch_size=batch), candidate, cluster)
        return e if e.fits else None

    return _largest(fitting, _granule(c), SEQ_LIMIT)


def largest_model(
    work: Workload, c: Candidate, o: Options, cluster: Cluster
) -> tuple[int, Estimate] | None:
    """The most layers (at the config's width and sequence, split evenly over the stages) that fit
    with ``o``."""

    def fitting(layers: int) -> Estimate | None:
        candidate = with_options(c, o, work.seq_len, work.objective)
        if candidate is None:
            return None
        e = estimate(replace(work, shape=replace(work.shape, n_layers=layers)), candidate, cluster)
        return e if e.fits else None

    return _largest(fitting, c.pp, LAYER_LIMIT)


@dataclass(frozen=True)
class Fit:
    """One option set's answer: the most it holds (tokens, or layers) and the estimate there; amount
    0: nothing."""

    options: Options
    amount: int = 0
    estimate: Estimate | None = None
    params: int = 0  # the model's parameters there


def what_fits(
    work: Workload, c: Candidate, cluster: Cluster, compiled: bool
) -> tuple[list[Fit], list[Fit]]:
    """(longest sequence per option set; largest model per offload × checkpointing): the most first,
    then the fastest."""

    def fit(o: Options, found: tuple[int, Estimate] | None, layers: bool = False) -> Fit:
        if found is None:
            return Fit(o)
        shape = replace(work.shape, n_layers=found[0]) if layers else work.shape
        return Fit(o, found[0], found[1], shape.num_params)

    def order(f: Fit) -> tuple[float, float]:
        return (-f.amount, -f.estimate.tokens_per_s_per_gpu) if f.estimate else (0, 0)

    sequences = [
        fit(o, longest_sequence(work, c, o, cluster))
        for o in option_sets(c, compiled, optimizer=work.optimizer)
    ]
    models = [
        fit(o, largest_model(work, c, o, cluster), layers=True)
        for o in option_sets(
            c, compiled, tiling=False, activation_offload=False, optimizer=work.optimizer
        )
    ]
    return sorted(sequences, key=order), sorted(models, key=order)
