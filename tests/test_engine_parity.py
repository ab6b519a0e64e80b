"""DataParallel against a plain single-device reference (same init, same global batch)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import (
    make_batch,
    max_rel_err,
    mlp_params,
    mse_loss,
    reference_train,
    train_steps,
)

from jaxdp import DataParallel, DDPConfig

STEPS = 10
GLOBAL_BATCH = 64


def run(config, optimizer, params, batches, loss_fn=mse_loss):
    dp = DataParallel(loss_fn, optimizer, config)
    state = dp.init(params)
    metrics = []
    for b in batches:
        state, m = dp.step(state, dp.shard_batch(b))
        metrics.append(m)
    return dp, state, metrics


def train_on(mesh, config, optimizer, params, batches):
    """A fresh engine on ``mesh`` trained over ``batches``: ``(engine, state, grad norms)``."""
    dp = DataParallel(mse_loss, optimizer, config, mesh=mesh)
    state, norms = train_steps(dp, dp.init(params), batches)
    return dp, state, norms


@pytest.fixture(scope="module")
def data():
    params = mlp_params()
    batches = [make_batch(GLOBAL_BATCH, seed=s) for s in range(STEPS)]
    return params, batches


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("bucket_size", [64, None], ids=["tiny", "one"])
@pytest.mark.parametrize("avg", [False, True], ids=["prescale", "avg"])
def test_fp32_parity(data, stage, g, bucket_size, avg):
    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    ref, ref_norms = reference_train(mse_loss, opt, params, batches)
    cfg = DDPConfig(
        zero_stage=stage, num_microbatches=g, bucket_size=bucket_size, average_in_collective=avg
    )
    dp, state, metrics = run(cfg, opt, params, batches)
    if bucket_size == 64:
        assert len(dp.layout.buckets) > 3
    # fp32 everywhere: only the summation order differs (per-device partial sums).
    assert max_rel_err(dp.params(state), ref) < 1e-6
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert int(state.step) == STEPS
    # Sharded stages keep fp32 master weights and optimizer state sharded over `data`.
    if stage >= 1:
        leaf = jax.tree.leaves(state.master)[0]
        assert leaf.sharding.spec == jax.sharding.PartitionSpec("data")
        shard = leaf.addressable_shards[0].data
        assert shard.shape[0] * 8 == leaf.shape[0]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clip_grad_parity(data, stage):
    params, batches = data
    opt = optax.sgd(0.5, momentum=0.9)
    ref, ref_norms = reference_train(mse_loss, opt, params, batches, clip=0.05)
    cfg = DDPConfig(zero_stage=stage, clip_grad=0.05, bucket_size=100, num_microbatches=2)
    dp, state, metrics = run(cfg, opt, params, batches)
    assert max_rel_err(dp.params(state), ref) < 1e-6
    # metrics["grad_norm"] is the pre-clip norm.
    np.testing.assert_allclose([float(m["grad_norm"]) for m in metrics], ref_norms, rtol=1e-5)
    assert min(ref_norms) > 0.05  # clipping was active


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("fp32_reduce", [False, True], ids=["bf16-wire", "fp32-wire"])
def test_bf16_params_parity(data, stage, fp32_reduce):
    """bf16 working params, fp32 master: within what bf16 gradient rounding allows.

    The reference rounds the global-batch gradient to bf16 once; jaxdp rounds each device's
    gradient (and, with a bf16 wire, the reduced sum): each side is off by a few bf16 ulps of
    the gradient's scale, |dg| <~ 4 * 2**-9 * max|g| = 2e-3 (max|g| = 0.26). Momentum SGD's
    update follows that error: after T = 10 steps with beta = 0.9,
    |dp| <= lr * sum_t (1 - beta**t) / (1 - beta) * max|dg| = 1e-2 * 41.4 * 2e-3 = 8.4e-4, and we
    allow 2e-3 (measured: 1e-4, while the params move by up to 6e-2). Not Adam: its first step
    is +-lr whatever |g|, so an element whose gradient is within the rounding of 0 and comes out
    with opposite signs moves by 2 * lr, whatever the CPU does to the rounding.
    """
    params, batches = data
    opt = optax.sgd(1e-2, momentum=0.9)
    ref, _ = reference_train(mse_loss, opt, params, batches, param_dtype=jnp.bfloat16)
    cfg = DDPConfig(
        zero_stage=stage,
        param_dtype="bfloat16",
        grad_reduce_in_fp32=fp32_reduce,
        bucket_size=128,
        num_microbatches=2,
    )
    dp, state, _ = run(cfg, opt, params, batches)
    out = dp.params(state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        assert a.dtype == jnp.float32
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params))
    # The working params are the master rounded to bf16.
    for w, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(out), strict=True):
        np.testing.assert_array_equal(w, m.astype(jnp.bfloat16))


@pytest.mark.parametrize("stage", [1, 2])
def test_megatron_layout_and_fp32_accumulation_variant(data, stage):
    params, batches = data
    opt = optax.adam(1e-2)
    ref, _ = reference_train(mse_loss, opt, params, batches)
    for cfg in (
        DDPConfig(zero_stage=stage, bucket_layout="megatron", bucket_size=200),
        DDPConfig(zero_stage=stage, reduce_scatter_with_fp32_accumulation=True, bucket_size=200),
    ):
        dp, state, _ = run(cfg, opt, params, batches)
        assert max_rel_err(dp.params(state), ref) < 1e-6


def test_per_token_loss(data):
    params, batches = data
    rng = np.random.default_rng(3)
    masks = [jnp.asarray(rng.random((GLOBAL_BATCH, 1)) < 0.6, jnp.float32) for _ in batches]

    def per_token(p, b):
        err = (mlp_apply_f32(p, b["x"]) - b["y"]) ** 2 * b["m"]
        return jnp.sum(err), jnp.sum(b["m"]) * err.shape[-1]

    def global_mean(p, b):
        s, n = per_token(p, b)
        return s / n

    tbatches = [dict(b, m=m) for b, m in zip(batches, masks, strict=True)]
    opt = optax.sgd(0.1)
    ref, _ = reference_train(global_mean, opt, params, tbatches)
    for stage in (0, 1):
        cfg = DDPConfig(zero_stage=stage, calculate_per_token_loss=True, num_microbatches=4)
        dp, state, metrics = run(cfg, opt, params, tbatches, loss_fn=per_token)
        assert max_rel_err(dp.params(state), ref) < 1e-6
        assert float(metrics[0]["num_tokens"]) == float(jnp.sum(masks[0])) * 4


def mlp_apply_f32(p, x):
    from _models import mlp_apply

    return mlp_apply(p, x)


def test_aux_and_metrics(data):
    params, batches = data

    def loss_with_aux(p, b):
        loss = mse_loss(p, b)
        return loss, {"twice": 2 * loss}

    _, _, metrics = run(
        DDPConfig(num_microbatches=2), optax.sgd(0.1), params, batches[:2], loss_fn=loss_with_aux
    )
    m = metrics[0]
    np.testing.assert_allclose(float(m["aux"]["twice"]), 2 * float(m["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), float(mse_loss(params, batches[0])), rtol=1e-6)


def test_init_under_eval_shape_allocates_nothing(data):
    params, _ = data
    dp = DataParallel(mse_loss, optax.adam(1e-3), DDPConfig(zero_stage=1))
    abstract = jax.eval_shape(dp.init, params)
    leaf = jax.tree.leaves(abstract.master)[0]
    assert isinstance(leaf, jax.ShapeDtypeStruct)
    assert dp.layout.kind == "interleaved"


@pytest.mark.parametrize("stage", [0, 1])
def test_explicit_mesh_and_unsharded_batches(data, stage):
    """A jax.make_mesh mesh (Explicit axes) and batches placed any way give the same result."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params, batches = data
    mesh = jax.make_mesh((8,), ("data",))  # Explicit axis types, jax's default
    opt = optax.adam(1e-2)
    ref, _ = reference_train(mse_loss, opt, params, batches[:3])
    dp = DataParallel(mse_loss, opt, DDPConfig(zero_stage=stage, num_microbatches=2), mesh=mesh)
    state = dp.init(params)
    placed = [
        batches[0],  # host/default-device arrays
        jax.device_put(batches[1], NamedSharding(mesh, P("data"))),  # on the Explicit mesh
        dp.shard_batch(batches[2]),
    ]
    for b in placed:
        state, _ = dp.step(state, b)
    assert max_rel_err(dp.params(state), ref) < 1e-6


