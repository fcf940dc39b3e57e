"""Smoke runs of the benchmarks on the CPU with tiny settings, so none of them rots unnoticed; what
they measure is checked by their own output, not timed here. Those whose every check the default
run makes of composer3d itself elsewhere (async checkpointing's losses, the pipeline's idle time
against the planner, checkpointing's and the 8-bit optimizer's bytes) run with ``-m slow``."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import TINY_MOE_EXPERT_PARAMS

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _run(name: str, *args: str, env: dict | None = None) -> str:
    # a smoke test, not a measurement: leave the other core alone; on the CPU (its shapes are the
    # CPU's), with any GPU hidden from the benchmarks that take the accelerator where there is one
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    return proc.stdout


def test_throughput_benchmark_runs_both_sides_on_cpu():
    stdout = _run(
        "throughput.py",
        "--device",
        "cpu",
        "--shape",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "1",
        "--json",
    )
    result = json.loads(stdout)
    assert result["device"] == "cpu" and result["shape"] == "cpu"
    for side in ("composer3d", "plain"):
        r = result[side]
        assert 0 < r["step_time_s_min"] <= r["step_time_s_median"], r
        assert r["tokens_per_s"] > 0 and r["tflops_per_s"] > 0, r
        # no known peak, no allocator stats on the CPU
        assert r["mfu"] is None and r["peak_mem_bytes"] is None, r
    assert math.isfinite(result["ratio_step_time"]) and result["ratio_step_time"] > 0


def test_step_profile_groups_the_step_by_kernel_family():
    """The CPU run exercises the profiler path (host ATen ops stand for the kernels); the GPU's
    kernel names are sorted by the same table, checked here on names cuBLAS, flash, inductor and
    NCCL kernels carry."""
    stdout = _run(
        "step_profile.py",
        "--device",
        "cpu",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--json",
        "memory.activation_checkpointing=full",
    )
    result = json.loads(stdout)
    assert result["device"] == "cpu" and result["activation_checkpointing"] == "full", result
    families = result["families_ms"]
    for fam in ("matmul", "attention", "elementwise", "optimizer"):
        assert families.get(fam, 0) > 0, (fam, families)
    tops = [ms for _, ms in result["top"]]
    assert tops == sorted(tops, reverse=True) and sum(tops) <= result["kernel_ms"] + 1e-6, result
    # no known peak for the CPU
    assert result["matmul_tflops"] > 0 and result["mfu"] is None, result
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from step_profile import family
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert (
        family(
            "void "
            "cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>"
        )
        == "matmul"
    )
    assert (
        family(
            "void "
            "pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>"
        )
        == "attention"
    )
    assert (
        family("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    )
    assert family("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled"
    assert (
        family("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")
        == "communication"
    )
    assert (
        family(
            "void at::native::(anonymous "
            "namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>"
        )
        == "optimizer"
    )
    assert family("Memcpy DtoD (Device -> Device)") == "copy"


@pytest.mark.slow
def test_pipeline_bubble_benchmark_measures_each_schedule():
    stdout = _run(
        "pipeline_bubble.py",
        "--dim",
        "64",
        "--layers",
        "4",
        "--steps",
        "1",
        "--schedules",
        "1f1b",
        "zbv",
        "--device",
        "cpu",
    )
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] in (["1f1b"], ["zbv"])]
    assert [row[0] for row in rows] == ["1f1b", "zbv"], stdout
    assert all(0 <= float(value) < 1 for row in rows for value in row[3:5]), (
        "idle fractions per rank"
    )


@pytest.mark.slow
def test_checkpoint_blocking_benchmark_compares_sync_and_async():
    stdout = _run(
        "checkpoint_blocking.py", "--dim", "64", "--layers", "2", "--steps", "4", "--device", "cpu"
    )
    assert "async / sync blocking ratio" in stdout, stdout


@pytest.mark.slow
def test_memory_compile_benchmark_measures_each_switch():
    # Dynamo off: torch.compile (the blocks', torchao's 8-bit step) runs eagerly, or compiling alone
    # would take minutes on the CPU; compile itself is tested by test_memory_precision. Every
    # measurement still runs.
    stdout = _run(
        "memory_compile.py",
        "--models",
        "tiny",
        "--same-process",
        "--steps",
        "1",
        env={"TORCHDYNAMO_DISABLE": "1"},
    )
    activations = [
        float(line.split()[-2]) for line in stdout.splitlines() if "peak activations" in line
    ]
    # none > op > full
    assert len(activations) == 4 and activations[0] > activations[1] > activations[3], stdout
    state = [float(line.split()[-2]) for line in stdout.splitlines() if "model state" in line]
    assert len(state) == 2 and state[1] < 0.8 * state[0], stdout  # adamw_8bit's state is smaller
    times = [line for line in stdout.splitlines() if "step time, checkpointing" in line]
    assert len(times) == 3 and all("eager" in line and "compiled" in line for line in times), stdout


def test_activation_policies_benchmark_prints_each_policy():
    stdout = _run("activation_policies.py", "--models", "tiny", "--same-process", "--steps", "1")
    rows = {
        line[:30].strip(): line[30:].split()
        for line in stdout.splitlines()
        if line.startswith("  ")
    }
    peak = {name: float(row[0]) for name, row in rows.items() if name != "policy"}
    kept = {name: float(row[1]) for name, row in rows.items() if name != "policy"}
    assert list(peak) == ["none", "selective all_matmuls", "selective alternate_matmuls", "full"], (
        stdout
    )
    for memory in (peak, kept):
        assert (
            memory["none"]
            > memory["selective all_matmuls"]
            > memory["selective alternate_matmuls"]
            > memory["full"]
        ), memory
    # kept after forward: the outputs of wk, wo and w3 (32 + 64 + 192 wide) of 2 blocks over 8 × 128
    # tokens in fp32, 2.25 MiB (at the peak, in backward, the policies differ in what they recompute
    # too)
    assert kept["selective all_matmuls"] - kept["selective alternate_matmuls"] == pytest.approx(
        2.25, abs=0.002
    )
    assert all(
        float(row[2]) > 0 and row[3:] == ["-", "-"]
        for name, row in rows.items()
        if name != "policy"
    ), rows


def test_loss_impl_benchmark_times_each_implementation_on_the_same_loss():
    # Dynamo off: the compiled rows run their kernels eagerly (compile is tested by
    # test_loss_and_checkpoint_policies)
    stdout = _run(
        "loss_impl.py",
        "--tokens",
        "64",
        "--dim",
        "16",
        "--vocab",
        "256",
        "--steps",
        "1",
        "--fused-rows",
        "16",
        env={"TORCHDYNAMO_DISABLE": "1"},
    )
    rows = {line[:36].strip(): line[36:].split() for line in stdout.splitlines()[2:]}
    # the default chunk (2**25 elements) holds all 64 tokens' logits; 16 rows make four chunks
    assert list(rows) == [
        "log_softmax (reference)",
        "chunked, eager",
        "chunked, compiled kernels",
        "fused, eager, 64 rows",
        "fused, compiled, 64 rows",
        "fused, compiled, 16 rows",
    ], stdout
    assert all(
        float(ms) > 0 and abs(float(diff)) < 1e-3 and 0 <= float(grad_diff) < 1e-5 and peak == "-"
        for ms, diff, grad_diff, peak in rows.values()
    ), rows  # fp32 on the CPU


def test_hf_loading_benchmark_reads_a_share_per_rank():
    stdout = _run(
        "hf_loading.py", "--hidden", "256", "--layers", "2", "--vocab", "512", "--worlds", "2"
    )
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| 2 |")]
    # each of 2 FSDP ranks reads half
    assert len(rows) == 1 and rows[0][1].strip() == "50.0%", stdout


def test_data_prepare_benchmark_prepares_and_serves_both_paths():
    # one worker: a pool's process start-up would dominate a corpus this small (the pool is tested
    # by test_prepared_data); both paths served in this process
    stdout = _run(
        "data_prepare.py",
        "--size-mb",
        "0.2",
        "--workers",
        "1",
        "--vocab",
        "600",
        "--seq-len",
        "64",
        "--batch",
        "4",
        "--same-process",
    )
    prepare = [line.split("|") for line in stdout.splitlines() if line.startswith("| 1 |")]
    assert len(prepare) == 1 and float(prepare[0][3].replace(",", "")) > 0, stdout  # tokens/s
    served = {
        line.split("|")[1].split()[0]: line.split("|")[2:5]
        for line in stdout.splitlines()
        if line.startswith(("| prepared", "| in memory"))
    }
    assert set(served) == {"prepared", "in"}, stdout
    assert all(float(value.replace(",", "")) >= 0 for row in served.values() for value in row), (
        stdout
    )


def test_moe_dispatch_benchmark_counts_rows_and_balances_load():
    result = json.loads(
        _run(
            "moe_dispatch.py",
            "--ep",
            "1",
            "2",
            "--tokens",
            "256",
            "--dim",
            "32",
            "--hidden",
            "32",
            "--steps",
            "12",
            "--json",
        )
    )
    one, two = result["results"]["1"], result["results"]["2"]
    assert one["rows_sent_per_step"] == 0 and two["rows_sent_per_step"] > 0
    # the measured rows are a skewed router's; a uniform one would send tokens × top_k × (ep-1)/ep
    # each way
    assert 0.3 < two["rows_sent_per_step"] / two["rows_uniform_router"] < 1.7, two
    for r in (one, two):
        # tokens sharing a direction: an unbalanced router at first
        assert r["load_max_init"] > 1.5, r
        assert r["load_max_last"] < r["load_max_init"], r  # the bias update evens the load out


def test_offload_optimizer_benchmark_times_each_host_step():
    stdout = _run(
        "offload_optimizer.py",
        "--params",
        "1e5",
        "--tensors",
        "2",
        "--steps",
        "1",
        "--device",
        "cpu",
    )
    rows = [line for line in stdout.splitlines() if " step " in line]
    assert [row.split(" step ")[0].strip() for row in rows] == [
        "host fused AdamW (offload=optimizer)",
        "host foreach AdamW",
        "host fused AdamW, state in files (offload_dir)",
    ]
    assert all(float(row.split()[-2]) > 0 for row in rows), stdout  # GB/s


def test_activation_offload_benchmark_moves_activations():
    stdout = _run("activation_offload.py", "--models", "tiny", "--same-process", "--steps", "1")
    moved = {
        line.split()[1]: float(line.split("offloaded")[1].split()[0])
        for line in stdout.splitlines()
        if "offloaded" in line
    }
    # every saved activation without checkpointing; only each block's input under full checkpointing
    # (8 × 128 × 64 fp32 = 0.25 MiB a block, 2 blocks); no accelerator: no device memory to report
    assert moved["full"] == 0.5 and moved["none"] > 10 * moved["full"], stdout
    assert "held for backward - -> -" in stdout, stdout


def test_memory_options_benchmark_shows_each_option_taking_its_bytes():
    stdout = _run(
        "memory_options.py",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--same-process",
        "--options",
        "none",
        "offload=optimizer",
        "tile_loss=4",
        "full ckpt + activation offload",
    )
    rows = {
        line[:34].strip(): [float(x) for x in line[34:].split()[:7]]
        for line in stdout.splitlines()[1:]
        if line[:34].strip()
    }
    # columns: params grads optim activ. temp to-host step
    plain, offloaded, tiled, act_offload = rows.values()
    # masters + moments
    assert plain[5] == 0 and offloaded[5] == pytest.approx(1.5 * plain[2], rel=0.01), rows
    # the loss's logits, in tiles: fewer activations and temporaries at the peak (the whole logits'
    # gradient, written over them, counts as theirs; a tile's, recomputed in backward, as a
    # temporary)
    assert tiled[3] + tiled[4] < plain[3] + plain[4], rows
    # checkpointed, its block inputs moved
    assert act_offload[3] < plain[3] and act_offload[5] > 0, rows


def _virtual_ring(*args: str, env: dict | None = None) -> list[dict]:
    return json.loads(_run("virtual_ring.py", "--json", "--repeats", "0", *args, env=env))["rows"]


def test_virtual_ring_matches_full_attention_on_cpu():
    """Every cp rank's ring blocks, merged, equal fp64 full attention per token and gradient (cp 2
    and 4, causal and packed documents, grouped-query heads, with and without sliding windows
    narrower than a chunk and wider than one), with the CPU's fused kernel and with materialized
    scores."""
    rows = _virtual_ring(
        "--device", "cpu", "--seq", "128", "--kernels", "auto", "materialized",
        "--windows", "0", "10", "40",
    )  # fmt: skip
    assert {(r["cp"], r["mask"], r["window"], tuple(r["kernels"])) for r in rows} == {
        (cp, mask, window, (kernel,))
        for cp in (2, 4)
        for mask in ("causal", "documents")
        for window in (0, 10, 40)
        for kernel in ("cpu_flash", "materialized")
    }
    for row in rows:
        assert max(row["ring_error"].values()) < 1e-5, row


@pytest.mark.accelerator
@pytest.mark.skipif(not torch.cuda.is_available(), reason="checks the CUDA block kernels")
def test_virtual_ring_cuda_kernels_match_full_attention():
    """On CUDA: flash attention as the ring's unmasked blocks in bf16 (materialized scores for the
    blocks a document cuts, and in fp32) equals full attention — fp32 to 1e-4, bf16 within twice the
    error of the device's own SDPA."""
    env = {
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
        "OMP_NUM_THREADS": "4",
    }
    rows = _virtual_ring(
        "--device",
        "cuda",
        "--seq",
        "1024",
        "--head-dim",
        "128",
        "--dtypes",
        "fp32",
        "bf16",
        env=env,
    )
    assert {kernel for row in rows if row["dtype"] == "bf16" for kernel in row["kernels"]} == {
        "cuda_flash",
        "materialized",
    }
    for row in rows:
        for name, error in row["ring_error"].items():
            bound = 1e-4 if row["dtype"] == "fp32" else 2 * row["sdpa_error"][name] + 1e-3
            assert error <= bound, (name, row)


