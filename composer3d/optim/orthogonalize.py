"""Newton–Schulz orthogonalization, each matrix on exactly one rank of those that hold its shards.

Muon's update is the orthogonal factor of a matrix's momentum, which needs the whole matrix, and
under FSDP, TP, EP (and HSDP's replicas) no rank holds one. So every matrix (a 2-D parameter, or
one expert of a stacked ``[experts, out, in]`` parameter) gets one owner among the ranks of its
parameter's device mesh: the shards travel to the owner (one all-to-all per bucket of matrices),
the owner orthogonalizes it, and each holder gets its own piece of the result back (a second
all-to-all). Each distinct shard leaves one rank once (a replica does not send what another
sends); each piece of the result goes once to every other rank that holds it. Owners are dealt
greedily by Newton–Schulz work, so each rank does close to an even share. Every bucket's gather
starts at once, and a bucket's scatter runs while the next bucket is orthogonalized.

Where each rank's shard lies in the whole matrix is DTensor's own arithmetic
(``_compute_local_shape_and_global_offset``, for every coordinate of the mesh), checked when the
plan is made: the distinct shards of each matrix must tile it exactly, so a placement the plan
cannot place (a partial sum, say) is refused there rather than orthogonalized wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

# Keller Jordan's quintic iteration: steep near 0, so 5 steps take every singular value into
# about [0.7, 1.2] (Muon, and Moonlight after it, use these)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(matrices: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Approximately UVᵀ of each ``U Σ Vᵀ`` in ``matrices`` (over the last two dims), computed in
    and returned in ``dtype``."""
    x = matrices.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # the iteration's products are then min(rows, cols) square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """FLOPs of ``newton_schulz`` on one rows × cols matrix (n = the smaller side, m = the
    larger): per step X Xᵀ (2n²m), its square (2n³) and the product with X (2n²m)."""
    n, m = min(rows, cols), max(rows, cols)
    return steps * (4 * n * n * m + 2 * n**3)


# A piece's place in its matrix: ("rect", r0, r1, c0, c1), a block of rows and columns (a DTensor's
# shard), or ("flat", start, end), a range of the row-major matrix (ZeRO-1's slice of it)
Key = tuple


@dataclass
class _Piece:
    """What one rank holds of one matrix, and where in that rank's local tensor: the whole of it
    (None), one matrix of a local stack (an index), or a range of a flat slice ((a, b))."""

    rank: int  # in the plan's group
    key: Key
    at: int | tuple[int, int] | None

    @property
    def numel(self) -> int:
        return _numel(self.key)


@dataclass
class _Matrix:
    param: int  # index into the orthogonalizer's parameters
    shape: tuple[int, int]
    pieces: list[_Piece]  # every rank's, replicas included
    owner: int = -1
    senders: dict[Key, int] = field(default_factory=dict)  # each distinct piece's sending rank
    mine: _Piece | None = None  # this rank's piece (None: it holds none)


class Orthogonalizer:
    """For each of ``params``, orthogonalizes a tensor laid out as the parameter (its momentum):
    called with each parameter's local tensor, returns each one's local piece of the
    orthogonalized whole, in ``dtype``. A 3-D parameter is a stack of matrices along dim 0, each
    orthogonalized on its own. Every rank of the parameters' meshes calls it together."""

    def __init__(
        self,
        params: list[torch.Tensor],
        steps: int,
        dtype: torch.dtype,
        bucket_bytes: int,
        slices: list[tuple] | None = None,
    ):
        """``slices`` (ZeRO-1): each parameter's process group, the (lo, hi) of its flat local
        tensor each rank of the group holds, and that local tensor's shape; ``params`` are then
        the slices. Otherwise where each shard lies is read from the DTensors' placements."""
        self.steps, self.dtype = steps, dtype
        elements = bucket_bytes // torch.empty((), dtype=dtype).element_size()
        self.plans = []
        if slices is not None:
            by_group: dict[object, list[int]] = {}
            for index, (group, _, _) in enumerate(slices):
                by_group.setdefault(group, []).append(index)
            for group, indices in by_group.items():
                matrices = [m for i in indices for m in _sliced(i, slices[i][2], slices[i][1])]
                self.plans.append(_GroupPlan(group, matrices, steps, elements))
            return
        by_mesh: dict[object, list[int]] = {}
        for index, param in enumerate(params):
            mesh = param.device_mesh if isinstance(param, DTensor) else None
            by_mesh.setdefault(mesh, []).append(index)
        groups = _flat_groups([mesh for mesh in by_mesh if mesh is not None])
        for mesh, indices in by_mesh.items():
            group = groups.get(mesh)
            if group is None:  # a plain tensor, or a mesh of one rank: this rank holds it whole
                coordinates, ranks = [()], [0]
            else:
                flat = mesh.mesh.flatten().tolist()
                coordinates = list(product(*(range(n) for n in mesh.mesh.shape)))
                ranks = [dist.get_group_rank(group, r) for r in flat]
            matrices = [m for i in indices for m in _placed(i, params[i], mesh, coordinates, ranks)]
            self.plans.append(_GroupPlan(group, matrices, steps, elements))

    def __call__(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        results = [torch.empty_like(u, dtype=self.dtype) for u in updates]
        for plan in self.plans:
            plan.run(updates, results, self.steps, self.dtype)
        return results

    def work(self) -> dict[str, int]:
        """This rank's part of a step: the matrices it owns of those its meshes hold, their
        Newton–Schulz FLOPs beside an even share, and the elements it sends and receives."""
        totals: dict[str, int] = {}
        for plan in self.plans:
            for key, value in plan.work(self.steps).items():
                totals[key] = totals.get(key, 0) + value
        return totals


class _GroupPlan:
    """The matrices of the parameters on one group of ranks (a device mesh's, or ZeRO-1's): their
    pieces, owners, senders and buckets, computed alike on every rank of the group."""

    def __init__(self, group, matrices: list[_Matrix], steps: int, bucket_elements: int):
        self.group, self.matrices = group, matrices
        if group is None:
            self.size, self.rank = 1, 0
        else:
            self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        for matrix in matrices:  # a rank holds one block of each parameter: one piece at most
            matrix.mine = next((p for p in matrix.pieces if p.rank == self.rank), None)
        self._deal(steps)
        self.buckets: list[list[_Matrix]] = [[]]
        size = 0
        for matrix in self.matrices:
            numel = matrix.shape[0] * matrix.shape[1]
            if self.buckets[-1] and size + numel > bucket_elements:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(matrix)
            size += numel

    def _deal(self, steps: int) -> None:
        """Owners by work, largest first, each to the least loaded rank (a rank holding none of it
        counted a matrix more loaded; of equals, the one holding most of it); each distinct piece
        sent by the owner where it holds it, else by the holder that has sent least."""
        load, sent = [0] * self.size, [0] * self.size
        order = sorted(
            range(len(self.matrices)),
            key=lambda i: (-newton_schulz_flops(*self.matrices[i].shape, steps), i),
        )
        for i in order:
            matrix = self.matrices[i]
            held = [0] * self.size
            for piece in matrix.pieces:
                held[piece.rank] += piece.numel
            # a rank holding none of it is charged its work once more: a holder is chosen unless
            # that leaves the ranks a whole matrix further from even
            work = newton_schulz_flops(*matrix.shape, steps)
            matrix.owner = min(
                range(self.size),
                key=lambda r: (load[r] + (0 if held[r] else work), -held[r], r),
            )
            load[matrix.owner] += work
            holders: dict[Key, list[int]] = {}
            for piece in matrix.pieces:
                holders.setdefault(piece.key, []).append(piece.rank)
            for key, ranks in holders.items():
                sender = (
                    matrix.owner
                    if matrix.owner in ranks
                    else min(ranks, key=lambda r: (sent[r], r))
                )
                matrix.senders[key] = sender
                if sender != matrix.owner:
                    sent[sender] += _numel(key)

    def run(self, updates, results, steps: int, dtype: torch.dtype) -> None:
        if self.size == 1:
            for bucket in self.buckets:
                self._orthogonalize(bucket, updates, {}, results, steps, dtype)
            return
        gathers = [self._gather(bucket, updates, dtype) for bucket in self.buckets]
        scatters = []
        for bucket, gather in zip(self.buckets, gathers):
            received = gather.wait()
            orthogonal = self._orthogonalize(bucket, updates, received, results, steps, dtype)
            scatters.append(self._scatter(bucket, orthogonal, dtype, _device(updates)))
        for bucket, scatter in zip(self.buckets, scatters):
            received = scatter.wait()
            for matrix in bucket:
                piece = matrix.mine
                if piece is not None and matrix.owner != self.rank:
                    _store(results, matrix.param, piece, received[(id(matrix), piece.key)])

    def _gather(self, bucket, updates, dtype) -> _AllToAll:
        """Each distinct piece to its matrix's owner (by its sender), in one all-to-all."""
        exchange = _AllToAll(self.size, dtype, _device(updates))
        for matrix in bucket:
            for key, sender in matrix.senders.items():
                if sender == matrix.owner:
                    continue
                if sender == self.rank:
                    piece = matrix.mine
                    exchange.send(matrix.owner, _cut(updates[matrix.param], piece))
                if matrix.owner == self.rank:
                    exchange.expect(sender, (id(matrix), key), _numel(key))
        return exchange.start(self.group)

    def _orthogonalize(self, bucket, updates, received, results, steps, dtype) -> dict:
        """This rank's matrices assembled and orthogonalized (those of one shape as a batch), its
        own pieces stored into ``results``; returns each owned matrix's result by ``id``."""
        by_shape: dict[tuple[int, int], list[_Matrix]] = {}
        for matrix in bucket:
            if matrix.owner == self.rank:
                by_shape.setdefault(matrix.shape, []).append(matrix)
        orthogonal = {}
        for shape, matrices in by_shape.items():
            whole = torch.empty((len(matrices), *shape), dtype=dtype, device=_device(updates))
            for slot, matrix in zip(whole, matrices):
                for key, sender in matrix.senders.items():
                    if sender == self.rank:
                        block = _cut(updates[matrix.param], matrix.mine)
                    else:
                        block = received[(id(matrix), key)]
                    _region(slot, key).copy_(block.reshape(_region(slot, key).shape))
            for result, matrix in zip(newton_schulz(whole, steps, dtype), matrices):
                orthogonal[id(matrix)] = result
                piece = matrix.mine
                if piece is not None:
                    _store(results, matrix.param, piece, _region(result, piece.key))
        return orthogonal

    def _scatter(self, bucket, orthogonal, dtype, device) -> _AllToAll:
        """Each other holder's piece of each matrix this rank owns, and this rank's pieces of the
        others', in one all-to-all (both sides in bucket order)."""
        exchange = _AllToAll(self.size, dtype, device)
        for matrix in bucket:
            if matrix.owner == self.rank:
                for piece in matrix.pieces:
                    if piece.rank != self.rank:
                        exchange.send(piece.rank, _region(orthogonal[id(matrix)], piece.key))
            else:
                piece = matrix.mine
                if piece is not None:
                    exchange.expect(matrix.owner, (id(matrix), piece.key), piece.numel)
        return exchange.start(self.group)

    def work(self, steps: int) -> dict[str, int]:
        owned = [m for m in self.matrices if m.owner == self.rank]
        total = sum(newton_schulz_flops(*m.shape, steps) for m in self.matrices)
        sent = received = 0
        for m in self.matrices:
            for key, sender in m.senders.items():  # the gather
                if sender != m.owner:
                    sent += _numel(key) * (sender == self.rank)
                    received += _numel(key) * (m.owner == self.rank)
            for piece in m.pieces:  # the scatter
                if piece.rank != m.owner:
                    sent += piece.numel * (m.owner == self.rank)
                    received += piece.numel * (piece.rank == self.rank)
        return {
            "owned": len(owned),
            "matrices": len(self.matrices),
            "flops": sum(newton_schulz_flops(*m.shape, steps) for m in owned),
            "even_flops": total // self.size,
            "sent": sent,
            "received": received,
        }


class _AllToAll:
    """One ``all_to_all_single``: tensors queued per destination, sizes expected per source."""

    def __init__(self, size: int, dtype: torch.dtype, device):
        self.dtype, self.device = dtype, device
        self.outgoing: list[list[torch.Tensor]] = [[] for _ in range(size)]
        self.incoming: list[list[tuple[object, int]]] = [[] for _ in range(size)]

    def send(self, rank: int, tensor: torch.Tensor) -> None:
        self.outgoing[rank].append(tensor.reshape(-1).to(self.dtype))
        self.device = tensor.device

    def expect(self, rank: int, tag, numel: int) -> None:
        self.incoming[rank].append((tag, numel))

    def start(self, group) -> _AllToAll:
        device = self.device or torch.device("cpu")
        flat = [t for ts in self.outgoing for t in ts]
        inputs = torch.cat(flat) if flat else torch.empty(0, dtype=self.dtype, device=device)
        self.output = torch.empty(
            sum(n for tags in self.incoming for _, n in tags), dtype=self.dtype, device=device
        )
        self.work = dist.all_to_all_single(
            self.output,
            inputs,
            output_split_sizes=[sum(n for _, n in tags) for tags in self.incoming],
            input_split_sizes=[sum(t.numel() for t in ts) for ts in self.outgoing],
            group=group,
            async_op=True,
        )
        return self

    def wait(self) -> dict:
        self.work.wait()
        pieces, offset = {}, 0
        for tags in self.incoming:
            for tag, numel in tags:
                pieces[tag] = self.output[offset : offset + numel]
                offset += numel
        return pieces


def _placed(index, param, mesh, coordinates, ranks) -> list[_Matrix]:
    """``param``'s matrices and every rank's block of each, where its DTensor placements put them;
    refused where the distinct blocks do not tile a matrix exactly."""
    shape = tuple(param.shape)
    _check_dims(shape)
    stacked = len(shape) == 3
    pieces: list[list[_Piece]] = [[] for _ in range(shape[0] if stacked else 1)]
    for coordinate, rank in zip(coordinates, ranks):
        if mesh is None:
            local_shape, offset = shape, (0,) * len(shape)
        else:
            local_shape, offset = _compute_local_shape_and_global_offset(
                shape, mesh.mesh.shape, list(coordinate), param.placements
            )
        if 0 in local_shape:
            continue
        key = (
            "rect",
            offset[-2],
            offset[-2] + local_shape[-2],
            offset[-1],
            offset[-1] + local_shape[-1],
        )
        if stacked:
            for local in range(local_shape[0]):
                pieces[offset[0] + local].append(_Piece(rank, key, local))
        else:
            pieces[0].append(_Piece(rank, key, None))
    matrices = []
    for slot, held in enumerate(pieces):
        cover = torch.zeros(shape[-2:], dtype=torch.int32)
        for key in {p.key for p in held}:
            _region(cover, key).add_(1)
        if not bool((cover == 1).all()):
            raise ValueError(
                f"Muon cannot place the shards of a {list(shape)} parameter laid out as "
                f"{getattr(param, 'placements', None)}: they do not tile matrix {slot} exactly"
            )
        matrices.append(_Matrix(index, shape[-2:], held))
    return matrices


def _sliced(index: int, shape: tuple, ranges: list[tuple[int, int]]) -> list[_Matrix]:
    """The matrices of a parameter whose flat local tensor (of ``shape``: every rank of the group
    holds the same) is cut in ranges, one per rank of the group (ZeRO-1's), and each rank's range
    of each."""
    shape = tuple(shape)
    _check_dims(shape)
    rows, cols = shape[-2:]
    size = rows * cols
    matrices = []
    for slot in range(shape[0] if len(shape) == 3 else 1):
        start, end = slot * size, (slot + 1) * size
        held = []
        for rank, (lo, hi) in enumerate(ranges):
            a, b = max(lo, start), min(hi, end)
            if a < b:
                held.append(_Piece(rank, ("flat", a - start, b - start), (a - lo, b - lo)))
        if sum(p.numel for p in held) != size:
            raise ValueError(f"the ranges {ranges} do not cover matrix {slot} of {list(shape)}")
        matrices.append(_Matrix(index, (rows, cols), held))
    return matrices


def _check_dims(shape: tuple) -> None:
    if len(shape) not in (2, 3):
        raise ValueError(f"Muon orthogonalizes 2-D matrices and stacks of them, not {list(shape)}")


def _flat_groups(meshes) -> dict:
    """A process group of each mesh's ranks. Every rank makes every group (torch's ``new_group``
    is collective over the world), also those of meshes it does not hold (a pipeline's other
    stages): the meshes' rank sets are gathered first."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {}
    mine = {tuple(mesh.mesh.flatten().tolist()) for mesh in meshes}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(mine))
    groups = {}
    for ranks in sorted({tuple(r) for theirs in everyone for r in theirs}):
        group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        if ranks in mine:
            groups[ranks] = group
    return {mesh: groups[tuple(mesh.mesh.flatten().tolist())] for mesh in meshes}


def _cut(local: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """This rank's piece in its local tensor (or ZeRO-1's slice)."""
    if piece.at is None:
        return local
    if isinstance(piece.at, int):
        return local[piece.at]
    return local[piece.at[0] : piece.at[1]]


def _store(results, param: int, piece: _Piece, block: torch.Tensor) -> None:
    target = _cut(results[param], piece)
    target.copy_(block.reshape(target.shape))


def _region(matrix: torch.Tensor, key: Key) -> torch.Tensor:
    """The view of ``matrix`` (contiguous, rows × cols) that ``key`` places."""
    if key[0] == "rect":
        _, r0, r1, c0, c1 = key
        return matrix[r0:r1, c0:c1]
    _, start, end = key
    return matrix.reshape(-1)[start:end]  # a view where the matrix is contiguous (assembly)


def _numel(key: Key) -> int:
    if key[0] == "rect":
        _, r0, r1, c0, c1 = key
        return (r1 - r0) * (c1 - c0)
    return key[2] - key[1]


def _device(updates):
    return updates[0].device if updates else None
