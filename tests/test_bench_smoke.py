"""``python bench/run_all.py --quick`` runs every benchmark end to end (a smoke test: the
numbers of a quick run are not checked, only that every section and plot is produced)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = (
    "## 1. Bucket layout",
    "## 2. Step time",
    "## 3. Memory per device",
    "## 4. Memory per device on 8 x H100",
    "## 5. Communication per step",
    "## 6. Numerics vs N",
    "## 7. Compile time vs parameter leaves",
    "## 8. Scaling vs device count and model size",
    "## 9. Gradient-accumulation fusion",
    "## 10. ZeRO-3 against GSPMD FSDP",
    "## 11. Traffic and peak against GSPMD peers",
    "## 12. Host time per step",
    "## 13. GPU: `bench/bench_gpu.py`",
    "## 14. Planning figures for clusters (predicted)",
    "## 15. Hierarchical data parallelism on 8 x H100, compile-only",
    "## 16. Adam's moments in bfloat16",
    "## 17. Exposed communication",
    "## 18. Stage 3 at one rank on one H100, compile-only",
)


def _load_bench(name):
    """``bench/<name>.py`` as a module (``bench/`` on ``sys.path`` for its ``_harness``)."""
    import importlib.util

    if f"{ROOT}/bench" not in sys.path:
        sys.path.append(f"{ROOT}/bench")
    spec = importlib.util.spec_from_file_location(name, f"{ROOT}/bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_bench(script, *args, xla_flags=None):
    """Run ``bench/<script>`` in a clean jax environment (the suite's XLA_FLAGS dropped) and
    assert that it succeeded."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_run_all_quick(tmp_path):
    out = tmp_path / "BENCHMARKS.md"
    _run_bench("run_all.py", "--quick", "--out", str(out), "--plots", str(tmp_path))
    text = out.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
    for png in ("numerics_vs_n.png", "scaling.png"):
        assert (tmp_path / png).stat().st_size > 1000, png


def test_bench_gpu_tiny_writes_its_section(tmp_path):
    """``bench/bench_gpu.py --tiny`` (the GPU command's script check on the CPU): every
    chosen variant runs (``--bare-again``: the bare step timed once more after the jaxdp
    rows), the main job runs with ``--main-job-set`` passed to ``jaxdp-train --set`` and
    ``--main-job-profile`` to its ``--profile`` (the meter's line follows its row), the
    caller's own ``XLA_FLAGS`` are named, and ``--write`` replaces only the marked block of a
    BENCHMARKS.md."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# x\n\n<!-- bench_gpu:start -->\nold\n<!-- bench_gpu:end -->\n\ntail\n")
    args = ["--tiny", "--stages", "3", "--accum", "4", "--bare-again", "--write", str(out)]
    args += ["--main-job", "2", "--main-job-set", "gradient_accumulation_fusion=true"]
    args += ["--main-job-profile", "1"]
    flags = "--xla_force_host_platform_device_count=2"
    _run_bench("bench_gpu.py", *args, xla_flags=flags)
    text = out.read_text()
    assert "old" not in text and text.startswith("# x") and text.rstrip().endswith("tail")
    for variant in (
        "bare jit, 1 device, G = 4 |",
        "jaxdp stage 3, G = 4, 2 devices",
        "bare jit, 1 device, G = 4, again |",
        "fused=True",
        f"the caller's own: {flags}",
        "--steps 2 --set gradient_accumulation_fusion=true --profile 1`",
        "Exposed communication (`--profile`, median of 1 traced steps)",
        "cpu in 1 process(es)",  # the main job's row: it ran
    ):
        assert variant in text, variant


def test_only_one_section_is_replaced():
    """``run_all.py --only compile`` measures section 7 alone and splices it into the existing
    file (``bench/_harness.py``'s ``splice_section``; its docstring is the example, run here)."""
    import doctest

    result = doctest.testmod(_load_bench("_harness"))
    assert result.attempted >= 3 and result.failed == 0


def test_compile_peers_measure():
    """The like-for-like peers of BENCHMARKS §7's reading (``bench_compile.py --one``): plain
    ``jit`` returning its gradient norm, and the GSPMD ZeRO-1 peer that also does."""
    for variant in ("plain+norm", "zero1+norm"):
        _run_bench("bench_compile.py", "--one", "cpu", "2", variant)


def test_gpu_fusion_kernels_tiny():
    """``bench/gpu_fusion_kernels.py --tiny``: every variant of the per-kernel fusion probe (the
    kernels lifted ahead of the loop, as before ``3544347``, among them) compiles and runs."""
    _run_bench("gpu_fusion_kernels.py", "--tiny")


def test_gpu_kernels_tiny(h100):
    """``bench/gpu_kernels.py`` on a one-layer GPT: a jaxdp step compiles for a compile-only
    H100 with XLA's dumps on, and its kernels are read from the PTX (``h100``: a skip without
    the gpu-aot extra)."""
    _run_bench("gpu_kernels.py", "--layers", "1", "--width", "64", "--variants", "stage1")


def test_instruction_counts_are_read_and_tabled():
    """``bench_compile``'s instruction table: callgrind's count read from its report, each
    stage over plain ``jit`` judged against the goal, "-" where a variant was not counted;
    outside callgrind the counted block runs as it is."""
    bench_compile = _load_bench("bench_compile")
    log = "==77== Events    : Ir\n==77== Collected : 13093419319\n==77==\n"
    assert bench_compile.collected(log) == 13093419319.0
    assert bench_compile.collected("no report") is None
    with bench_compile._counted():
        ran = True
    assert ran
    full = {"target": "h100", "leaves": 100, "plain": 10.0, "plain+norm": 12.5}
    full.update({"zero1+norm": 12.0, "stage0": 11.0, "stage1": 14.0})
    full.update({"stage0_ratio": 1.1, "stage1_ratio": 1.4})
    part = {"target": "cpu", "leaves": 10, "plain": 2.0, "stage1": 2.4, "stage1_ratio": 1.2}
    text = bench_compile.markdown(
        {"rows": [], "rounds": 1, "big_rounds": 1, "instructions": [full, part]}
    )
    assert "| H100 x 8 (compile-only) | 100 | 10.00 | 12.50 | 12.00 | 11.00 (1.10x) " in text
    assert "| 14.00 (1.40x) | <= 1.3x: met / not met |" in text
    assert "| CPU (8 simulated devices) | 10 | 2.00 | - | - | - | 2.40 (1.20x) " in text
    assert "<= 1.3x: - / met |" in text


def test_xla_timers_are_read():
    """``bench_compile.xla_seconds`` splits a step's compile from XLA's own timer lines: passes
    of the step module only, nested pipelines counted through their passes, the partitioner's,
    the fusion passes and the rest apart, and the two per-module totals."""
    bench_compile = _load_bench("bench_compile")
    log = "\n".join(
        [
            "I0 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit_init: opt",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 9 s (9 s)",
            "I0 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit__step_fn: a",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: shardy-xla time: 1.5 s (1.5 s)",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: spmd-partitioning time: 500 ms (500 ms)",
            "I0 hlo_pass_pipeline.cc:303] Running HLO pass pipeline on module jit__step_fn: b",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: priority-fusion time: 2 s (2 s)",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: algsimp time: 250 us (250 us)",
            "I0 hlo_pass_pipeline.cc:176] HLO pass: b time: 2.1 s (2.1 s)",
            "I0 gpu_compiler.cc:2152] GpuCompiler::RunHloPasses for jit__step_fn time: 4.3 s "
            "(4300000 us) (cumulative: 4.4 s, max: 4.3 s, #called: 2)",
            "I0 gpu_compiler.cc:2817] GpuCompiler::RunBackend for jit__step_fn time: 700 ms "
            "(700000 us)",
            "I0 cpu_compiler.cc:2094] Compiling [jit_other] for CPU using JIT time: 3 s (3 s)",
        ]
    )
    got = bench_compile.xla_seconds(log)
    assert got == pytest.approx(
        {
            "xla_partition": 2.0,
            "xla_fusion": 2.0,
            "xla_other": 250e-6,
            "xla_backend": 0.7,
            "xla_hlo": 4.3,
        }
    ), got
    cpu = bench_compile.xla_seconds(log.replace("jit__step_fn", "jit_x").replace("other", "step"))
    assert cpu["xla_backend"] == 3.0 and cpu["xla_partition"] == 0.0, cpu


def test_cluster_reader_splits_collectives_by_level():
    """bench_cluster's reader: each collective's full bytes and replica-group size, in the
    three replica-group forms of XLA's text, and the level it belongs to on 2 nodes x 4."""
    bench = _load_bench("bench_cluster")
    text = """HloModule m, entry_computation_layout={()->()}

ENTRY %main (p: bf16[800]) -> bf16[800] {
  %p = bf16[800]{0} parameter(0)
  %rs = (bf16[800]{0}, bf16[100]{0}) reduce-scatter-start(%p), replica_groups={{0,1,2,3,4,5,6,7}}
  %rsd = bf16[100]{0} reduce-scatter-done(%rs)
  %in = ((bf16[800]{0}), bf16[200]{0}) reduce-scatter-start(%p), replica_groups=[2,4]<=[8]
  %ind = bf16[200]{0} reduce-scatter-done(%in)
  %q = f32[256]{0} parameter(1)
  %ar = (f32[256]{0}, f32[256]{0}) all-reduce-start(%q), replica_groups=[4,2]<=[2,4]T(1,0)
  %ag = ((bf16[100]{0}), bf16[800]{0}) all-gather-start(%rsd), replica_groups=mesh['axis_0'=8]
  ROOT %agd = bf16[800]{0} all-gather-done(%ag)
}
"""
    got = bench.collectives_of(text, 8)
    assert [(k, b, n) for k, b, n, _ in got] == [
        ("reduce-scatter", 1600, 8),
        ("reduce-scatter", 1600, 4),
        ("all-reduce", 1024, 2),  # one rank per node: the outer level
        ("all-gather", 1600, 8),
    ]
    levels = bench.levels_of_program(text, 8, 4)
    assert levels == {
        "flat": [("reduce-scatter", 1600), ("all-gather", 1600)],
        "inner": [("reduce-scatter", 1600)],
        "outer": [("all-reduce", 1024)],
    }
    assert bench.group_size("channel_id=1", 16) == 16


def test_peak_buffers_read_xla_dump(tmp_path):
    """``bench_memory_gpu.peak_buffers``: the temporaries' values summed over their live ranges;
    a gathered param is an all-gather's output (an async start's ``{1...}``, not its input or
    its tuple of pointers); ``None`` without the dump's files."""
    bench = _load_bench("bench_memory_gpu")
    assert bench.peak_buffers(str(tmp_path)) is None
    (tmp_path / "m.x_after_optimizations-buffer-assignment.txt").write_text(
        "allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:\n"
        " value: <0 p @0> (size=8,offset=0): f32[2]{0}\n"
        "allocation 1: size 300, preallocated-temp:\n"
        " value: <1 all-gather-start{} @0> (size=16,offset=0): (bf16[4]{0}, bf16[32]{0})\n"
        " value: <2 all-gather-start{0} @0> (size=8,offset=16): bf16[4]{0}\n"
        " value: <3 all-gather-start{1} @0> (size=64,offset=24): bf16[32]{0}\n"
        " value: <4 fusion @0> (size=100,offset=88): f32[25]{0}\n"
        " value: <5 param{2} (phi) @0> (size=50,offset=188): f32[12]{0}\n"
        " value: <6 all-gather.1 @0> (size=40,offset=0): bf16[20]{0}\n"
    )
    (tmp_path / "m.x_after_optimizations-live-range.txt").write_text(
        "HloLiveRange (max 5):\n  InstructionSequence:\n    0:all-gather-start\n"
        "    1:fusion\n    2:all-gather-done\n    3:dot\n    4:all-gather.1\n    5:dot.1\n"
        "  BufferLiveRange:\n    all-gather-start{}:0-2\n    all-gather-start{0}:0-2\n"
        "    all-gather-start{1}:0-3\n    fusion{}:1-2\n    param{2}:0-3\n"
        "    all-gather.1{}:4-5\n"
    )
    got = bench.peak_buffers(str(tmp_path))
    assert got == {"live": 238, "at": "fusion", "gathered": [64], "most_gathered": 64}, got