def test_context_parallel_benchmark_attention_memory_falls_as_one_over_cp():
    """The bytes autograd saves in attention per rank halve from cp 2 to cp 4 (cp 1 is the model's
    own SDPA: the ring keeps one more copy of the attention output, +24%); the ring's bytes are the
    planner's count; every rank's output is full attention's at its tokens."""
    rows = json.loads(
        _run(
            "context_parallel.py",
            "--cp",
            "1",
            "2",
            "4",
            "--seq",
            "256",
            "--dim",
            "64",
            "--steps",
            "1",
            "--json",
        )
    )
    saved = {r["cp"]: r["saved_bytes_per_rank"] for r in rows}
    assert saved[4] * 4 == pytest.approx(saved[2] * 2, rel=0.02), saved
    assert saved[2] * 2 < 1.3 * saved[1], saved
    for r in rows:
        assert r["ring_bytes_per_rank"] == r["ring_bytes_predicted"] and (r["cp"] == 1) == (
            r["ring_bytes_per_rank"] == 0
        )
        assert r["max_error"] < 1e-5, r


def test_generate_benchmark_prints_cached_and_recompute_speed():
    stdout = _run(
        "generate.py",
        "--device",
        "cpu",
        "--new-tokens",
        "16",
        "--prompt",
        "8",
        "--no-compile",
        "--json",
    )
    result = json.loads(stdout)
    assert result["device"] == "cpu" and result["new_tokens"] == 16
    assert result["recompute_tokens_per_s"] > 0 and result["cached_tokens_per_s"] > 0, result
    assert result["same_tokens"], result  # the cache changes the speed, not the tokens
    assert result["cache_vs_recompute"] is None, result


