"""Device-less compilation for 8 H100s and the schedule report.

The GPU tests need the ``gpu-aot`` extra (jax-cuda12-plugin / jax-cuda12-pjrt at the jaxlib
version) and skip without it. They compile DataParallel steps of an 8-layer MLP for 8
compile-only H100s and read the scheduled GPU program: one collective per bucket (XLA did not
re-combine them), the configured wire dtypes, and backward compute between every bucket
collective's start and done except the last one's.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest
from _hlo import written_concatenations

from jaxdp import DataParallel, DDPConfig, xla_compiler_options
from jaxdp.aot import (
    abstract_batch,
    abstract_state,
    collective_roles,
    compile_step,
    example_mlp,
    gradient_collectives,
    h100_topology,
    schedule_report,
    target_config,
)
from jaxdp.aot.__main__ import main as cli_main

WIDTH, LAYERS = 256, 8
# two layers per bucket (w then b, in reverse order): 4 buckets for 8 layers
BUCKET = 2 * WIDTH * (WIDTH + 1)


@pytest.fixture(scope="module")
def mesh(h100):
    return h100  # conftest.py: 8 compile-only H100s, or a skip


MODES = {
    "bf16": ({}, "bf16"),
    "fp32": ({"grad_reduce_in_fp32": True}, "f32"),
    "megatron": ({"reduce_scatter_with_fp32_accumulation": True}, "bf16"),
}
CASES = [
    (stage, mode, g)
    for stage in (0, 1, 2)
    for mode in MODES
    for g in (1, 4)
    if not (mode == "megatron" and stage == 0)
]


def build(mesh, stage, mode, g, **extra):
    loss_fn, params, batch = example_mlp(LAYERS, WIDTH, batch=64)
    cfg = DDPConfig(
        zero_stage=stage,
        bucket_size=BUCKET,
        param_dtype="bfloat16",
        num_microbatches=g,
        **MODES[mode][0],
        **extra,
    )
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh)
    return dp, params, batch


def grad_kind(stage, mode):
    return "all-reduce" if stage == 0 else "all-to-all" if mode == "megatron" else "reduce-scatter"


@pytest.mark.parametrize(("stage", "mode", "g"), CASES)
def test_one_overlapped_collective_per_bucket(mesh, stage, mode, g):
    dp, params, batch = build(mesh, stage, mode, g)
    compiled = compile_step(dp, params, batch)  # jaxdp.xla_compiler_options
    text = compiled.as_text()
    report = schedule_report(text)
    n = len(dp.layout.buckets)
    assert n == 4
    kind, wire = grad_kind(stage, mode), MODES[mode][1]

    # Bucketed (the all_to_all mode): one collective per bucket per step in the straight-line
    # region (the last micro-batch), none combined: every collective of the gradient kind is
    # exactly one bucket. Per parameter (otherwise; stage 0 all-reduces): XLA's combiner
    # groups the parameters' collectives into groups of at most one bucket.
    # Stage 2 with G > 1 reduce-scatters inside every micro-batch's backward: all of them run
    # in the scan (none peeled out, Kernel.peel_last), so its collectives are the loop body's.
    per_param = dp.plan.strategy.reduces_per_parameter
    assert per_param == (mode != "megatron")
    looped = stage == 2 and g > 1
    entry_grads = gradient_collectives(report, dp)
    in_loop = [c for c in gradient_collectives(report, dp, entry_only=False) if not c.entry]
    grads, elsewhere = (in_loop, entry_grads) if looped else (entry_grads, in_loop)
    assert not elsewhere, report
    assert len(grads) >= n if per_param else len(grads) == n, report
    assert all(c.kind == kind and c.is_async and c.dtype == wire for c in grads), report
    big = [c for c in report.of_kind(kind) if c.elements > max(b.numel for b in dp.layout.buckets)]
    assert not big, f"XLA combined buckets:\n{report}"

    # Overlap: every bucket's collective except the last has backward compute (GEMMs of the
    # backward pass) scheduled between its start and its done.
    for c in grads[:-1]:
        assert c.backward_between >= 1 and c.gemms_between >= 1, report

    if g > 1:
        # the micro-batches stay in a loop (at stages 0-1 all but the last, whose overlapped
        # backward is in ENTRY)
        entry = text[text.index("\nENTRY") :]
        assert re.search(r" while\(", entry), "the micro-batch scan was unrolled"

    if stage >= 1:  # params come back in bf16 all-gathers, at least one per bucket, none bigger
        ags = [c for c, r in zip(report.collectives, collective_roles(report, dp)) if "param" in r]
        assert len(ags) >= n if per_param else len(ags) == n, report
        assert {c.dtype for c in ags} == {"bf16"}, report
        assert len(report.of_kind("all-gather")) == len(ags), report


@pytest.mark.parametrize("stage", [0, 1])
def test_xla_defaults_merge_the_buckets(mesh, stage):
    """Why the flags exist: with XLA's default 30 MiB thresholds the four buckets are combined
    into one collective at the end of the backward pass, which overlaps no backward GEMM."""
    dp, params, batch = build(mesh, stage, "bf16", 1)
    report = schedule_report(compile_step(dp, params, batch, compiler_options=None))
    assert len(gradient_collectives(report, dp)) == 0
    kind = grad_kind(stage, "bf16")
    merged = [c for c in report.of_kind(kind) if c.elements >= 4 * BUCKET]
    assert len(merged) == 1 and merged[0].gemms_between == 0, report


@pytest.mark.parametrize("stage", [0, 1])
def test_engine_compiler_options_keep_the_buckets_apart(mesh, stage):
    """DataParallel(compiler_options="jaxdp") compiles its own step (dp.step.lower().compile(),
    no options at compile time) with jaxdp's settings on a GPU mesh: the same collectives as
    compile_step's default, where XLA's defaults merge the buckets (test above)."""
    dp, params, batch = build(mesh, stage, "bf16", 1)
    own = DataParallel(dp.loss_fn, dp.optimizer, dp.config, mesh=mesh, compiler_options="jaxdp")
    assert own.compiler_options == xla_compiler_options(dp.config, dp_size=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        state = abstract_state(own, params, batch)
        lowered = own.step.lower(state, abstract_batch(own, batch))
    mine = schedule_report(lowered.compile())
    ref = schedule_report(compile_step(dp, params, batch))  # builds dp's layout too
    shape = lambda r: [(c.kind, c.dtype, c.elements) for c in r.collectives]  # noqa: E731
    assert shape(mine) == shape(ref), (mine, ref)
    assert len(gradient_collectives(mine, own)) >= len(dp.layout.buckets), mine


def test_topology_devices(mesh):
    devs = h100_topology(8)
    assert len(devs) == 8 and {d.device_kind for d in devs} == {"NVIDIA H100 80GB HBM3"}
    assert devs[0].client.runtime_type == "compile_only_runtime"
    two = h100_topology(4, hosts=2)
    assert [d.process_index for d in two] == [0] * 4 + [1] * 4
    assert mesh.shape["data"] == 8 and mesh.axis_names == ("data",)


def test_abstract_state_carries_the_engine_shardings(mesh):
    dp, params, batch = build(mesh, 1, "fp32", 1)
    state = abstract_state(dp, params)
    leaf = state.master["layer00"]["w"]
    assert leaf.shape == (WIDTH * WIDTH,) and leaf.sharding.spec == jax.sharding.PartitionSpec(
        "data"
    )
    assert state.params["layer00"]["w"].dtype == jnp.bfloat16
    assert state.params["layer00"]["w"].sharding.spec == jax.sharding.PartitionSpec()
    b = abstract_batch(dp, batch)
    assert b["x"].sharding.mesh.devices.flat[0].device_kind == "NVIDIA H100 80GB HBM3"


def test_cli_prints_the_table(mesh, tmp_path, capsys):
    hlo = tmp_path / "step.hlo"
    rc = cli_main(["--stage", "1", "--grad-reduce-in-fp32", "--width", "128", "--hlo", str(hlo)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "reduce-scatter" in out and "grad group" in out and "f32" in out
    # per-parameter reduce-scatters, grouped by XLA: at least one group per bucket, and at least
    # as many overlapped as one-per-bucket gave (all but the last)
    m = re.search(r"gradient collectives in ENTRY: (\d+) for 4 buckets; (\d+) overlap", out)
    assert m and int(m.group(1)) >= 4 and int(m.group(2)) >= 3, out
    assert "--xla_gpu_reduce_scatter_combine_threshold_bytes=" in out
    assert hlo.read_text().startswith("HloModule")


# ------------------------------------------------------------------ no plugin needed
def test_target_config_holds_the_h100_facts():
    text = target_config()
    for fact in (
        "core_count: 132",
        "major: 9",
        "shared_memory_per_core: 233472",
        "memory_bandwidth: 3350000000000",
        "device_memory_size: 85899345920",
        'platform_name: "CUDA"',
    ):
        assert fact in text
    with pytest.raises(ValueError, match="name='a100'"):
        target_config("a100")


def test_topology_arguments_are_checked():
    with pytest.raises(ValueError, match="n=0"):
        h100_topology(0)
    with pytest.raises(ValueError, match="hosts=True"):
        h100_topology(8, hosts=True)


def test_compile_step_arguments_are_checked():
    with pytest.raises(TypeError, match="dp is a str"):
        compile_step("engine", {}, {})  # type: ignore[arg-type]
    dp = DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1), DDPConfig())
    with pytest.raises(ValueError, match="compiler_options='fast'"):
        compile_step(
            dp, {"w": jnp.zeros((4, 1))}, {"x": jnp.zeros((8, 4))}, compiler_options="fast"
        )


SCHEDULED = """HloModule jit_step, is_scheduled=true, entry_computation_layout={()->()}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%a2a_body (p: bf16[8,16]) -> bf16[8,16] {
  %p = bf16[8,16]{1,0} parameter(0)
  ROOT %x = bf16[8,16]{1,0} all-to-all(%p), dimensions={0}
}

