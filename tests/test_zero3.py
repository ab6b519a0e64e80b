"""ZeRO-3 and overlap_param_gather against the plain single-device reference.

Tolerances: with fp32 params only the summation order differs (1e-6 relative, as the engine
parity tests). With bf16 working params every path rounds each device's gradient to bf16 (the
reference rounds the global-batch gradient once) and the plain bf16 wire rounds the sum again,
each <= 2**-9 relative; with momentum SGD the update error follows the gradient error, so we
compare the *updates* (params minus init) with a relative error of 2e-2 (~5 bf16 ulps). Stage 3 must
also reduce the same gradient as stage 2 with the same config, bit for bit: the same numerics,
only moved.
"""

import functools

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
    scan_mlp_loss,
    scan_mlp_params,
    train_steps,
)
from _transformer import (
    scan_transformer_loss,
    scan_transformer_params,
    transformer_batches,
    transformer_loss,
    transformer_params,
)

import jaxdp
from jaxdp import CheckpointManager, DataParallel, DDPConfig
from jaxdp.testing import assert_trees_close, reduced_gradient, tolerance

STEPS = 2
MODES = {
    "bf16": {"param_dtype": "bfloat16"},
    "fp32-wire": {"param_dtype": "bfloat16", "grad_reduce_in_fp32": True},
    "fp32-accum": {"param_dtype": "bfloat16", "reduce_scatter_with_fp32_accumulation": True},
    "fp32": {},
    "deterministic": {"param_dtype": "bfloat16", "deterministic_reduction": True},
}
MODELS = {
    "mlp": (mse_loss, mlp_params, lambda n: [make_batch(n, seed=s) for s in range(STEPS)], 64),
    "transformer": (
        transformer_loss,
        transformer_params,
        lambda n: transformer_batches(n, STEPS),
        300,
    ),
    # scanned layer stacks (tests/test_zero3_scan.py): nn.scan and a raw lax.scan
    "scan_transformer": (
        scan_transformer_loss,
        scan_transformer_params,
        lambda n: transformer_batches(n, STEPS),
        300,
    ),
    "scan_mlp": (
        scan_mlp_loss,
        scan_mlp_params,
        lambda n: [make_batch(n, seed=s) for s in range(STEPS)],
        64,
    ),
}


def _opt(model, mode):
    # Adam normalises the update: where a gradient element sums to ~0 over ranks (in bf16, or
    # exactly, like the attention key bias of the transformer), rounding noise is scaled up to a
    # step of ~lr. Elsewhere we use momentum SGD, whose update error follows the gradient error.
    if model in ("mlp", "scan_mlp") and mode == "fp32":
        return optax.adamw(1e-2, weight_decay=0.1)
    return optax.sgd(0.3, momentum=0.9)


def _rel_err(a, b):
    """||a - b|| / ||b|| over all leaves together."""
    num = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    den = sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))
    return (num / den) ** 0.5


def _reference(model, mode):
    bf16 = bool(MODES[mode])
    return _reference_for(model, bf16, type(_opt(model, mode)).__name__ + str(bf16 or model))


@functools.cache
def _reference_for(model, bf16, _opt_key):
    """reference_train's plain single-device loop with the gradient jitted (the eager
    reference takes longer than the engine on the transformer); shared by the modes that have
    the same params dtype and optimizer."""
    loss_fn, make_params, make_batches, _ = MODELS[model]
    opt = _opt(model, "bf16" if bf16 else "fp32")
    grad_fn = jax.jit(jax.grad(loss_fn))
    params = make_params()
    master, state, norms = params, opt.init(params), []
    for batch in make_batches(96):
        work = jax.tree.map(lambda p: p.astype(jnp.bfloat16), master) if bf16 else master
        grads = jax.tree.map(lambda x: x.astype(jnp.float32), grad_fn(work, batch))
        norms.append(float(optax.tree.norm(grads)))
        updates, state = opt.update(grads, state, master)
        master = optax.apply_updates(master, updates)
    return params, master, norms


