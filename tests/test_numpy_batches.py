"""NumPy batches (float64 / int64, NumPy's defaults) step as the float32 / int32 arrays jax
makes of them: through ``shard_batch`` or straight into ``step``, at every ZeRO stage."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp import DataParallel, DDPConfig, make_mesh


def _loss(p, b):
    logits = jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((5, 7)) / 3, jnp.float32),
        "w2": jnp.asarray(rng.standard_normal((7, 3)) / 3, jnp.float32),
    }


def _numpy_batch(seed, n):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 5)), "y": rng.integers(0, 3, n)}  # float64, int64


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_numpy_batches_step_as_their_jax_arrays(stage, g):
    mesh = make_mesh(jax.devices()[:6])
    cfg = DDPConfig(zero_stage=stage, num_microbatches=g, bucket_size=20)
    want = DataParallel(_loss, optax.adam(1e-2), cfg, mesh=mesh)
    got = DataParallel(_loss, optax.adam(1e-2), cfg, mesh=mesh)
    s_want, s_got = want.init(_params()), got.init(_params())
    batches = [_numpy_batch(s, 6 * g * 2) for s in range(3)]
    assert batches[0]["x"].dtype == np.float64 and batches[0]["y"].dtype == np.int64
    for i, b in enumerate(batches):
        s_want, m_want = want.step(s_want, want.shard_batch(jax.tree.map(jnp.asarray, b)))
        # every path a user's loop takes: NumPy through shard_batch, NumPy straight into
        # step, and jax arrays after NumPy ones (one engine, so the signatures must agree)
        feed = [got.shard_batch(b), b, jax.tree.map(jnp.asarray, b)][i]
        s_got, m_got = got.step(s_got, feed)
        np.testing.assert_array_equal(m_got["loss"], m_want["loss"])
    for a, e in zip(jax.tree.leaves(got.params(s_got)), jax.tree.leaves(want.params(s_want))):
        np.testing.assert_array_equal(a, e)


def test_a_real_dtype_change_is_still_an_error():
    dp = DataParallel(_loss, optax.sgd(0.1), DDPConfig(), mesh=make_mesh(jax.devices()[:2]))
    state = dp.init(_params())
    b = _numpy_batch(0, 4)
    state, _ = dp.step(state, dp.shard_batch(b))
    bad = {"x": jnp.asarray(b["x"], jnp.bfloat16), "y": b["y"]}
    with pytest.raises(ValueError, match=r"\['x'\] .*dtype bfloat16; expected \(5,\) and float32"):
        dp.step(state, dp.shard_batch(bad))
