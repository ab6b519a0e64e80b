"""Gradient-accumulation fusion: jaxdp.nn layers, their fp32 weight gradients, engine parity."""

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _gpt_nn import gpt_batches, gpt_loss, gpt_params
from _models import capture_grads
from flax import nnx

import jaxdp
from jaxdp import DataParallel, DDPConfig, nn
from jaxdp.nn import fused_value_and_grad

BF16 = jnp.bfloat16


def _bf16(tree):
    return jax.tree.map(lambda a: a.astype(BF16), tree)


# ---------------------------------------------------------------- drop-in behaviour
LINEN_PAIRS = [
    (nn.Dense(5), linen.Dense(5), (3, 4)),
    (
        nn.Dense(5, use_bias=False, dtype=BF16),
        linen.Dense(5, use_bias=False, dtype=BF16),
        (2, 3, 4),
    ),
    (nn.DenseGeneral((2, 3), axis=(-2, -1)), linen.DenseGeneral((2, 3), axis=(-2, -1)), (4, 3, 5)),
    (nn.DenseGeneral(6, axis=1), linen.DenseGeneral(6, axis=1), (2, 3, 5)),
]


@pytest.mark.parametrize("ours,theirs,shape", LINEN_PAIRS)
def test_linen_layers_are_flax_layers_when_unfused(ours, theirs, shape):
    x = jax.random.normal(jax.random.key(1), shape)
    p, q = ours.init(jax.random.key(0), x), theirs.init(jax.random.key(0), x)
    assert jax.tree.structure(p) == jax.tree.structure(q)
    jax.tree.map(np.testing.assert_array_equal, p, q)
    np.testing.assert_array_equal(ours.apply(p, x), theirs.apply(q, x))


@pytest.mark.parametrize("ours,theirs,shape", LINEN_PAIRS)
def test_linen_fused_forward_unchanged_grads_fp32(ours, theirs, shape):
    """Under the fused trace: bit-identical bf16 forward, fp32 kernel gradient, same bias grad."""
    x = jax.random.normal(jax.random.key(1), shape).astype(BF16)
    p = _bf16(ours.init(jax.random.key(0), x)["params"])

    def loss(params, x):
        return jnp.sum(ours.apply({"params": params}, x).astype(jnp.float32) ** 2)

    diff, vg = fused_value_and_grad(loss, p, x)
    assert diff["kernel"].dtype == jnp.float32
    (val, grads) = vg(diff, x)
    ref_val, ref_grads = jax.value_and_grad(loss)(p, x)
    assert val == ref_val
    assert grads["kernel"].dtype == jnp.float32
    if "bias" in p:
        assert diff["bias"].dtype == BF16
        np.testing.assert_array_equal(grads["bias"], ref_grads["bias"])
    # The unfused kernel gradient is the fused one rounded to bf16 (same fp32 accumulation).
    np.testing.assert_allclose(
        np.asarray(ref_grads["kernel"], np.float32), np.asarray(grads["kernel"]), rtol=2**-8
    )


def test_nnx_linear_is_flax_linear_and_fuses():
    ours, theirs = nn.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    np.testing.assert_array_equal(ours(x), theirs(x))
    graphdef, state = nnx.split(ours)
    p = _bf16(nnx.to_pure_dict(state))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x).astype(jnp.float32) ** 2)

    diff, vg = fused_value_and_grad(loss, p, x.astype(BF16))
    val, grads = vg(diff, x.astype(BF16))
    assert val == loss(p, x.astype(BF16))
    assert (grads["kernel"].dtype, grads["bias"].dtype) == (jnp.float32, BF16)


def test_gpt_scan_marks_only_jaxdp_kernels():
    """nn.scan-ned jaxdp layers fuse; Embed, LayerNorm and raw params keep their dtype."""
    p = _bf16(gpt_params())
    batch = gpt_batches(4, 1)[0]
    loss = gpt_loss(BF16)
    diff, vg = fused_value_and_grad(loss, p, batch)
    fused = {
        jax.tree_util.keystr(k, simple=True, separator="/")
        for k, v in jax.tree_util.tree_flatten_with_path(diff)[0]
        if v.dtype == jnp.float32
    }
    assert fused == {
        "blocks/qkv/kernel",
        "blocks/proj/kernel",
        "blocks/fc/kernel",
        "blocks/out/kernel",
        "head/kernel",
    }
    val, grads = jax.jit(vg)(diff, batch)
    # same program shape (forward + backward) as the unfused one: bit-identical loss
    assert val == jax.jit(jax.value_and_grad(loss))(p, batch)[0]
    assert grads["blocks"]["fc"]["kernel"].dtype == jnp.float32
    assert grads["blocks"]["fc"]["kernel"].shape == p["blocks"]["fc"]["kernel"].shape


# ---------------------------------------------------------------- numerics through the engine
def reduced_grad(dp, state):
    g = state.opt_state
    return dp.layout.from_global_view(g) if dp.config.zero_stage >= 1 else g