@functools.cache
def _run(model, stage, g, mode, buckets, ndev=8, **extra):
    loss_fn, make_params, make_batches, small = MODELS[model]
    cfg = DDPConfig(
        zero_stage=stage,
        num_microbatches=g,
        bucket_size=small if buckets == "several" else None,
        **MODES[mode],
        **extra,
    )
    dp = DataParallel(loss_fn, _opt(model, mode), cfg, mesh=jaxdp.make_mesh(jax.devices()[:ndev]))
    batches = make_batches(96)
    # the example batch lets stage 3 find scanned layer stacks (nothing for unrolled models)
    state = dp.init(make_params(), example_batch=batches[0])
    state, norms = train_steps(dp, state, batches)
    return dp, state, norms


def _check_parity(model, mode, dp, state, norms):
    params, ref, ref_norms = _reference(model, mode)
    out = dp.params(state)
    delta = jax.tree.map(lambda a, p: a - p, out, params)
    ref_delta = jax.tree.map(lambda a, p: a - p, ref, params)
    if mode == "fp32":
        assert max_rel_err(out, ref) < 1e-6
        assert _rel_err(delta, ref_delta) < 1e-5
        np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    else:
        assert _rel_err(delta, ref_delta) < 2e-2
        np.testing.assert_allclose(norms, ref_norms, rtol=2e-2)
    wdt = jnp.bfloat16 if mode != "fp32" else jnp.float32
    for leaf, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(state.master), strict=True):
        # sharded like the master (1/dp per rank), and exactly its cast
        assert leaf.dtype == wdt and leaf.shape == m.shape
        assert leaf.sharding.spec == jax.sharding.PartitionSpec("data")
        assert leaf.addressable_shards[0].data.shape[0] * dp.dp == leaf.shape[0]
        np.testing.assert_array_equal(leaf, m.astype(wdt))


@pytest.mark.parametrize("buckets", ["several", "one"])
@pytest.mark.parametrize("mode", ["bf16", "fp32-wire", "fp32-accum"])
@pytest.mark.parametrize("g", [1, 4])
def test_stage3_parity_mlp(g, mode, buckets):
    dp, state, norms = _run("mlp", 3, g, mode, buckets)
    assert (len(dp.layout.buckets) > 3) == (buckets == "several")
    _check_parity("mlp", mode, dp, state, norms)


# XLA:CPU takes ~11 s to compile one transformer step on this 2-core box, so the transformer
# runs a covering subset of the MLP's matrix: every wire mode, both bucket arrangements, G = 1
# and 4 (fp32 params and the rest of the matrix: the MLP tests above and below).
@pytest.mark.parametrize(
    ("g", "mode", "buckets"),
    [
        (4, "bf16", "several"),
        (4, "fp32-accum", "one"),
        (1, "fp32-wire", "several"),
    ],
)
def test_stage3_parity_transformer(g, mode, buckets):
    dp, state, norms = _run("transformer", 3, g, mode, buckets)
    assert (len(dp.layout.buckets) > 3) == (buckets == "several")
    _check_parity("transformer", mode, dp, state, norms)


def test_stage3_fp32_params():
    dp, state, norms = _run("mlp", 3, 2, "fp32", "several")
    _check_parity("mlp", "fp32", dp, state, norms)


@pytest.mark.parametrize(("ndev", "mode"), [(6, "fp32-accum"), (3, "fp32"), (6, "bf16")])
def test_stage3_non_power_of_two_mesh(ndev, mode):
    dp, state, norms = _run("mlp", 3, 4, mode, "several", ndev)
    assert dp.dp == ndev
    _check_parity("mlp", mode, dp, state, norms)


@pytest.mark.parametrize(
    ("mode", "layout"),
    [
        ("bf16", "interleaved"),
        ("fp32-wire", "interleaved"),
        ("fp32-accum", "interleaved"),
        ("fp32-accum", "megatron"),
        ("deterministic", "interleaved"),
    ],
)
def test_stage3_bitwise_equals_stage2(mode, layout):
    """Same numerics as stage 2 (deferred fp32 division, cast before arithmetic), in both
    bucket layouts: from one state, the same reduced gradient bit for bit and the same update
    up to how XLA contracts the optimizer's multiply-adds."""
    extra = {} if layout == "interleaved" else {"bucket_layout": layout}  # reuse cached runs
    d3, s3, n3 = _run("mlp", 3, 4, mode, "several", **extra)
    d2, _, n2 = _run("mlp", 2, 4, mode, "several", **extra)
    batch = MODELS["mlp"][2](96)[0]
    init3 = d3.init(MODELS["mlp"][1](), example_batch=batch)
    init2 = d2.init(MODELS["mlp"][1](), example_batch=batch)
    # The reduced gradients of one step from the same state: bit for bit, so the norms too
    # (on XLA:CPU stage 2 sums its norm over each bucket rebuilt from its parameters, as stage
    # 3 does; on GPUs it sums a few parameters at a time: test_engine_parity checks that path).
    g3, g2 = reduced_gradient(d3, init3, batch), reduced_gradient(d2, init2, batch)
    jax.tree.map(np.testing.assert_array_equal, g3, g2)
    assert n3[0] == n2[0]
    # The update that step makes. XLA:CPU contracts the optax update's multiply-adds into FMAs
    # where its fusions allow, and the fusions are cut differently in the two programs (stage 2
    # reduces per parameter, stage 3 into bucket shards), so the update may differ by one fp32
    # rounding (with --xla_cpu_max_isa=SSE4_2, no FMA, it is bit-identical). The error of one
    # rounding per element is covered by tolerance(float32); the differences then compound
    # over steps, so later steps are held to the reference by _check_parity instead.
    before3, before2 = jax.device_get(init3.master), jax.device_get(init2.master)  # donated
    one3 = d3.step(init3, d3.shard_batch(batch))[0]
    one2 = d2.step(init2, d2.shard_batch(batch))[0]
    update = functools.partial(jax.tree.map, lambda a, b: np.asarray(a) - b)
    assert_trees_close(
        update(one3.master, before3),
        update(one2.master, before2),
        rtol=tolerance(jnp.float32),
        what="one step's master update, stage 3 vs stage 2",
    )
    _check_parity("mlp", mode, d3, s3, n3)  # stage 2: tests/test_strategies.py


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("g", [1, 4])
def test_overlap_param_gather_parity(stage, g):
    mode = "fp32-wire" if g == 1 else "bf16"
    dp, state, norms = _run("mlp", stage, g, mode, "several", overlap_param_gather=True)
    _check_parity("mlp", mode, dp, state, norms)
    # the same program as without the option, only the gather moved
    _, plain, _ = _run("mlp", stage, g, mode, "several")
    for a, b in zip(jax.tree.leaves(state.master), jax.tree.leaves(plain.master), strict=True):
        np.testing.assert_array_equal(a, b)


def test_stage3_nan_check_and_clipping():
    params = mlp_params()
    opt = optax.sgd(0.5, momentum=0.9)
    batches = [make_batch(48, seed=s) for s in range(STEPS)]
    ref, ref_norms = reference_train(mse_loss, opt, params, batches, clip=0.05)
    cfg = DDPConfig(
        zero_stage=3,
        clip_grad=0.05,
        bucket_size=100,
        num_microbatches=2,
        check_for_nan_in_grad=True,
    )
    dp = DataParallel(mse_loss, opt, cfg)
    state = dp.init(params)
    state, norms = train_steps(dp, state, batches)
    assert max_rel_err(dp.params(state), ref) < 1e-6
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    assert min(ref_norms) > 0.05  # clipping was active

    bad = dict(batches[0])
    bad["x"] = bad["x"].at[5, 0].set(jnp.nan)  # one example on rank 0
    with pytest.raises(FloatingPointError, match="layer0/w") as info:
        dp.step(state, dp.shard_batch(bad))
    assert "on 1 of 8 ranks" in str(info.value)
    kept = info.value.state
    assert int(kept.step) == STEPS
    assert max_rel_err(dp.params(kept), ref) < 1e-6  # the update was skipped


