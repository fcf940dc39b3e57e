"""Context parallel and the state around it: a cp 4 checkpoint resumes under cp 2 and cp 1 on the
straight curve, and the data position never depends on cp (the cp ranks of one data-parallel rank
read the same batch)."""

import pytest
import torch
import torch.distributed as dist
from harness import FAST, spawn, train_in_one_group
from test_context_parallel import corpus  # noqa: F401  (a fixture: short documents, so masks cut across chunks)

STEPS, SAVE = 10, 5
# cp 4 saves with FSDP over dp_shard × cp (4 shards); the same 4 ranks resume as dp_shard 2 × cp 2
# and dp_shard 4: the parameters, optimizer state and data position are cut anew, and each dp rank
# reads another slice.
RESUMED = {
    "cp2_fsdp2": ["parallel.dp_shard=2", "parallel.cp=2"],
    "cp1_fsdp4": ["parallel.dp_shard=4"],
}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, corpus):  # noqa: F811
    root = tmp_path_factory.mktemp("cp_resume")
    common = [*FAST, *corpus, "data.document_masking=true", f"train.steps={STEPS}"]
    checkpoint = root / "cp4" / "checkpoints" / f"step-{SAVE:08d}"
    jobs = [
        (
            root / "cp4",
            [*common, "parallel.dp_shard=1", "parallel.cp=4", f"checkpoint.interval={SAVE}"],
        )
    ]
    jobs += [
        (root / name, [*common, *layout, f"checkpoint.resume={checkpoint}"])
        for name, layout in RESUMED.items()
    ]
    # one after another: the resumes find the checkpoint
    straight, *runs = train_in_one_group(jobs, nproc=4)
    return straight, dict(zip(RESUMED, runs))


@pytest.mark.parametrize("name", list(RESUMED))
def test_cp4_checkpoint_resumes_under_another_cp_on_the_straight_curve(name, resumed):
    straight, runs = resumed
    run = runs[name]
    assert straight.run_info["layout"]["cp"] == 4 and run.run_info["layout"]["cp"] == (
        2 if "cp2" in name else 1
    )
    assert [m["step"] for m in run.metrics] == list(range(SAVE + 1, STEPS + 1)), (
        "resumed at the saved step"
    )
    diffs = [abs(a - b) for a, b in zip(straight.losses[SAVE:], run.losses)]
    assert len(diffs) == STEPS - SAVE and max(diffs) < 1e-4, f"{name}: per-step |Δloss| {diffs}"
    grads = [
        abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(straight.metrics[SAVE:], run.metrics)
    ]
    assert max(grads) < 1e-3, f"{name}: grad norms differ {grads}"


def _cp_ranks_read_one_batch(rank: int, world: int) -> None:
    from composer3d.data.loader import GlobalBatchLoader
    from composer3d.parallel.mesh import Layout, ParallelMesh

    mesh = ParallelMesh(Layout(dp_shard=2, cp=2), "cpu")
    sequences = torch.arange(32 * 8).reshape(32, 8)  # row i holds 8i..8i+7: a token names its row
    loader = GlobalBatchLoader(
        sequences, global_batch_size=4, dp_rank=mesh.dp_rank, dp_size=mesh.layout.dp, seed=3
    )
    loader.next_batch()
    batch = loader.next_batch()
    rows = batch.inputs[:, 0] // 8

    def gathered(group_mesh):
        out = [torch.empty_like(rows) for _ in range(group_mesh.size())]
        dist.all_gather(out, rows, group=group_mesh.get_group())
        return out

    cp_peers, dp_peers = gathered(mesh["cp"]), gathered(mesh.dp)
    assert all(torch.equal(rows, peer) for peer in cp_peers), f"cp peers read {cp_peers}"
    assert not torch.equal(dp_peers[0], dp_peers[1]), f"dp ranks read {dp_peers}"
    # the position is the whole job's (sequences consumed), so a loader of any other layout goes on
    # from it
    state = loader.state_dict()
    assert state["consumed_sequences"] == 8 and "dp_rank" not in state and "cp" not in str(state)
    alone = GlobalBatchLoader(sequences, global_batch_size=4, dp_rank=0, dp_size=1, seed=3)
    alone.load_state_dict(state)
    following = alone.next_batch().inputs[:, 0] // 8
    loader_next = loader.next_batch().inputs[:, 0] // 8
    slice_ = following[2 * mesh.dp_rank : 2 * mesh.dp_rank + 2]
    assert torch.equal(loader_next, slice_), (loader_next, following)


def test_cp_ranks_of_one_dp_rank_read_the_same_batch(tmp_path):
    spawn(_cp_ranks_read_one_batch, 4, tmp_path)
