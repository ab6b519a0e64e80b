"""XLA flags: thresholds that keep buckets apart, version gating checked against the installed
jaxlib (an unknown flag aborts the process), and apply_xla_flags's timing rule."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

from jaxdp import BucketLayout, DDPConfig
from jaxdp._src.platform.xla_flags import (
    FLAG_TABLE,
    NEWEST_CHECKED,
    apply_xla_flags,
    combine_thresholds,
    engine_compiler_options,
    flag_available,
    with_passes_off,
    xla_compiler_options,
    xla_flags,
)


def run_python(code: str, xla_flags_env: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=xla_flags_env, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------ the table vs the installed jaxlib
def test_every_flag_the_table_allows_is_accepted_by_the_installed_jaxlib():
    allowed = [f for f in FLAG_TABLE if flag_available(f.name)]
    assert len(allowed) >= 5
    flags = " ".join(f"--{f.name}={f.example}" for f in allowed)
    r = run_python("import jax; jax.devices(); print('started')", flags)
    assert r.returncode == 0 and "started" in r.stdout, r.stderr[-2000:]


@pytest.mark.parametrize("name", [f.name for f in FLAG_TABLE if not flag_available(f.name)])
def test_flags_the_table_denies_abort_the_installed_jaxlib(name):
    spec = next(f for f in FLAG_TABLE if f.name == name)
    r = run_python("import jax; jax.devices(); print('started')", f"--{name}={spec.example}")
    assert r.returncode != 0 and "started" not in r.stdout
    assert "Unknown flag" in r.stderr and name in r.stderr, r.stderr[-2000:]


CFG = DDPConfig(zero_stage=1, bucket_size=10**6, param_dtype="bfloat16", grad_reduce_in_fp32=True)


def test_the_flags_jaxdp_emits_start_a_backend():
    code = f"""
        import os
        from jaxdp import DDPConfig
        from jaxdp._src.platform.xla_flags import apply_xla_flags
        added = apply_xla_flags(DDPConfig(**{CFG.to_dict()!r}), dp_size=8)
        import jax
        jax.devices()
        print(len(added), os.environ["XLA_FLAGS"])
    """
    r = run_python(code, "--xla_gpu_enable_latency_hiding_scheduler=false")
    assert r.returncode == 0, r.stderr[-2000:]
    n, env = r.stdout.strip().split(" ", 1)
    # the user's own setting wins and is not duplicated
    assert env.count("xla_gpu_enable_latency_hiding_scheduler") == 1
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in env
    assert "--xla_gpu_reduce_scatter_combine_threshold_bytes=499999" in env
    assert int(n) == len(xla_flags(CFG, dp_size=8)) - 1


def test_apply_after_the_backend_started_says_so():
    jax.devices()
    before = os.environ.get("XLA_FLAGS")
    with pytest.raises(RuntimeError, match="already started") as e:
        apply_xla_flags(DDPConfig())
    assert "xla_compiler_options" in str(e.value)
    assert os.environ.get("XLA_FLAGS") == before


# ------------------------------------------------------------------ version gating
def test_table_has_no_duplicates_and_sane_versions():
    names = [f.name for f in FLAG_TABLE]
    assert len(names) == len(set(names))
    for f in FLAG_TABLE:
        assert f.name.startswith("xla_") and f.kind in ("bool", "int", "str")
        if f.kind == "bool":
            assert f.example in ("true", "false")
        if f.kind == "int":
            int(f.example)
        if f.since is not None and f.removed is not None:
            assert f.since < f.removed


@pytest.mark.parametrize(
    ("version", "present", "absent"),
    [
        ("0.4.13", {"xla_gpu_enable_latency_hiding_scheduler"}, {"heuristic"}),
        ("0.6.2", {"xla_gpu_all_gather_combine_threshold_bytes"}, {"heuristic"}),
        ("0.7.0", {"xla_gpu_experimental_enable_heuristic_collective_combining"}, set()),
        ("0.10.2", {"xla_gpu_experimental_enable_heuristic_collective_combining"}, set()),
    ],
)
def test_flags_follow_the_version(version, present, absent):
    flags = xla_flags(DDPConfig(bucket_size=1000), version, dp_size=8)
    names = {f[2:].split("=")[0] for f in flags}
    assert present <= names
    assert not any(a in n for a in absent for n in names)
    for n in names:
        assert flag_available(n, version)


def test_version_arguments_are_checked():
    with pytest.raises(ValueError, match=r"jaxlib_version=0\.4\.6 is older"):
        xla_flags(DDPConfig(), "0.4.6")
    with pytest.raises(ValueError, match="jaxlib_version='banana'"):
        xla_flags(DDPConfig(), "banana")
    with pytest.warns(UserWarning, match="newer than the newest"):
        flags = xla_flags(DDPConfig(), "99.0.0")
    assert flags == xla_flags(DDPConfig(), ".".join(map(str, NEWEST_CHECKED)))
    with pytest.raises(ValueError, match="not in jaxdp's FLAG_TABLE"):
        flag_available("xla_gpu_made_up_flag")
    assert flag_available("--xla_gpu_enable_latency_hiding_scheduler=true", (0, 10, 2))
    with pytest.raises(ValueError, match="dp_size=0"):
        combine_thresholds(DDPConfig(), dp_size=0)
    with pytest.raises(TypeError, match="config is a dict"):
        combine_thresholds({}, dp_size=8)  # type: ignore[arg-type]


def test_compiler_options_are_typed_and_match_the_flags():
    cfg = DDPConfig(zero_stage=2, bucket_size=123_456, param_dtype="bfloat16")
    opts = xla_compiler_options(cfg, "0.10.2", dp_size=4)
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert opts["xla_gpu_experimental_enable_heuristic_collective_combining"] is False
    assert opts["xla_gpu_reduce_scatter_combine_threshold_bytes"] == 123_456 // 4 * 2 - 1
    flags = xla_flags(cfg, "0.10.2", dp_size=4)
    assert flags == [f"--{k}={str(v).lower()}" for k, v in opts.items()]
    no_lhs = xla_compiler_options(cfg, "0.10.2", dp_size=4, latency_hiding_scheduler=False)
    assert "xla_gpu_enable_latency_hiding_scheduler" not in no_lhs


@pytest.mark.filterwarnings("ignore:jaxlib")
def test_engine_compiler_options_resolve(monkeypatch):
    """DataParallel(compiler_options=...): None / "jaxdp" (GPU meshes only, XLA_FLAGS names
    win) / a dict; anything else is refused with the argument named."""
    cfg = DDPConfig(zero_stage=1, bucket_size=1_000_000, param_dtype="bfloat16")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    mine = xla_compiler_options(cfg, dp_size=4)
    assert engine_compiler_options("jaxdp", cfg, dp_size=4, platform="gpu") == mine
    assert engine_compiler_options("jaxdp", cfg, dp_size=4, platform="cpu") is None
    assert engine_compiler_options(None, cfg, dp_size=4, platform="gpu") is None
    assert engine_compiler_options({}, cfg, dp_size=4, platform="gpu") is None
    assert engine_compiler_options({"a": 1}, cfg, dp_size=4, platform="cpu") == {"a": 1}
    monkeypatch.setenv("XLA_FLAGS", f"--{RS}=7 --xla_gpu_enable_latency_hiding_scheduler")
    left = engine_compiler_options("jaxdp", cfg, dp_size=4, platform="gpu")
    assert left == {
        k: v for k, v in mine.items() if k not in (RS, "xla_gpu_enable_latency_hiding_scheduler")
    }
    with pytest.raises(ValueError, match=r"compiler_options='fast'.*Fix"):
        engine_compiler_options("fast", cfg, dp_size=4, platform="gpu")
    with pytest.raises(TypeError, match=r"compiler_options has key 3"):
        engine_compiler_options({3: True}, cfg, dp_size=4, platform="gpu")


def test_passes_off_are_merged_not_replaced(monkeypatch):
    """The XLA passes a step needs off (stage 0 on GPUs: jaxdp._src.comm.per_param.PASSES_OFF) are
    added to those the given options, or else XLA_FLAGS, already turn off: a per-program
    ``xla_disable_hlo_passes`` replaces the flag's whole list."""
    off = ("all-reduce-contiguous",)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert with_passes_off(None, ()) is None
    assert with_passes_off({"a": 1}, ()) == {"a": 1}
    assert with_passes_off(None, off) == {"xla_disable_hlo_passes": "all-reduce-contiguous"}
    key = "xla_disable_hlo_passes"
    assert with_passes_off({key: "cse", "a": 1}, off) == {key: "cse,all-reduce-contiguous", "a": 1}
    assert with_passes_off({key: "all-reduce-contiguous"}, off) == {key: "all-reduce-contiguous"}
    monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=cse,dce --xla_dump_to=/tmp/x")
    assert with_passes_off({"a": 1}, off) == {"a": 1, key: "cse,dce,all-reduce-contiguous"}
    assert with_passes_off({key: "cse"}, off) == {key: "cse,all-reduce-contiguous"}