def test_generate_benchmark_explains_where_two_paths_part():
    """Where tokens part, the benchmark sets the paths' logit difference beside the reference's
    top-two margin: on the CPU in fp32 the paths agree to rounding, so a forced parting shows a
    difference far below the margin."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from generate import SHAPES, divergence
    finally:
        sys.path.remove(str(BENCHMARKS))
    from composer3d.config.schema import ModelConfig
    from composer3d.models import build_model
    from composer3d.models.init import materialize

    cfg = ModelConfig(name="llama", max_seq_len=32, **SHAPES["cpu"])
    model = build_model(cfg)
    materialize(model, torch.device("cpu"), seed=0)
    model.eval()
    prompt, reference = [5, 17, 3, 99], [7, 8, 9, 10, 11]
    assert (
        divergence(model, prompt, reference, reference, torch.device("cpu"), torch.float32) is None
    )
    parting = divergence(
        model, prompt, reference, [7, 8, 1, 10, 11], torch.device("cpu"), torch.float32
    )
    assert (
        parting["step"] == 2 and parting["logit_difference"] < 1e-4 < parting["top_two_margin"]
    ), parting


def test_zero_traffic_benchmark_counts_the_zero_papers_bytes():
    """ZeRO-1 on 4 gloo ranks with small buckets, in bf16: a reduce-scatter and an all-gather per
    bucket, both bf16 (the parameters gathered in the compute dtype, as FSDP's mixed precision: 2 +
    2 bytes an element), no all-reduce but the gradient norm's one scalar, 2Φ(N−1)/N bytes within
    2%; FSDP's ZeRO-2 moves the same (one micro-batch a step: with more, FSDP gathers and
    reduce-scatters once per micro-batch); and ZeRO-1 under ep 2 (``model=tiny_moe``) 2Φ(N−1)/N
    summed over its two groups: the dense parameters over all 4 ranks, a rank's experts over the 2
    that hold the same ones."""
    stdout = _run(
        "zero_traffic.py",
        "--nproc",
        "4",
        "--steps",
        "2",
        "--modes",
        "zero1",
        "zero2",
        "zero1_ep",
        "--json",
        "--",
        "parallel.zero1_bucket_mb=0.1",
        "precision.param_dtype=bfloat16",
        "precision.reduce_dtype=bfloat16",
    )
    zero1, zero2, zero1_ep = json.loads(stdout.splitlines()[-1])
    experts = TINY_MOE_EXPERT_PARAMS
    assert zero1_ep["groups"] == [[4, zero1_ep["params"] - experts], [2, experts // 2]], zero1_ep[
        "groups"
    ]
    for result in (zero1, zero2, zero1_ep):
        ratio = result["sent_bytes_per_step"] / result["zero_paper_bytes"]
        assert abs(ratio - 1) < 0.02, (result["mode"], ratio, result["collectives"])
    for result in (zero1, zero2):
        assert result["collectives"]["all_reduce"] == {
            "calls_per_step": 1,
            "sent_bytes_per_step": 6.0,
            "buffer_bytes_per_step": 4,
            "dtypes": ["float32"],
        }
    # the MoE's one more: the global batch's expert loads for the balancing bias (3 layers × 8
    # experts, fp32)
    assert zero1_ep["collectives"]["all_reduce"]["buffer_bytes_per_step"] == 4 + 3 * 8 * 4, (
        zero1_ep["collectives"]
    )
    assert zero1_ep["expected_bytes"] == zero1_ep["zero_paper_bytes"]
    collectives = zero1["collectives"]
    assert set(collectives) == {"reduce_scatter", "all_gather", "all_reduce"}, collectives
    # 328 KB of bf16 gradients in 0.1 MiB buckets: each reduce-scattered once, then gathered once
    assert (
        collectives["reduce_scatter"]["calls_per_step"]
        == collectives["all_gather"]["calls_per_step"]
        > 1
    )
    assert (
        collectives["reduce_scatter"]["dtypes"]
        == collectives["all_gather"]["dtypes"]
        == ["bfloat16"]
    )
    assert zero1["expected_bytes"] == zero1["zero_paper_bytes"]


def test_context_parallel_benchmark_prints_the_balances_side_by_side():
    """Packed documents of mean 24 tokens in 512, cp 2 and 4: the busiest rank's counted work (the
    ring's scores) over the mean is above 1.1 under head-tail and within 1.1 under the documents
    placement, printed side by side; every rank's output under either is full attention's with the
    document mask at its tokens."""
    rows = json.loads(
        _run(
            "context_parallel.py",
            "--cp",
            "2",
            "4",
            "--seq",
            "512",
            "--dim",
            "64",
            "--steps",
            "1",
            "--documents",
            "24",
            "--balance",
            "head_tail",
            "documents",
            "--json",
        )
    )
    assert [(r["cp"], r["balance"]) for r in rows] == [
        (2, "head_tail"),
        (2, "documents"),
        (4, "head_tail"),
        (4, "documents"),
    ]
    for head_tail, documents in zip(rows[::2], rows[1::2]):
        assert documents["work_busiest_over_mean"] <= 1.1 < head_tail["work_busiest_over_mean"], (
            head_tail,
            documents,
        )
        assert head_tail["max_error"] < 1e-5 and documents["max_error"] < 1e-5, (
            head_tail,
            documents,
        )


def test_attention_rate_benchmark_times_each_kernel_and_the_block():
    """On the CPU (fp32, small shapes): the flash kernel and SDPA's own pick, unmasked and under a
    dense causal mask, timed for expanded and native GQA at each length with positive rates, cuDNN's
    kernel reported missing, the block timed per token at each length."""
    stdout = _run("attention_rate.py", "--lengths", "32", "64", "--steps", "1")
    kernels = ("flash", "default", "masked")
    rows = [
        line.split() for line in stdout.splitlines() if line.split()[:1] in ([k] for k in kernels)
    ]
    assert [(r[0], r[3], r[4]) for r in rows] == [
        (kernel, gqa, s) for kernel in kernels for gqa in ("expand", "native") for s in ("32", "64")
    ], stdout
    assert all(float(r[5]) > 0 and float(r[7]) > 0 and float(r[9]) > 0 for r in rows), stdout
    assert "cudnn        4   16  expand     32  not available here" in stdout, stdout
    block = [line.split() for line in stdout.splitlines() if line.startswith("  seq ")]
    assert [b[1] for b in block] == ["32", "64"] and all(float(b[2]) > 0 for b in block), stdout


def test_optimizer_step_times_the_clip_apart_and_in_the_step():
    """Every way steps the same parameters alike: the clip's factor is the same, multiplied in one
    and divided by its inverse in the others (the fused kernel's and the compiled graph's)."""
    stdout = _run("optimizer_step.py", "--steps", "2", "--rounds", "2")
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    compiles = [float(part.split()[0]) for part in stdout.split("(its first step compiles)")[1:]]
    ways = [" ".join(row[1:-3]) for row in rows]
    assert (
        ways
        == ["fused, clip apart", "fused, clip in step", "compiled, one graph", "compiled, by block"]
        * 2
    ), stdout
    assert [int(row[-2]) for row in rows[:4]] == [40, 36, 32, 32], (
        "the bytes a parameter each way moves"
    )
    assert len(compiles) == 2 and min(compiles) > 0, stdout
    assert all(float(row[-3]) > 0 and float(row[-1]) > 0 for row in rows), stdout
    assert float(stdout.rsplit("at most", 1)[1].split()[0]) < 1e-6, stdout


def test_memory_peak_replays_the_allocator_trace_to_its_peak_and_refuses_without_one():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import memory_peak
    finally:
        sys.path.remove(str(BENCHMARKS))
    loss = [
        {"filename": "/site/torch/autograd/function.py", "line": 9, "name": "apply"},
        {"filename": "/src/composer3d/training/loss.py", "line": 120, "name": "backward"},
    ]
    engine = []  # the autograd engine's C++ allocates a matmul's gradients: no Python frame
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": loss},
        {"action": "alloc", "addr": 2, "size": 50, "frames": engine},
        {"action": "free_requested", "addr": 1, "size": 100, "frames": loss},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": loss},
        {"action": "alloc", "addr": 3, "size": 120, "frames": loss},
        {"action": "alloc", "addr": 4, "size": 10, "frames": engine},
        {"action": "free_requested", "addr": 3, "size": 120, "frames": loss},
        {"action": "alloc", "addr": 5, "size": 60, "frames": loss},
    ]
    peak, live = memory_peak.replay_to_peak(trace)
    assert peak == 180 and [e["addr"] for e in live] == [
        2,
        3,
        4,
    ]  # 2, 3 and 4 live at once; 5 comes after 3
    assert memory_peak.by_site(live) == [
        ("function.py:9:apply <- loss.py:120:backward", 120, 1),
        ("(no Python frame: the autograd engine's C++)", 60, 2),
    ]
    # the CPU's allocator keeps no trace: one line saying so, exit 2
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "memory_peak.py"), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "keeps no trace" in proc.stderr, proc.stderr


def test_muon_benchmark_moves_the_minimum_and_deals_even_shares():
    """The elements Muon's all-to-alls actually send (counted at torch.distributed) equal the
    minimum for each matrix gathered once and scattered once, under HSDP's replicas and EP's
    stacked experts; each rank's Newton–Schulz work within one matrix of the even share; both
    optimizers train."""
    stdout = _run(
        "muon.py",
        "--steps",
        "3",
        "--lrs",
        "0.01",
        "--traffic-steps",
        "1",
        "--layouts",
        "hsdp2x2",
        "ep2_fsdp4_moe",
        "--json",
    )
    result = json.loads(stdout.splitlines()[-1])  # after the runs' logs
    assert [r["run"] for r in result["convergence"]] == ["adamw lr 0.01", "muon lr 0.01"]
    assert all(r["steps"] == 3 and r["last_loss"] < 6.0 for r in result["convergence"]), result
    assert [r["layout"] for r in result["traffic"]] == ["hsdp2x2", "ep2_fsdp4_moe"]
    for r in result["traffic"]:
        assert r["moved_per_step"] == r["minimum_per_step"] > 0, r
        # the largest matrix of either model: 192 × 64 (tiny's MLP), 5 steps
        largest = 5 * (4 * 64 * 64 * 192 + 2 * 64**3) / 1e9
        assert all(f <= e + largest for f, e in zip(r["gflop_per_rank"], r["even_gflop"])), r
