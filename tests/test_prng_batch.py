"""Typed PRNG keys in a batch: one key per example, sharded like any other leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import make_batch, max_rel_err, mlp_apply, mlp_params, reference_train

from jaxdp import DataParallel, DDPConfig

RATE = 0.5


def dropout_loss(params, batch):
    """Input dropout with each example's own key (the mask depends only on that key)."""
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1 - RATE, (6,)))(batch["key"])
    x = jnp.where(keep, batch["x"] / (1 - RATE), 0.0)
    return jnp.mean((mlp_apply(params, x) - batch["y"]) ** 2)


def key_batches(n=32, steps=2):
    out = []
    for s in range(steps):
        b = make_batch(n, seed=s)
        b["key"] = jax.random.split(jax.random.key(s), n)
        out.append(b)
    return out


@pytest.mark.parametrize("g", [1, 2])
@pytest.mark.parametrize("stage", [0, 1])
def test_per_example_keys_match_one_device(stage, g):
    batches = key_batches()
    opt = optax.sgd(0.1)
    dp = DataParallel(dropout_loss, opt, DDPConfig(zero_stage=stage, num_microbatches=g))
    state = dp.init(mlp_params())
    for b in batches:
        sharded = dp.shard_batch(b)
        assert sharded["key"].dtype == b["key"].dtype
        assert sharded["key"].sharding.spec == jax.sharding.PartitionSpec("data")
        state, _ = dp.step(state, sharded)
    ref, _ = reference_train(dropout_loss, opt, mlp_params(), batches)
    # fp32 sums over 32 examples in another order: a few dozen ulps of relative error.
    tol = 64 * float(jnp.finfo(jnp.float32).eps)
    assert max_rel_err(dp.params(state), ref) < tol
    # The keys matter: other keys, other masks, other params.
    other = [dict(b, key=jax.random.split(jax.random.key(9), 32)) for b in batches]
    ref_other, _ = reference_train(dropout_loss, opt, mlp_params(), other)
    assert max_rel_err(ref_other, ref) > 1e3 * tol


def test_abstract_key_batch_lowers():
    dp = DataParallel(dropout_loss, optax.sgd(0.1), DDPConfig(zero_stage=1, num_microbatches=2))
    state = jax.eval_shape(dp.init, mlp_params())
    batch = jax.eval_shape(lambda: key_batches(steps=1)[0])
    assert "key<fry>" in str(batch["key"].dtype)
    dp.step.lower(state, batch)


def test_a_single_key_is_rejected_with_the_fix():
    dp = DataParallel(dropout_loss, optax.sgd(0.1), DDPConfig())
    state = dp.init(mlp_params())
    batch = dict(make_batch(32), key=jax.random.key(0))
    msg = (
        r"DataParallel\.step: batch leaf \['key'\] is a single PRNG key \(shape \(\), dtype "
        r"key<fry>\); expected one key per example along the batch's leading axis \(a scalar "
        r"has no batch axis to split over the devices\)\. Fix: split it, e\.g\. "
        r"jax\.random\.split\(key, 32\), and jax\.vmap over the keys in loss_fn\."
    )
    with pytest.raises(ValueError, match=msg):
        dp.shard_batch(batch)
    with pytest.raises(ValueError, match=msg):
        dp.step(state, batch)
    # Scalars of other dtypes have no batch axis either (unchanged).
    with pytest.raises(ValueError, match="share one leading"):
        dp.step(state, dict(make_batch(32), t=jnp.float32(1.0)))
    assert np.asarray(state.step) == 0


def test_two_processes_shard_keys(tmp_path):
    import os

    from test_multiprocess import free_port, run_workers

    worker = os.path.join(os.path.dirname(__file__), "mp", "key_worker.py")
    port = free_port()
    run_workers([[worker, str(i), str(port), str(tmp_path)] for i in (0, 1)])
    ref, _ = reference_train(dropout_loss, optax.sgd(0.1), mlp_params(), key_batches())
    want = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(ref)])
    tol = 64 * float(jnp.finfo(jnp.float32).eps)
    for i in range(2):
        got = np.load(tmp_path / f"params_{i}.npy")
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol
