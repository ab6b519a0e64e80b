"""``jaxdp.testing``: the reference, the reduced gradient and the bf16 ring simulator are
themselves checked against independent computations."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss

from jaxdp import DataParallel, DDPConfig, make_mesh, ring_reduce_scatter
from jaxdp.testing import (
    Reference,
    assert_matches_reference,
    assert_trees_close,
    bf16_ring_reduce_scatter,
    reduced_gradient,
    tolerance,
)


@pytest.mark.parametrize("dp", [3, 8])
def test_bf16_ring_simulator_is_the_device_ring_bit_for_bit(dp):
    rng = np.random.default_rng(dp)
    x = (rng.standard_normal((dp, dp * 64)) * 2.0 ** rng.uniform(-6, 6, (1, dp * 64))).astype(
        ml_dtypes.bfloat16
    )
    dev = jax.vmap(
        lambda v: ring_reduce_scatter(v * jnp.asarray(1.0 / dp, v.dtype), "d", dp), axis_name="d"
    )(jnp.asarray(x))
    got = bf16_ring_reduce_scatter(x)
    np.testing.assert_array_equal(np.asarray(dev).reshape(-1).view(np.uint16), got.view(np.uint16))
    exact = x.astype(np.float64).mean(0)
    assert np.mean(got.astype(np.float64) != exact) > 0.05  # the error fp32 paths remove


def test_reference_with_one_rank_is_plain_autodiff():
    params, batch = mlp_params(), make_batch(32)
    ref = Reference(mse_loss, optax.sgd(0.5), DDPConfig(), dp=1)
    state, m = ref.step(ref.init(params), batch)
    want = jax.grad(mse_loss)(params, batch)
    assert_trees_close(m["grads"], want, rtol=tolerance(jnp.float32))
    expect = jax.tree.map(lambda p, g: p - 0.5 * g, params, want)
    assert_trees_close(ref.params(state), expect, rtol=tolerance(jnp.float32))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n,g", [(8, 2), (6, 1), (3, 4)])
def test_reduced_gradient_and_engine_match_the_reference(stage, n, g):
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=200)
    dp = DataParallel(mse_loss, optax.adam(1e-2), cfg, mesh=make_mesh(jax.devices()[:n]))
    ref = Reference(mse_loss, optax.adam(1e-2), cfg, dp=n)
    params = mlp_params()
    state, ref_state = dp.init(params), ref.init(params)
    for s in range(2):
        batch = make_batch(4 * n * g, seed=s)
        got = reduced_gradient(dp, state, batch)
        ref_state, m = ref.step(ref_state, batch)
        assert_trees_close(got, m["grads"], rtol=tolerance(jnp.float32))
        state, _ = dp.step(state, dp.shard_batch(batch))
    assert_matches_reference(dp, state, ref, ref_state)


def test_assertions_name_what_differs():
    with pytest.raises(AssertionError, match=r"params\['w'\]: relative error 1.000e-03"):
        assert_trees_close({"w": jnp.ones(4) * 1.001}, {"w": jnp.ones(4)}, rtol=1e-6, what="params")
    with pytest.raises(ValueError, match="dp=0"):
        Reference(mse_loss, optax.sgd(0.1), DDPConfig(), dp=0)


def _relu_loss(p, b):
    h = jnp.maximum(b["x"] @ p["w1"] + p["b1"], 0.0)
    return jnp.mean((h @ p["w2"] - b["y"]) ** 2)


def _relu_at_a_kink(n):
    """A ReLU model and a batch where example 0's first pre-activation is exactly one ulp of
    0.75 (6e-8) above the kink: x0 = e0, so it is w1[0, 0] + b1[0], computed exactly in any
    order; every other pre-activation is far from zero."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((4, 8)) / 2).astype(np.float32)
    b1 = (np.abs(rng.standard_normal(8)) + 0.5).astype(np.float32)
    w1[0, 0], b1[0] = -0.75, np.nextafter(np.float32(0.75), np.float32(1))
    params = {"w1": w1, "b1": b1, "w2": (rng.standard_normal((8, 1)) / 3).astype(np.float32)}
    x = rng.standard_normal((n, 4)).astype(np.float32)
    x[0] = [1, 0, 0, 0]
    return params, {"x": x, "y": np.sin(x[:, :1])}


def test_relu_at_a_kink_fails_the_trajectory_comparison_with_a_hint():
    """Two correct trajectories apart by rounding: the reference starts 2 ulps below the
    engine on b1[0] (what a few steps of reordered sums leave), which puts example 0 on the
    other side of the kink. The plain comparison fails, and says what to do instead."""
    params, batch = _relu_at_a_kink(12)
    cfg = DDPConfig(zero_stage=1)
    dp = DataParallel(_relu_loss, optax.sgd(0.1), cfg, mesh=make_mesh(jax.devices()[:6]))
    ref = Reference(_relu_loss, optax.sgd(0.1), cfg, dp=6)
    drifted = dict(params, b1=params["b1"].copy())
    drifted["b1"][0] = np.nextafter(np.nextafter(params["b1"][0], 0), 0)
    state, ref_state = dp.init(params), ref.init(drifted)
    for _ in range(3):
        assert_matches_reference(dp, state, ref, ref_state, batch=batch)  # at the engine's
        state, _ = dp.step(state, dp.shard_batch(batch))
        ref_state, _ = ref.step(ref_state, batch)
    with pytest.raises(AssertionError) as e:
        assert_matches_reference(dp, state, ref, ref_state)
    msg = str(e.value)
    assert "params['b1']" in msg or "params['w1']" in msg or "params['w2']" in msg, msg
    assert "kinks (ReLU" in msg and "batch=batch" in msg, msg


@pytest.mark.parametrize(("stage", "g"), [(0, 1), (2, 2), (3, 2)])
def test_relu_gradients_at_the_engine_params_over_several_steps(stage, g):
    params, _ = _relu_at_a_kink(12 * g)
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=20)
    dp = DataParallel(_relu_loss, optax.adam(1e-2), cfg, mesh=make_mesh(jax.devices()[:6]))
    ref = Reference(_relu_loss, optax.adam(1e-2), cfg, dp=6)
    state, ref_state = dp.init(params), ref.init(params)
    for s in range(5):
        _, batch = _relu_at_a_kink(12 * g)
        batch = jax.tree.map(lambda v, s=s: v * (1 + 0.1 * s), batch)
        assert_matches_reference(dp, state, ref, ref_state, batch=batch)
        state, _ = dp.step(state, dp.shard_batch(batch))
    # restart: the reference continues from the engine's params, step and (no) model state
    ref_state = ref.restart(ref_state, dp, state)
    assert ref_state.step == 5
    assert_matches_reference(dp, state, ref, ref_state)
