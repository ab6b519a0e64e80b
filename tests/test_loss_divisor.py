"""The gradient mean's divisor carried by the loss (jaxdp._src.strategy.loss_divisor): where it
applies, and
that the step's results are the same bits as dividing after the collective."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
import jaxdp._src.strategy.plan as plan_module
from jaxdp import BucketLayout, DDPConfig
from jaxdp._src.comm.public import wire_of
from jaxdp._src.strategy.loss_divisor import loss_divisor, value_and_divided_grad
from jaxdp._src.topology.group import BucketGroup

W = 24


def _params(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    return {
        f"l{i}": {
            "w": jnp.asarray(rng.standard_normal((W, W)) * 0.3, dtype),
            "b": jnp.asarray(rng.standard_normal(W) * 0.1, dtype),
        }
        for i in range(3)
    }


def _loss(p, batch):
    h = batch["x"]
    for i in range(3):
        layer = p[f"l{i}"]
        h = jnp.tanh(h @ layer["w"].astype(h.dtype) + layer["b"].astype(h.dtype))
    return jnp.mean((h.astype(jnp.float32) - batch["y"]) ** 2)


def _batch(n=32):
    rng = np.random.default_rng(1)
    return {
        "x": jnp.asarray(rng.standard_normal((n, W)), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((n, W)), jnp.float32),
    }


def _groups(layout, size, prediv=1):
    return [BucketGroup("data", size, prediv) for _ in layout.buckets]


def _divisor(cfg, layout, groups):
    return loss_divisor(
        layout,
        groups,
        wire_of(cfg),
        num_microbatches=cfg.num_microbatches,
        param_dtype=cfg.param_dtype,
    )


@pytest.mark.parametrize(
    ("dp", "g", "kw", "want"),
    [
        (8, 1, {}, 8),
        (4, 2, {}, 8),
        (2, 4, {"param_dtype": "bfloat16"}, 8),
        (8, 1, {"grad_reduce_in_fp32": True}, 8),
        (6, 1, {}, 1),  # not a power of two: the division after the sum rounds differently
        (3, 4, {}, 1),
        (1, 1, {}, 1),  # nothing to divide
        (8, 1, {"calculate_per_token_loss": True}, 1),  # divided by the token count after
        (8, 1, {"param_dtype": "float16"}, 1),  # a 5-bit exponent: no earlier subnormals
        (8, 1, {"main_grads_dtype": "float16"}, 1),
    ],
)
def test_where_the_loss_carries_the_divisor(dp, g, kw, want):
    cfg = DDPConfig(num_microbatches=g, **kw)
    layout = BucketLayout.from_params(_params(), cfg, dp)
    assert _divisor(cfg, layout, _groups(layout, dp)) == want


def test_expert_buckets_share_the_dense_divisor():
    cfg = DDPConfig()
    layout = BucketLayout.from_params(_params(), cfg, 4)
    dense = BucketGroup("data", 8)
    expert = BucketGroup("data", 4, prediv=2, expert=True)
    groups = [dense if i % 2 else expert for i in range(len(layout.buckets))]
    assert _divisor(cfg, layout, groups) == 8
    odd = [dense if i % 2 else BucketGroup("data", 4, 1, True) for i in range(len(groups))]
    if len(layout.buckets) > 1:
        assert _divisor(cfg, layout, odd) == 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("d", [1, 2, 8, 64])
def test_divided_gradient_is_the_gradient_divided_bit_for_bit(dtype, d):
    params = _params(dtype)
    batch = _batch()

    def parts(p, mb):
        return _loss(p, mb).astype(dtype), {"n": 1}

    (loss, aux), grads = value_and_divided_grad(parts, d)(params, batch)
    (want_loss, want_aux), want = jax.value_and_grad(parts, has_aux=True)(params, batch)
    assert loss.dtype == want_loss.dtype and float(loss) == float(want_loss) and aux == want_aux
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        assert got.dtype == ref.dtype
        expect = (np.asarray(ref, np.float64) / d).astype(np.asarray(ref).dtype)
        np.testing.assert_array_equal(np.asarray(got), expect)


def _run(cfg, mesh, params, steps=2):
    # The optimizer state is the reduced (clipped) gradient itself, bit for bit (a trace with
    # no decay: g + 0 * t), and the update an exact multiple of it: an optimizer whose
    # arithmetic could be contracted into fused multiply-adds in one program and not in the
    # other (Adam's moments) would compare the compilers' choices, not the gradients.
    opt = optax.chain(optax.trace(decay=0.0), optax.scale(-0.125))
    eng = jaxdp.DataParallel(_loss, opt, cfg, mesh=mesh)
    state = eng.init(params)
    batch = eng.shard_batch(_batch())
    metrics = []
    for _ in range(steps):
        state, m = eng.step(state, batch)
        metrics.append((float(m["loss"]), float(m["grad_norm"])))
    leaves = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]
    return eng, leaves, metrics


MODES = [
    {},
    {"grad_reduce_in_fp32": True},
    {"average_in_collective": True},
    {"deterministic_reduction": True},
    {"bucket_size": 600},
]


@pytest.mark.parametrize("dp", [8, 4])
@pytest.mark.parametrize("mode", range(len(MODES)))
@pytest.mark.parametrize(
    ("stage", "g", "param_dtype"),
    [(0, 1, None), (1, 1, "bfloat16"), (2, 2, None), (1, 2, "bfloat16"), (0, 2, "bfloat16")],
)
def test_step_bits_as_with_the_division_after_the_sum(monkeypatch, dp, mode, stage, g, param_dtype):
    """The reduced gradients of two steps (the optimizer state), the params and the metrics
    are the same bits with the divisor carried by the loss as with the reduction dividing
    (the plan told to carry none)."""
    cfg = DDPConfig(
        zero_stage=stage, num_microbatches=g, param_dtype=param_dtype, clip_grad=1.0, **MODES[mode]
    )
    mesh = jaxdp.make_mesh(jax.devices()[:dp])
    eng, got, got_m = _run(cfg, mesh, _params())
    assert eng.plan.strategy.ops.divided
    monkeypatch.setattr(plan_module, "loss_divisor", lambda *a, **kw: 1)
    ref_eng, want, want_m = _run(cfg, mesh, _params())
    assert not ref_eng.plan.strategy.ops.divided
    assert got_m == want_m
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_stage3_and_uneven_groups_divide_after_the_sum():
    mesh = jaxdp.make_mesh(jax.devices()[:6])
    for stage in (0, 1):
        eng = jaxdp.DataParallel(_loss, optax.sgd(0.1), DDPConfig(zero_stage=stage), mesh=mesh)
        eng.init(_params())
        assert not eng.plan.strategy.ops.divided
    eng = jaxdp.DataParallel(_loss, optax.sgd(0.1), DDPConfig(zero_stage=3))
    eng.init(_params())
    assert not eng.plan.strategy.ops.divided