def per_param_and_bucketed(monkeypatch, switch, mesh, cfg, opt, params, batches):
    """Train the per-parameter path, then the packed buckets with
    ``jaxdp._src.strategy.plan.<switch>``
    forced off, and check that both ran and that their params are the same bit for bit.
    Returns ``(bucketed engine, its state, per-parameter norms, bucketed norms)``."""
    import jaxdp._src.strategy.plan as plan_module

    per_param, s_pp, n_pp = train_on(mesh, cfg, opt, params, batches)
    monkeypatch.setattr(plan_module, switch, lambda *a: False)
    bucketed, s_b, n_b = train_on(mesh, cfg, opt, params, batches)
    assert per_param.plan.strategy.reduces_per_parameter
    assert not bucketed.plan.strategy.reduces_per_parameter
    assert len(bucketed.layout.buckets) > 3
    for a, b in zip(jax.tree.leaves(s_pp.params), jax.tree.leaves(s_b.params), strict=True):
        np.testing.assert_array_equal(a, b)
    return bucketed, s_b, n_pp, n_b


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize(
    "extra",
    [{}, {"param_dtype": "bfloat16"}, {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True}],
    ids=["fp32", "bf16-wire", "fp32-wire"],
)
@pytest.mark.parametrize("dp_size", [8, 6])
def test_stage0_bucketed_path_matches_per_parameter(data, monkeypatch, g, extra, dp_size):
    """Stage 0 all-reduces each parameter (jaxdp._src.comm.per_param.per_parameter_all_reduce; on
    GPUs
    with XLA's all-reduce-contiguous off), where it used to pack buckets. The packed buckets
    run here too, forced: the same elementwise sums, so the same params bit for bit, and both
    held to the reference."""
    from jaxdp import make_mesh

    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    cfg = DDPConfig(zero_stage=0, num_microbatches=g, bucket_size=64, **extra)
    mesh = make_mesh(devices=jax.devices()[:dp_size])
    batches = [jax.tree.map(lambda x: x[: 48 if dp_size == 6 else 64], b) for b in batches]

    bucketed, s_b, n_pp, n_b = per_param_and_bucketed(
        monkeypatch, "per_parameter_all_reduce", mesh, cfg, opt, params, batches
    )
    np.testing.assert_allclose(n_pp, n_b, rtol=1e-6)
    if not extra:  # fp32: the reference's tolerance of test_fp32_parity
        ref, ref_norms = reference_train(mse_loss, opt, params, batches)
        assert max_rel_err(bucketed.params(s_b), ref) < 1e-6
        np.testing.assert_allclose(n_b, ref_norms, rtol=1e-5)