def test_untabled_jaxlib_options_are_asked_of_its_xla(monkeypatch):
    """On a jaxlib newer than the flag table, "jaxdp" keeps only the options that release's
    XLA compiles with, dropping the others with a warning instead of failing the step."""
    import jaxdp._src.platform.xla_flags as xf

    cfg = DDPConfig(zero_stage=1, bucket_size=1_000_000)
    newer = (NEWEST_CHECKED[0], NEWEST_CHECKED[1] + 7, 0)
    monkeypatch.setattr(xf, "_resolve_version", lambda v=None: newer)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    dev = jax.devices()[0]
    with pytest.warns(UserWarning, match="newer than"):
        opts = engine_compiler_options("jaxdp", cfg, dp_size=4, platform="gpu", device=dev)
    assert opts and "xla_gpu_enable_latency_hiding_scheduler" in opts  # XLA:CPU knows them all
    with pytest.warns(UserWarning, match=r"no option \['xla_gone_flag'\]"):
        kept = xf.known_options({"xla_gone_flag": 1, **opts}, dev)
    assert kept == opts


def test_engine_takes_compiler_options_on_cpu():
    """On XLA:CPU "jaxdp" adds nothing (every option is a GPU one); a dict reaches the jit,
    and a bad value is refused when the engine is built, before anything compiles."""
    import optax

    from jaxdp import DataParallel

    def loss(p, b):
        return jnp.mean(b["x"] @ p["w"])

    dp = DataParallel(loss, optax.sgd(0.1), DDPConfig(zero_stage=1), compiler_options="jaxdp")
    assert dp.compiler_options is None
    opts = {"xla_cpu_enable_fast_math": False}
    dp = DataParallel(loss, optax.sgd(0.1), DDPConfig(zero_stage=1), compiler_options=opts)
    state = dp.init({"w": jnp.ones((4, 2))})
    batch = dp.shard_batch({"x": jnp.ones((16, 4))})
    state, metrics = dp.step(state, batch)
    assert float(metrics["loss"]) == 4.0
    bogus = DataParallel(loss, optax.sgd(0.1), DDPConfig(), compiler_options={"xla_nope": 1})
    state = bogus.init({"w": jnp.ones((4, 2))})
    with pytest.raises(Exception, match="xla_nope"):  # the options reach XLA
        bogus.step(state, batch)
    with pytest.raises(ValueError, match="DataParallel: compiler_options=1"):
        DataParallel(loss, optax.sgd(0.1), DDPConfig(), compiler_options=1)