def test_stage3_aux_and_per_token_loss():
    params = mlp_params()
    batches = [make_batch(48, seed=s) for s in range(2)]
    rng = np.random.default_rng(3)
    masks = [jnp.asarray(rng.random((48, 1)) < 0.6, jnp.float32) for _ in batches]
    tb = [dict(b, m=m) for b, m in zip(batches, masks, strict=True)]

    def per_token(p, b):
        from _models import mlp_apply

        err = (mlp_apply(p, b["x"]) - b["y"]) ** 2 * b["m"]
        return jnp.sum(err), jnp.sum(b["m"]) * err.shape[-1]

    def global_mean(p, b):
        s, n = per_token(p, b)
        return s / n

    ref, _ = reference_train(global_mean, optax.sgd(0.1), params, tb)
    cfg = DDPConfig(zero_stage=3, calculate_per_token_loss=True, num_microbatches=2)
    dp = DataParallel(per_token, optax.sgd(0.1), cfg)
    state = dp.init(params)
    for b in tb:
        state, m = dp.step(state, dp.shard_batch(b))
    assert max_rel_err(dp.params(state), ref) < 1e-6

    def with_aux(p, b):
        loss = mse_loss(p, b)
        return loss, {"twice": 2 * loss}

    dp = DataParallel(with_aux, optax.sgd(0.1), DDPConfig(zero_stage=3, num_microbatches=2))
    state = dp.init(params)
    _, m = dp.step(state, dp.shard_batch(batches[0]))
    np.testing.assert_allclose(float(m["aux"]["twice"]), 2 * float(m["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m["loss"]), float(mse_loss(params, batches[0])), rtol=1e-6)


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((8, {"zero_stage": 3, "param_dtype": "bfloat16"}), (8, {"zero_stage": 3})),
        ((8, {"zero_stage": 3, "bucket_size": 64}), (6, {"zero_stage": 1})),
        ((4, {"zero_stage": 0}), (8, {"zero_stage": 3, "bucket_size": 100})),
        ((8, {"zero_stage": 2}), (3, {"zero_stage": 3, "num_microbatches": 2})),
        ((6, {"zero_stage": 1, "overlap_param_gather": True}), (8, {"zero_stage": 3})),
    ],
)
def test_checkpoint_across_stages(tmp_path, src, dst):
    (n_src, c_src), (n_dst, c_dst) = src, dst
    dt = c_src.get("param_dtype")
    c_dst = dict(c_dst, param_dtype=dt) if dt else c_dst

    def mk(n, c):
        mesh = jaxdp.make_mesh(jax.devices()[:n])
        return DataParallel(mse_loss, optax.adam(1e-2), DDPConfig(**c), mesh=mesh)

    eng = mk(n_src, c_src)
    state = eng.init(mlp_params())
    state, _ = eng.step(state, eng.shard_batch(make_batch(48)))
    dst_eng = mk(n_dst, c_dst)
    jax.eval_shape(dst_eng.init, mlp_params())
    check_restores_exactly(tmp_path, eng, state, dst_eng)


def check_restores_exactly(tmp_path, eng, state, dst_eng):
    """Save ``state`` of ``eng``, restore it into ``dst_eng`` (already initialised), and check
    the exported params are equal, the working params are their cast, and training goes on."""
    with CheckpointManager(tmp_path, eng) as ckpt:
        ckpt.save(1, state)
        ckpt.wait_until_finished()
    with CheckpointManager(tmp_path, dst_eng) as ckpt:
        restored = ckpt.restore()
    for a, b in zip(
        jax.tree.leaves(eng.params(state)), jax.tree.leaves(dst_eng.params(restored)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    # the working params are the master's cast, sharded at stage 3
    work = restored.params
    if dst_eng.config.shards_params:
        work = dst_eng.layout.from_global_view(work)
    for w, m in zip(jax.tree.leaves(work), jax.tree.leaves(dst_eng.params(restored)), strict=True):
        np.testing.assert_array_equal(w, m.astype(w.dtype))
    # and the restored state trains on
    restored, metrics = dst_eng.step(restored, dst_eng.shard_batch(make_batch(48, seed=2)))
    assert np.isfinite(float(metrics["loss"]))
