"""Spikes skipped, not absorbed (DDPConfig.grad_norm_skip_threshold, check_for_large_grads).

A skipped step returns its input state bit for bit (params, master copy, optimizer state, model
state, gradient-norm history, step counter), so [b1, spike, nan, b2] ends where [b1, b2] does,
at every ZeRO stage; a one-layer spike after normal steps is caught by the bucket that holds
the layer; normal training skips nothing; the history survives a checkpoint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxdp import CheckpointManager, DataParallel, DDPConfig, make_mesh

DP = 6  # not a power of two


def _params():
    rng = np.random.default_rng(0)
    return {
        "a": {
            "w": jnp.asarray(rng.standard_normal((8, 8)) / 3, jnp.float32),
            "b": jnp.zeros(8),
        },
        "c": {"w": jnp.asarray(rng.standard_normal((8, 4)) / 3, jnp.float32)},
    }


def _loss(p, b):
    h = jnp.tanh(b["x"] @ p["a"]["w"] + p["a"]["b"]) @ p["c"]["w"]
    # b["s"] != 0 pushes a gradient of its size into layer c alone
    return jnp.mean((h - b["y"]) ** 2) + jnp.mean(b["s"]) * jnp.sum(p["c"]["w"])


def _batch(seed, s=0.0, nan=False, n=24):
    r = np.random.default_rng(seed)
    x = r.standard_normal((n, 8)).astype(np.float32)
    if nan:
        x[3, 2] = np.nan
    return {
        "x": jnp.asarray(x),
        "y": jnp.asarray(r.standard_normal((n, 4)), jnp.float32),
        "s": jnp.full((n,), s, jnp.float32),
    }


def _engine(**kw):
    mesh = make_mesh(devices=jax.devices()[:DP])
    cfg = DDPConfig(**{"bucket_size": 40, **kw})
    return DataParallel(_loss, optax.adamw(1e-2), cfg, mesh=mesh)


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb, strict=True))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("g", [1, 2])
def test_spike_and_nan_are_skipped_bit_exactly(stage, g):
    dp = _engine(
        zero_stage=stage,
        num_microbatches=g,
        grad_norm_skip_threshold=50.0,
        check_for_large_grads=True,
    )
    run = dp.init(_params())
    ref = dp.init(_params())
    skipped = []
    for b in (_batch(1), _batch(2, s=1e3), _batch(3, nan=True), _batch(4)):
        run, m = dp.step(run, dp.shard_batch(b))
        skipped.append(int(m["skipped"]))
    assert skipped == [0, 1, 1, 0]
    for b in (_batch(1), _batch(4)):
        ref, _ = dp.step(ref, dp.shard_batch(b))
    assert int(run.step) == int(ref.step) == 2
    assert _same(run, ref)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_one_layer_spike_names_its_bucket(stage):
    """Only check_for_large_grads: 30 normal steps, then a 1e4x gradient in layer c."""
    dp = _engine(zero_stage=stage, num_microbatches=2, check_for_large_grads=True)
    state = dp.init(_params())
    for i in range(30):
        state, m = dp.step(state, dp.shard_batch(_batch(10 + i)))
        assert int(m["skipped"]) == 0 and int(m["large_grad_bucket"]) == -1
    before = jax.tree.map(jnp.copy, state)  # the step donates its input
    norm = float(m["grad_norm"])
    state, m = dp.step(state, dp.shard_batch(_batch(99, s=1e4 * norm)))
    assert int(m["skipped"]) == 1
    bucket = dp.layout.buckets[int(m["large_grad_bucket"])]
    assert "c/w" in bucket.param_paths, bucket.param_paths
    assert _same(state, before)
    history, count = state.grad_history
    assert history.shape == (len(dp.layout.buckets), 100) and int(count) == 30


def test_normal_training_skips_nothing():
    """300 normal steps with both checks on: nothing skipped, and the history wraps."""
    dp = _engine(zero_stage=1, grad_norm_skip_threshold=100.0, check_for_large_grads=True)
    state = dp.init(_params())
    batches = [dp.shard_batch(_batch(i)) for i in range(20)]
    skipped = 0
    for i in range(300):
        state, m = dp.step(state, batches[i % len(batches)])
        skipped += int(m["skipped"])  # read every step: keeps XLA:CPU's collectives in step
    assert skipped == 0
    assert int(state.grad_history[1]) == 300 and int(state.step) == 300


def test_metrics_only_with_a_check():
    dp = _engine(zero_stage=1)
    state = dp.init(_params())
    state, m = dp.step(state, dp.shard_batch(_batch(1)))
    assert "skipped" not in m and "large_grad_bucket" not in m
    assert state.grad_history is None
    dp = _engine(zero_stage=1, grad_norm_skip_threshold=10.0)
    state = dp.init(_params())
    _, m = dp.step(state, dp.shard_batch(_batch(1)))
    assert int(m["skipped"]) == 0 and "large_grad_bucket" not in m


def test_history_survives_a_checkpoint(tmp_path):
    dp = _engine(zero_stage=2, check_for_large_grads=True)
    state = dp.init(_params())
    for i in range(3):
        state, _ = dp.step(state, dp.shard_batch(_batch(i)))
    mngr = CheckpointManager(tmp_path / "ckpt", dp)
    mngr.save(3, state)
    mngr.wait_until_finished()
    restored = CheckpointManager(tmp_path / "ckpt", dp).restore()
    assert _same(restored.grad_history, state.grad_history)
    # another ZeRO stage, same buckets: kept; another bucket layout: started afresh
    other = _engine(zero_stage=1, check_for_large_grads=True)
    other.init(_params())
    kept = CheckpointManager(tmp_path / "ckpt", other).restore()
    assert _same(kept.grad_history, state.grad_history)
    rebucketed = _engine(zero_stage=2, check_for_large_grads=True, bucket_size=None)
    rebucketed.init(_params())
    fresh = CheckpointManager(tmp_path / "ckpt", rebucketed).restore()
    assert int(fresh.grad_history[1]) == 0
    assert fresh.grad_history[0].shape == (len(rebucketed.layout.buckets), 100)
    # an engine without the check restores the rest and drops the history
    plain = _engine(zero_stage=2)
    plain.init(_params())
    assert CheckpointManager(tmp_path / "ckpt", plain).restore().grad_history is None


@pytest.mark.parametrize(
    ("value", "exc"),
    [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), (True, TypeError)],
)
def test_bad_threshold_names_the_field(value, exc):
    with pytest.raises(exc, match=r"DDPConfig\.grad_norm_skip_threshold: got"):
        DDPConfig(grad_norm_skip_threshold=value)
    with pytest.raises(TypeError, match=r"DDPConfig\.check_for_large_grads"):
        DDPConfig(check_for_large_grads="yes")