# ------------------------------------------------------------------ thresholds
AR, RS, AG = (
    "xla_gpu_all_reduce_combine_threshold_bytes",
    "xla_gpu_reduce_scatter_combine_threshold_bytes",
    "xla_gpu_all_gather_combine_threshold_bytes",
)


def test_thresholds_by_config():
    t = combine_thresholds(DDPConfig(bucket_size=1000), dp_size=8)
    assert t == {AR: 1999, RS: 1000 // 8 * 2 - 1, AG: 1999}  # params' dtype unknown: 2 bytes
    t = combine_thresholds(DDPConfig(bucket_size=1000, param_dtype="float32"), dp_size=8)
    assert t == {AR: 3999, RS: 499, AG: 3999}
    t = combine_thresholds(DDPConfig(bucket_size=1000, grad_reduce_in_fp32=True, zero_stage=1))
    assert t == {AR: 3999, RS: 0, AG: 1999}  # dp unknown: never combine reduce-scatters
    # "auto" is Megatron's max(40M, 1M * dp); its lower bound when dp is unknown
    assert combine_thresholds(DDPConfig())[AR] == 40_000_000 * 2 - 1
    assert combine_thresholds(DDPConfig(), dp_size=64)[AR] == 64_000_000 * 2 - 1
    # one bucket per buffer: nothing to keep apart, XLA's defaults stay
    assert combine_thresholds(DDPConfig(bucket_size=None)) == {}
    assert combine_thresholds(DDPConfig(bucket_size=1000, overlap_grad_reduce=False)) == {}
    assert AR not in xla_compiler_options(DDPConfig(bucket_size=None), "0.10.2")


def mlp_shapes(dtype, depth=6, width=96):
    return {
        f"l{i}": {
            "w": jax.ShapeDtypeStruct((width, width), dtype),
            "b": jax.ShapeDtypeStruct((width,), dtype),
        }
        for i in range(depth)
    }


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("fp32", [False, True])
@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
@pytest.mark.parametrize("dp", [2, 8])
def test_no_two_buckets_fit_under_the_thresholds(stage, fp32, param_dtype, dp):
    """What XLA's combiners count, per real bucket: every bucket but the last of its buffer is
    over the threshold (so the combiner leaves it alone); the thresholds are not needlessly
    small either (within a factor 4 of the smallest full bucket: buckets overshoot bucket_size
    by up to one parameter, and bf16 is assumed when the params' dtype is unknown)."""
    cfg = DDPConfig(
        zero_stage=stage, bucket_size=20_000, grad_reduce_in_fp32=fp32, param_dtype=param_dtype
    )
    layout = BucketLayout.from_params(mlp_shapes(jnp.float32), cfg, dp)
    assert len(layout.buckets) >= 3
    t = combine_thresholds(cfg, dp_size=dp)
    grad_b = 4 if (fp32 or param_dtype is None) else 2
    param_b = 2 if param_dtype == "bfloat16" else 4
    full = layout.buckets[:-1]
    if stage == 0:
        sizes = [b.numel * grad_b for b in full]
        assert all(s > t[AR] for s in sizes) and min(sizes) <= 4 * (t[AR] + 1)
    else:
        rs = [b.numel // dp * grad_b for b in full]
        ag = [b.numel * param_b for b in full]
        assert all(s > t[RS] for s in rs) and min(rs) <= 4 * (t[RS] + 1)
        assert all(s > t[AG] for s in ag) and min(ag) <= 4 * (t[AG] + 1)


def _scanned_gather_schedule(mesh, compiler_options):
    """A ZeRO-3-style loop: each iteration all-gathers one layer's weight shard, then its GEMM
    (forward and, with the re-gathering remat, the backward too); compiled for 8 H100s."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdp.aot import schedule_report

    layers, d = 6, 512

    def loss(ws, x):
        def layer(h, w):
            full = jax.lax.all_gather(w, "data", tiled=True).reshape(d, d)
            return jnp.tanh(h @ checkpoint_name(full, "gathered")), None

        layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)
        h, _ = jax.lax.scan(layer, x, ws)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    step = jax.shard_map(
        jax.grad(loss), mesh=mesh, in_specs=(P(None, "data"), P("data")), out_specs=P(None, "data")
    )
    ws = jax.ShapeDtypeStruct(
        (layers, d * d), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data"))
    )
    x = jax.ShapeDtypeStruct((64, d), jnp.bfloat16, sharding=NamedSharding(mesh, P("data")))
    lowered = jax.jit(step).lower(ws, x)
    return schedule_report(lowered.compile(compiler_options=compiler_options).as_text())


def test_stage3_pipelines_the_scanned_all_gather(h100):
    """The one flag jaxdp adds for ZeRO-3 does what it says on this jaxlib: the gather of the
    next layer runs during the current layer's GEMM; without it the gather is exposed."""
    on = xla_compiler_options(DDPConfig(zero_stage=3, bucket_size=10**6), dp_size=8)
    assert on["xla_gpu_enable_pipelined_all_gather"] is True
    assert "xla_gpu_enable_pipelined_all_gather" not in xla_compiler_options(CFG, dp_size=8)
    # not with micro-batches: it would pipeline the micro-batch loop's gathers as well
    g4 = DDPConfig(zero_stage=3, bucket_size=10**6, num_microbatches=4)
    assert "xla_gpu_enable_pipelined_all_gather" not in xla_compiler_options(g4, dp_size=8)
    off = {k: v for k, v in on.items() if k != "xla_gpu_enable_pipelined_all_gather"}

    def loop_gathers(report):
        return [c for c in report.of_kind("all-gather") if not c.entry]

    before, after = (
        loop_gathers(_scanned_gather_schedule(h100, off)),
        loop_gathers(_scanned_gather_schedule(h100, on)),
    )
    assert before and after
    assert max(c.gemms_between for c in before) == 0, before
    assert max(c.gemms_between for c in after) >= 1, after


def test_stage3_microbatches_take_the_analytical_cost_model():
    """Only ZeRO-3 with micro-batches (its loop body re-gathers while it reduce-scatters):
    tests/test_zero3_aot.py checks the schedule it buys."""
    name = "xla_gpu_enable_analytical_latency_estimator"
    for stage, g, on in [(3, 4, True), (3, 2, True), (3, 1, False), (2, 4, False), (1, 4, False)]:
        cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=10**6)
        assert xla_compiler_options(cfg, dp_size=8).get(name) is (True if on else None)
        assert (f"--{name}=true" in xla_flags(cfg, dp_size=8)) is on


def test_no_analytical_cost_model_where_it_aborts_xla():
    """jaxlib 0.11.2's GPU compiler aborted the process in the analytical cost model on a ZeRO-3
    step with micro-batches (H100 and H200): from 0.11 on jaxdp does not ask for it, and stage 3
    keeps everything else it sets (the first release with it, and the last one seen working)."""
    name = "xla_gpu_enable_analytical_latency_estimator"
    cfg = DDPConfig(zero_stage=3, num_microbatches=4, bucket_size=10**6)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 0.11.2 is newer than the flag table
        newer = [xla_compiler_options(cfg, v, dp_size=8) for v in ("0.11.0", "0.11.2")]
    for opts in newer:
        assert name not in opts
        assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    for v in ("0.4.16", "0.10.2"):
        assert xla_compiler_options(cfg, v, dp_size=8)[name] is True
    assert f"--{name}=true" not in xla_flags(cfg, "0.11.2", dp_size=8)


def test_flags_seen_accepted_by_a_newer_jaxlib_draw_no_warning():
    """jaxlib 0.11.2 started a GPU backend with a stage-1 config's six flags (H200, bench_gpu's
    preflight): those draw no warning there; a flag not seen there (stage 3's pipeliner) does,
    and names itself; a release with nothing seen warns as before."""
    import warnings

    from jaxdp._src.platform.xla_flag_table import _BY_NAME, SEEN_ACCEPTED

    assert all(n in _BY_NAME for names in SEEN_ACCEPTED.values() for n in names)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags = xla_flags(DDPConfig(zero_stage=1, param_dtype="bfloat16"), "0.11.2", dp_size=8)
    assert len(flags) == 6
    with pytest.warns(UserWarning, match="xla_gpu_enable_pipelined_all_gather not seen there"):
        xla_flags(DDPConfig(zero_stage=3), "0.11.2", dp_size=8)
    with pytest.warns(UserWarning, match="newer than the newest"):
        xla_flags(DDPConfig(zero_stage=1), "0.11.3", dp_size=8)