ENTRY %main (g0: f32[64], g1: f32[64], h: bf16[8,16]) -> f32[8] {
  %g0 = f32[64]{0} parameter(0)
  %g1 = f32[64]{0} parameter(1)
  %h = bf16[8,16]{1,0} parameter(2)
  %rs = ((f32[64]{0}, f32[64]{0}), (f32[8]{0}, f32[8]{0})) reduce-scatter-start(%g0, %g1), \
dimensions={0}, to_apply=%add
  %gemm = f32[8,8]{1,0} custom-call(%g0), custom_call_target="__cublas$gemm", \
metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %fus = f32[8]{0} fusion(%g1), kind=kLoop, calls=%add, metadata={op_name="jit(step)/mul"}
  %rsd = (f32[8]{0}, f32[8]{0}) reduce-scatter-done(%rs)
  %as = ((bf16[8,16]{1,0}), bf16[8,16]{1,0}) async-start(%h), calls=%a2a_body
  %ad = bf16[8,16]{1,0} async-done(%as)
  ROOT %ar = f32[8]{0} all-reduce(%fus), to_apply=%add
}
"""


def test_report_parses_combined_generic_and_sync_collectives():
    r = schedule_report(SCHEDULED)
    assert r.module == "jit_step"
    rs, a2a, ar = r.collectives
    assert (rs.kind, rs.is_async, rs.operands, rs.elements, rs.bytes) == (
        "reduce-scatter",
        True,
        2,
        128,
        512,
    )
    assert (rs.compute_between, rs.gemms_between, rs.backward_between) == (2, 1, 1)
    assert (a2a.kind, a2a.is_async, a2a.dtype, a2a.compute_between) == (
        "all-to-all",
        True,
        "bf16",
        0,
    )
    assert (ar.kind, ar.is_async, ar.compute_between) == ("all-reduce", False, 0)
    assert r.async_collectives == (rs, a2a) and r.sync_collectives == (ar,)
    assert r.of_kind("all-reduce") == (ar,)
    assert "reduce-scatter" in str(r) and len(r.rows()) == 3
    assert r.table(roles=["a", "b", "c"]).row_count == 3


def test_report_rejects_what_is_not_a_schedule():
    with pytest.raises(ValueError, match="StableHLO"):
        schedule_report("module @jit_f attributes {mhlo.num_partitions = 8 : i32} {\n}")
    with pytest.raises(ValueError, match="not scheduled"):
        schedule_report("HloModule m\n\nENTRY %main () -> f32[] {\n}\n")
    with pytest.raises(TypeError, match="compiled is a int"):
        schedule_report(3)


def test_step_lowers_from_eval_shape_state(mesh):
    """The path the issue describes, without jaxdp.aot helpers: abstract state from
    jax.eval_shape(dp.init, params), batch ShapeDtypeStructs with shardings."""
    dp, params, batch = build(mesh, 1, "fp32", 1)
    state = jax.eval_shape(dp.init, params)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch)
    compiled = dp.step.lower(state, batch).compile()
    assert "reduce-scatter-start" in compiled.as_text()


@pytest.mark.parametrize("stage", [0, 1])
def test_one_rank_packs_and_orders_nothing(mesh, stage):
    """Stage 0 all-reduces per parameter (no bucket packing) on any number of ranks, with
    XLA's ``all-reduce-contiguous`` off where there is an all-reduce (more than one rank).
    Stage 1's per-parameter gathers wait for nothing on any mesh (no bitwise OR in the
    program); what differs with more than one rank is the norm's sum (``ops.nccl``). With one
    rank, buckets and ordering only added copies for XLA to compile (one compile-only H100,
    12-layer GPT, lower + compile: stage 0 16.9 s -> 14.6 s, medians of four rounds)."""
    from jaxdp._src.comm.per_param import PASSES_OFF, AllReduceOps, PerParamOps
    from jaxdp.aot import h100_mesh

    loss_fn, params, batch = example_mlp(LAYERS, WIDTH, batch=64)
    cfg = DDPConfig(zero_stage=stage, bucket_size=BUCKET, param_dtype="bfloat16")
    for m in (h100_mesh(1), mesh):
        dp = DataParallel(loss_fn, optax.adam(1e-3), cfg, mesh=m)
        text = compile_step(dp, params, batch).as_text()
        ops, one = dp.plan.strategy.ops, m.size == 1
        if stage == 0:
            assert isinstance(ops, AllReduceOps)
            assert dp.plan.passes_off == (() if one else PASSES_OFF)
        else:
            assert isinstance(ops, PerParamOps) and ops.nccl is not one
            assert dp.plan.passes_off == ()
            assert re.search(r" or\(", text) is None


@pytest.mark.parametrize(
    "extra",
    [
        {"zero_stage": 1},
        {"zero_stage": 2, "num_microbatches": 2},
        {"zero_stage": 1, "overlap_param_gather": True},
        {"zero_stage": 3},
        {"zero_stage": 1, "param_dtype": "bfloat16"},
    ],
    ids=["stage1", "stage2-g2", "stage1-overlap", "stage3", "stage1-bf16"],
)
def test_one_rank_writes_master_and_params_without_a_copy(extra):
    """With one rank and params in the master's dtype, the updated master is the working
    param's value too; the step returns it through ``jaxdp._src.comm.order.after`` so that the
    update's fusion writes both outputs, and the entry computation has no copy kernel
    (64-layer MLP before the change: 128 copies at stages 1-3, one per leaf)."""
    from jaxdp.aot import h100_mesh

    loss_fn, params, batch = example_mlp(LAYERS, WIDTH, batch=64)
    cfg = DDPConfig(bucket_size=BUCKET, **extra)
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=h100_mesh(1))
    entry = re.search(r"^ENTRY .*?^}", compile_step(dp, params, batch).as_text(), re.M | re.S)
    assert entry is not None
    # (a micro-batch loop's counter and scalar inits are copied: not a leaf's)
    assert re.search(r"= \w+\[\d[^\]]*\]\S* copy(-start)?\(", entry.group(0)) is None
    assert dp.plan.strategy.master_apart == ("param_dtype" not in extra)
    more = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=h100_mesh(8))
    compile_step(more, params, batch)
    assert not more.plan.strategy.master_apart  # more ranks: the gather makes a value apart


@pytest.mark.parametrize(
    ("extra", "options"),
    [
        ({}, None),
        ({"param_dtype": "bfloat16"}, "jaxdp"),
        (
            {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True},
            {"xla_disable_hlo_passes": "cse"},
        ),
    ],
    ids=["fp32-default", "bf16-wire-jaxdp", "fp32-wire-dict"],
)
def test_stage0_all_reduces_without_a_gradient_copy(mesh, extra, options):
    """Stage 0 on GPUs all-reduces each parameter on its own, and the step compiles with
    XLA's ``all-reduce-contiguous`` off whatever options it is given (merged into a dict that
    names other passes): XLA combines the all-reduces into groups of separate buffers, and
    nothing packs the gradients into a bucket, slices them out of one, or copies them into a
    combined all-reduce's buffer (the pass's rewrite). 100 parameters, one bucket's worth."""
    from jaxdp._src.comm.per_param import AllReduceOps

    loss_fn, params, batch = example_mlp(50, 64, batch=64)
    cfg = DDPConfig(zero_stage=0, **extra)
    dp = DataParallel(loss_fn, optax.adamw(1e-3), cfg, mesh=mesh, compiler_options=options)
    text = compile_step(dp, params, batch, compiler_options=options).as_text()
    assert isinstance(dp.plan.strategy.ops, AllReduceOps)
    entry = text[text.index("\nENTRY") :]
    assert not written_concatenations(text) and " slice(" not in text
    results = [
        line.split(" all-reduce-start(")[0].split(" = ", 1)[1]
        for line in entry.split("\n")
        if " all-reduce-start(" in line
    ]
    sizes = [int(n) for shape in results for n in re.findall(r"\[(\d+)\]", shape)]
    # every parameter all-reduced as it is, flattened (the loss's scalar has no dimension)
    assert sorted(sizes) == sorted(s.size for s in dp.layout.slots), results