@pytest.mark.parametrize(
    ("g", "extra", "dp_size"),
    [
        (1, {}, 8),
        (3, {}, 3),
        (1, {"average_in_collective": True}, 6),
        (1, {"param_dtype": "bfloat16"}, 6),
        (3, {"param_dtype": "bfloat16"}, 8),
        (1, {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True}, 3),
        (3, {"param_dtype": "bfloat16", "deterministic_reduction": True}, 6),
        (1, {"calculate_per_token_loss": True}, 8),
    ],
    ids=["fp32-1-8", "fp32-3-3", "avg-1-6", "bf16-1-6", "bf16-3-8", "fp32-wire-1-3",
         "ordered-3-6", "per-token-1-8"],
)  # fmt: skip
def test_stage0_unpacked_buckets_match_packed(data, monkeypatch, g, extra, dp_size):
    """Stage 0's packed buckets (forced here; the all_to_all modes keep them) take the
    collective's elementwise work (the cast to the wire dtype, the pre-scaling) gradient by
    gradient before packing where a bucket holds more
    than ``jaxdp._src.comm.reduce.UNPACKED_OVER`` parameters (``jaxdp._src.comm.reduce.Unpacked``).
    Forced for
    every bucket here: the same params and norms bit for bit as packing first, in every wire
    mode, and held to the reference."""
    import jaxdp._src.comm.nested as nested
    import jaxdp._src.strategy.plan as plan_module
    from jaxdp import make_mesh
    from jaxdp._src.comm.reduce import Unpacked

    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    cfg = DDPConfig(zero_stage=0, num_microbatches=g, bucket_size=64, **extra)
    mesh = make_mesh(devices=jax.devices()[:dp_size])
    n = GLOBAL_BATCH // (g * dp_size) * g * dp_size
    batches = [jax.tree.map(lambda x: x[:n], b) for b in batches[:4]]
    loss = mse_loss
    if cfg.calculate_per_token_loss:

        def loss(p, b):  # (sum, count): normalised by the global count
            n = b["x"].shape[0]
            return mse_loss(p, b) * n, jnp.asarray(n, jnp.float32)

    monkeypatch.setattr(plan_module, "per_parameter_all_reduce", lambda *a: False)
    packed_seen, unpacked_seen = [], []
    real = nested.PlainOps.pack_later

    def spy(self, grads, dtype):
        out = real(self, grads, dtype)
        (unpacked_seen if any(isinstance(x, Unpacked) for x in out) else packed_seen).append(1)
        return out

    monkeypatch.setattr(nested.PlainOps, "pack_later", spy)

    def train():
        dp = DataParallel(loss, opt, cfg, mesh=mesh)
        state, norms = train_steps(dp, dp.init(params), batches)
        return dp, state, norms

    packed, s_p, n_p = train()
    monkeypatch.setattr(nested, "UNPACKED_OVER", 0)
    unpacked, s_u, n_u = train()
    assert packed_seen and unpacked_seen
    assert len(packed.layout.buckets) > 3
    assert not unpacked.plan.strategy.reduces_per_parameter
    # the metric sums wait for the bucket all-reduces (not in the all_to_all mode)
    ordered = unpacked.plan.strategy.make_kernel.keywords["order_metrics"]
    assert ordered is ("deterministic_reduction" not in extra)
    for a, b in zip(jax.tree.leaves(s_p), jax.tree.leaves(s_u), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(n_p, n_u)
    if "param_dtype" not in extra:  # fp32: the reference's tolerance of test_fp32_parity
        ref, ref_norms = reference_train(mse_loss, opt, params, batches)
        assert max_rel_err(unpacked.params(s_u), ref) < 1e-6
        np.testing.assert_allclose(n_u, ref_norms, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    ("g", "extra", "dp_size"),
    [
        (1, {}, 8),
        (4, {}, 3),
        (1, {"param_dtype": "bfloat16"}, 8),
        (4, {"param_dtype": "bfloat16"}, 6),
        (2, {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True}, 8),
    ],
    # (this process has 8 devices: tests/test_twelve_ranks.py runs 12 in a process of its own)
    ids=["fp32-1-8", "fp32-4-3", "bf16-wire-1-8", "bf16-wire-4-6", "fp32-wire-2-8"],
)
def test_stage12_bucketed_path_matches_per_parameter(data, monkeypatch, stage, g, extra, dp_size):
    """Stages 1-2 reduce-scatter and gather each parameter on its own
    (jaxdp._src.comm.per_param.per_parameter_collectives), and on XLA:CPU sum the gradient norm over
    each bucket rebuilt from the reduced parameters, unscaled where the divisor is a power of
    two (PerParamOps._bucket). Against the packed buckets, over one step with clipping
    active (the norm enters the update): the same norm and the same params bit for bit.
    (Over more steps XLA:CPU may emit the two programs' AdamW fusions differently, which moves
    an element of the params by an ulp now and then; the reference tests bound both.)"""
    from jaxdp import make_mesh

    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=64, clip_grad=0.05, **extra)
    mesh = make_mesh(devices=jax.devices()[:dp_size])
    batches = [jax.tree.map(lambda x: x[: 8 * dp_size], b) for b in batches[:1]]

    _, _, n_pp, n_b = per_param_and_bucketed(
        monkeypatch, "per_parameter_collectives", mesh, cfg, opt, params, batches
    )
    np.testing.assert_array_equal(n_pp, n_b)
    assert n_b[0] > 0.05  # clipping was active


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_square_sums_over_chunks_of_one_dtype(chunk):
    """jaxdp._src.comm.nested.square_sums, the GPU norm's partial sums: one per run of up to
    ``chunk``
    consecutive arrays of one dtype (a change of dtype starts a new one), each in that dtype
    and equal to the sum of its arrays' squares."""
    from jaxdp._src.comm.nested import square_sums
    from jaxdp.testing import tolerance

    rng = np.random.default_rng(0)
    runs = [(jnp.float32, 5), (jnp.bfloat16, 4), (jnp.float32, 2)]
    dtypes = [dt for dt, n in runs for _ in range(n)]
    arrays = [jnp.asarray(rng.standard_normal(7 + 5 * i), dt) for i, dt in enumerate(dtypes)]
    parts = square_sums(arrays, chunk)
    want, start = [], 0
    for dt, n in runs:
        for i in range(start, start + n, chunk):
            group = [np.asarray(a, np.float64) for a in arrays[i : min(i + chunk, start + n)]]
            want.append((dt, sum(float(np.sum(g**2)) for g in group)))
        start += n
    assert [p.dtype for p in parts] == [jnp.dtype(dt) for dt, _ in want]
    for p, (dt, w) in zip(parts, want, strict=True):
        np.testing.assert_allclose(float(p), w, rtol=tolerance(dt))