G, DP, ROWS, IN, OUT = 8, 8, 16, 64, 32


def _dense_problem(dp=DP):
    rng = np.random.default_rng(0)
    n = G * dp * ROWS
    x = jnp.asarray(rng.standard_normal((n, IN)), BF16)
    # bf16 targets and a power-of-two row count: dy = t / ROWS is exact in bf16, so the only
    # rounding left is the weight gradient's own.
    t = jnp.asarray(rng.standard_normal((n, OUT)), BF16)
    ref = np.asarray(x, np.float64).T @ np.asarray(t, np.float64) / n
    return {"x": x, "t": t}, ref


@pytest.mark.parametrize("dp_size", [3, 6, DP])  # 3 and 6: the kernel's shards are padded
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_fused_wgrad_error_vs_float64(stage, dp_size):
    batch, ref = _dense_problem(dp_size)
    mesh = jaxdp.make_mesh(jax.devices()[:dp_size])
    layer = nn.Dense(OUT, use_bias=False, dtype=BF16)
    params = layer.init(jax.random.key(0), batch["x"][:1])["params"]

    def loss_fn(p, mb):
        y = layer.apply({"params": p}, mb["x"]).astype(jnp.float32)
        return jnp.sum(y * mb["t"].astype(jnp.float32)) / mb["x"].shape[0]

    errs = {}
    for fuse in (True, False):
        cfg = DDPConfig(
            zero_stage=stage,
            num_microbatches=G,
            param_dtype="bfloat16",
            grad_reduce_in_fp32=True,
            gradient_accumulation_fusion=fuse,
        )
        dp = DataParallel(loss_fn, capture_grads(), cfg, mesh=mesh)
        state = dp.init(params)
        state, _ = dp.step(state, dp.shard_batch(batch))
        g = np.asarray(reduced_grad(dp, state)["kernel"], np.float64)
        errs[fuse] = np.linalg.norm(g - ref) / np.linalg.norm(ref)
    print(f"stage {stage}, dp {dp_size}: fused {errs[True]:.2e}, unfused {errs[False]:.2e}")
    assert errs[True] <= 1e-5
    # The unfused path rounds each micro-batch's weight gradient to bf16 (2**-9 relative).
    assert errs[False] > 1e-4