@pytest.mark.parametrize(
    ("extra", "wire"),
    [({}, "f32"), ({"param_dtype": "bfloat16", "grad_reduce_in_fp32": True}, "f32")],
    ids=["fp32", "fp32-wire"],
)
def test_stage0_bucket_is_written_once(mesh, monkeypatch, extra, wire):
    """Stage 0's packed buckets (the path before per-parameter all-reduces, forced here;
    ``jaxdp._src.comm.per_param.per_parameter_all_reduce``): a bucket of 100 parameters (one bucket:
    the default bucket size) is written once, by the pack, on its way to its all-reduce:

    * the 1/dp pre-scaling is done gradient by gradient before the pack
      (``jaxdp._src.comm.reduce.Unpacked``): XLA:GPU fuses nothing into a concatenation of that many
      operands, and scaled afterwards the bucket was read and written once more;
    * the loss's ``psum`` waits for the bucket's all-reduce (``Kernel``'s ``order_metrics``),
      so XLA does not combine the two, which XLA:GPU does by copying both into one buffer and
      the sum back out (``bucket + 1`` elements on the wire)."""
    import jaxdp._src.strategy.plan as plan_module

    monkeypatch.setattr(plan_module, "per_parameter_all_reduce", lambda *a: False)
    loss_fn, params, batch = example_mlp(50, 64, batch=64)
    dp = DataParallel(loss_fn, optax.adamw(1e-3), DDPConfig(zero_stage=0, **extra), mesh=mesh)
    text = compile_step(dp, params, batch).as_text()
    (bucket,) = dp.layout.buckets
    assert len(bucket.slots) == 100
    assert dp.plan.strategy.make_kernel.keywords["order_metrics"] is True
    report = schedule_report(text)
    sizes = sorted(c.elements for c in report.of_kind("all-reduce"))
    assert sizes[-1] == bucket.numel and all(n < 16 for n in sizes[:-1]), report
    entry = text[text.index("\nENTRY") :]
    writers = re.findall(rf"= {wire}\[{bucket.numel}\]\S* (\w+)\(", entry)
    assert writers.count("fusion") == 1, writers  # the pack (concatenation) only