@pytest.mark.parametrize("stage,dp_size", [(0, 8), (1, 8), (1, 6), (2, 3)])
@pytest.mark.parametrize("clip", [None, 0.05], ids=["no-clip", "clip"])
def test_norm_summed_in_chunks_as_on_gpus(data, monkeypatch, stage, dp_size, clip):
    """On GPUs with more than one rank the per-parameter paths (stage 0 here on XLA:CPU,
    stages 1-2 with the interleaved layout) sum the gradient norm over concatenations of a few
    parameters (jaxdp._src.comm.per_param.NORM_CHUNK), on XLA:CPU over each bucket rebuilt from its
    parameters (jaxdp._src.comm.per_param.nccl_collectives). The GPU's program runs here too,
    forced:
    the same norm up to the order of its fp32 additions, the same params bit for bit where the
    norm does not enter the update, and both held to the reference where it does (clipping)."""
    import jaxdp._src.comm.per_param as per_param
    from jaxdp import make_mesh
    from jaxdp.testing import tolerance

    params, batches = data
    batches = [jax.tree.map(lambda x: x[: 8 * dp_size], b) for b in batches[:4]]
    opt = optax.adamw(1e-2, weight_decay=0.1)
    cfg = DDPConfig(zero_stage=stage, clip_grad=clip, bucket_size=200, num_microbatches=2)
    mesh = make_mesh(devices=jax.devices()[:dp_size])

    dp_b, s_b, n_b = train_on(mesh, cfg, opt, params, batches)
    monkeypatch.setattr(per_param, "nccl_collectives", lambda platform, dp_size: True)
    monkeypatch.setattr(per_param, "NORM_CHUNK", 4)  # the 6 parameters in two chunks
    dp_p, s_p, n_p = train_on(mesh, cfg, opt, params, batches)
    assert dp_p.plan.strategy.reduces_per_parameter
    assert dp_p.plan.strategy.ops.nccl
    assert not dp_b.plan.strategy.ops.nccl
    assert len(dp_p.layout.buckets) > 1
    np.testing.assert_allclose(n_p, n_b, rtol=tolerance(jnp.float32))
    if clip is None:
        for a, b in zip(jax.tree.leaves(s_p.params), jax.tree.leaves(s_b.params), strict=True):
            np.testing.assert_array_equal(a, b)
    ref, ref_norms = reference_train(mse_loss, opt, params, batches, clip=clip)
    if clip is not None:
        assert min(ref_norms) > clip  # clipping was active
    assert max_rel_err(dp_p.params(s_p), ref) < 1e-6
    np.testing.assert_allclose(n_p, ref_norms, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    ("g", "extra", "dp_size"),
    [
        (1, {}, 8),
        (4, {}, 6),
        (4, {"param_dtype": "bfloat16"}, 6),
        (1, {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True}, 8),
    ],
    ids=["fp32-1-8", "fp32-4-6", "bf16-wire-4-6", "fp32-wire-1-8"],
)
def test_gpu_programs_match_the_cpu_ones(data, monkeypatch, stage, g, extra, dp_size):
    """The plan reads the mesh's platform (ReductionGroup.platform) once, in
    jaxdp._src.comm.per_param.nccl_collectives: at stages 1-2 it decides how the norm is summed
    (a few parameters at a time on GPUs, over rebuilt buckets on XLA:CPU). Run the GPU's
    programs here, with the platform forced: the norm enters no update (no clipping), so the
    params are the same bit for bit."""
    from jaxdp import make_mesh
    from jaxdp._src.topology import group as _group

    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=64, **extra)
    mesh = make_mesh(devices=jax.devices()[:dp_size])
    batches = [jax.tree.map(lambda x: x[: 48 if dp_size == 6 else 64], b) for b in batches]

    def train():
        dp = DataParallel(mse_loss, opt, cfg, mesh=mesh)
        state = dp.init(params)
        for b in batches:
            state, _ = dp.step(state, dp.shard_batch(b))
        return dp, state

    cpu, s_cpu = train()
    monkeypatch.setattr(_group.ReductionGroup, "platform", property(lambda self: "gpu"))
    gpu, s_gpu = train()
    assert not cpu.plan.strategy.ops.nccl and gpu.plan.strategy.ops.nccl
    for a, b in zip(jax.tree.leaves(s_cpu), jax.tree.leaves(s_gpu), strict=True):
        np.testing.assert_array_equal(a, b)
    if not extra:
        ref, _ = reference_train(mse_loss, opt, params, batches)
        assert max_rel_err(gpu.params(s_gpu), ref) < 1e-6


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("g", [2, 4])
def test_one_rank_microbatches_match_reference(data, stage, g):
    """One rank with micro-batches, where stages 0-1 run every micro-batch in the loop (no
    collective follows the last one to overlap), against the single-device reference; fp32
    throughout, so only the summation order differs. Clipping is active."""
    from jaxdp import make_mesh

    params, batches = data
    opt = optax.adamw(1e-2, weight_decay=0.1)
    ref, ref_norms = reference_train(mse_loss, opt, params, batches, clip=0.05)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=64, clip_grad=0.05)
    dp, state, norms = train_on(make_mesh(jax.devices()[:1]), cfg, opt, params, batches)
    assert dp.dp == 1
    assert max_rel_err(dp.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    # Stages 1-3 keep an fp32 master beside the fp32 working params (returned apart, through
    # jaxdp._src.comm.order.after, at one rank): the same bits.
    work, master, _ = dp.plan.strategy.to_canonical(state)
    assert (master is None) == (stage == 0)
    assert dp.plan.strategy.master_apart == (stage > 0)
    for w, m in zip(jax.tree.leaves(work), jax.tree.leaves(master), strict=stage > 0):
        np.testing.assert_array_equal(np.asarray(w).view(np.uint32), np.asarray(m).view(np.uint32))
    assert min(ref_norms) > 0.05