def test_fused_wgrad_error_nnx_linear():
    batch, ref = _dense_problem()
    graphdef, state = nnx.split(nn.Linear(IN, OUT, use_bias=False, dtype=BF16, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(state)

    def loss_fn(p, mb):
        y = nnx.merge(graphdef, p)(mb["x"]).astype(jnp.float32)
        return jnp.sum(y * mb["t"].astype(jnp.float32)) / mb["x"].shape[0]

    cfg = DDPConfig(
        zero_stage=1,
        num_microbatches=G,
        param_dtype="bfloat16",
        grad_reduce_in_fp32=True,
        gradient_accumulation_fusion=True,
    )
    dp = DataParallel(loss_fn, capture_grads(), cfg)
    state = dp.init(params)
    state, _ = dp.step(state, dp.shard_batch(batch))
    g = np.asarray(reduced_grad(dp, state)["kernel"], np.float64)
    assert np.linalg.norm(g - ref) / np.linalg.norm(ref) <= 1e-5


# ---------------------------------------------------------------- parity on a small GPT
def _train(cfg, loss_fn, params, batches):
    dp = DataParallel(loss_fn, optax.adamw(3e-3), cfg)
    state = dp.init(params)
    losses = []
    for b in batches:
        state, m = dp.step(state, dp.shard_batch(b))
        losses.append(float(m["loss"]))
    return np.asarray(losses), dp.params(state)


@pytest.mark.parametrize("stage", [0, 2])
def test_gpt_parity_bf16(stage):
    params, batches = gpt_params(), gpt_batches(32, 6)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=2, param_dtype="bfloat16", bucket_size=2000)
    loss_fn = gpt_loss(BF16)
    fused, _ = _train(cfg.replace(gradient_accumulation_fusion=True), loss_fn, params, batches)
    plain, _ = _train(cfg, loss_fn, params, batches)
    assert fused[0] == plain[0]  # same params, same bf16 forward
    assert fused[-1] < fused[0]
    # Gradients differ by bf16 rounding (2**-9 relative) and Adam moves each weight by ~lr per
    # step, so bf16 working params may differ by one ulp after a few steps: allow 1e-2 on ~3.5.
    np.testing.assert_allclose(fused, plain, atol=1e-2)


# fp32 params: fusion changes only *how* the weight gradients are summed (its custom_vjp's dot
# instead of AD's transpose; XLA:CPU blocks and vectorises each differently per program and per
# CPU), so the test compares one step's reduced gradients. It used to compare params after 4
# AdamW steps, which failed on AMD Zen 4 CI machines (2.9e-2 against 1e-6): Adam turns rounding
# noise in a gradient whose true value is 0 into a step of up to ~lr, and the attention key bias
# has such a gradient (softmax cancels it: |g| ~ 3e-9 here, pure noise), so the params parted
# while the gradients agreed to a few ulps.
#
# Tolerance. Each gradient element is an fp32 sum of n products, and both programs form the same
# sums, possibly in other orders. With rounding errors modelled as independent, zero-mean and
# |delta| <= u = 2**-24 (Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), one order's error is
# <~ sqrt(n) u sum|terms|, two orders differ by at most twice that, and over a leaf the norm of
# the errors follows with the leaf's norm in place of sum|terms| (little cancellation; checked
# below). At most n = batch * seq * seq = 2048 products feed one element (a weight gradient sums
# 256 tokens; upstream of the attention the cotangents also sum over 8 keys), so per leaf
#     ||g_fused - g_plain|| <= 2 sqrt(2048) u ||g_plain|| = 5.4e-6 ||g_plain||.
# A leaf whose true gradient is 0 (all cancellation) holds only rounding noise, set by the size
# of its summands rather than by its own norm: such leaves are measured against the model's
# gradient scale instead, the RMS of the leaf norms (0.32 here; the key bias is only a slice of
# the qkv bias leaf, whose q and v parts give it a norm of 0.2).
# Check: the engine's gradient and jax.grad on one device (another summation order throughout)
# differ by <= 11 u = 6.6e-7 per leaf with SSE4.2, AVX and AVX2 code, and scaling the fused
# weight gradient by (1 + 1e-4) fails this test.
GRAD_RTOL = 2 * np.sqrt(32 * 8 * 8) * 2.0**-24


def grad_rel_errs(a, b):
    """Per-leaf ||a - b|| / max(||b||, RMS of b's leaf norms), keyed by path."""
    la = jax.tree_util.tree_flatten_with_path(a)[0]
    lb = jax.tree.leaves(b)
    scale = np.sqrt(sum(float(jnp.sum(y**2)) for y in lb) / len(lb))
    return {
        jax.tree_util.keystr(k, simple=True, separator="/"): float(
            jnp.linalg.norm((x - y).ravel()) / max(float(jnp.linalg.norm(y.ravel())), scale)
        )
        for (k, x), y in zip(la, lb, strict=True)
    }


def test_gpt_parity_fp32():
    params, batch = gpt_params(), gpt_batches(32, 1)[0]
    cfg = DDPConfig(zero_stage=1, num_microbatches=2, bucket_size=2000)
    loss_fn = gpt_loss(jnp.float32)
    out = {}
    for fuse in (True, False):
        dp = DataParallel(loss_fn, capture_grads(), cfg.replace(gradient_accumulation_fusion=fuse))
        state = dp.init(params)
        state, m = dp.step(state, dp.shard_batch(batch))
        out[fuse] = float(m["loss"]), reduced_grad(dp, state)
    (loss_f, g_fused), (loss_p, g_plain) = out[True], out[False]
    np.testing.assert_allclose(loss_f, loss_p, rtol=1e-6)
    errs = grad_rel_errs(g_fused, g_plain)
    worst = max(errs, key=errs.get)
    assert errs[worst] <= GRAD_RTOL, (worst, errs[worst], GRAD_RTOL)


@pytest.mark.parametrize("scan", [False, True])
def test_models_gpt_fuses(scan):
    """``jaxdp.models.GPT`` is built from jaxdp.nn layers: with the fusion on, its kernels (and
    only those) are differentiated in fp32, with ``nn.scan`` too (the engine's forward-only
    trace of the loss used to run outside the fused scope, where a scanned block computed in
    fp32 and changed its carry's dtype), and the first step's loss is the unfused one."""
    from jaxdp.models import GPT, GPTConfig, next_byte_loss

    model = GPT(GPTConfig(layers=2, width=32, heads=2, context=16, scan=scan))
    params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    batch = {"tokens": jax.random.randint(jax.random.key(1), (16, 17), 0, 256)}

    def loss_fn(p, b):
        return next_byte_loss(model, p, b)

    diff, _ = fused_value_and_grad(loss_fn, _bf16(params), batch)
    fused = {
        jax.tree_util.keystr(k, simple=True, separator="/")
        for k, v in jax.tree_util.tree_flatten_with_path(diff)[0]
        if v.dtype == jnp.float32
    }
    names = ("attn/qkv", "attn/out", "fc", "proj")
    blocks = ["blocks"] if scan else ["block_0", "block_1"]
    assert fused == {f"{b}/{n}/kernel" for b in blocks for n in names} | {"head/kernel"}
    cfg = DDPConfig(zero_stage=1, num_microbatches=2, param_dtype="bfloat16")
    out = {}
    for fuse in (False, True):
        dp = DataParallel(
            loss_fn, optax.adamw(1e-3), cfg.replace(gradient_accumulation_fusion=fuse)
        )
        state = dp.init(params)
        _, m = dp.step(state, dp.shard_batch(batch))
        out[fuse] = float(m["loss"]), float(m["grad_norm"])
    assert out[True][0] == out[False][0]
    # the weight gradients differ by their bf16 rounding only (2**-9 relative)
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=2.0**-8)
