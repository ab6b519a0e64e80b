"""A seeded sweep over DDPConfig combinations, each engine held to ``jaxdp.testing.Reference``.

The parametrized suites vary one or two fields at a time; this draws whole configurations
(stage, micro-batches, working dtype, wire precision, averaging, clipping, bucket size and
layout, padding, gather overlap, NaN check, deterministic reduction) on odd device counts and a
model with awkward shapes: a scalar parameter, sizes that do not divide dp. Draws the config
refuses are redrawn, and must be refused for a documented reason. Sweeps like this one found
the scalar parameter that stages 1-3 refused.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdp
from jaxdp import DataParallel, DDPConfig
from jaxdp.testing import Reference, assert_matches_reference, tolerance

# Refusals DDPConfig documents for combinations that make no sense (the sweep draws them too).
REFUSALS = (
    "expected a distributed optimizer",
    "expected a SUM reduction",
    "expected low-precision gradients",
)


def loss_fn(p, b):
    h = jnp.tanh(b["x"] @ p["w1"].astype(b["x"].dtype) + p["b1"].astype(b["x"].dtype))
    y = h @ p["w2"].astype(h.dtype) * p["scale"].astype(h.dtype) + p["b2"].astype(h.dtype)
    return jnp.mean((y.astype(jnp.float32) - b["y"]) ** 2)


def params():
    k = jax.random.key(0)
    return {
        "w1": jax.random.normal(k, (5, 7)) * 0.5,
        "b1": jnp.full((7,), 0.1),
        "w2": jax.random.normal(jax.random.fold_in(k, 1), (7, 3)) * 0.5,
        "scale": jnp.asarray(1.3),  # shape (): a learnable temperature
        "b2": jnp.zeros((3,)),
    }


def draw(seed):
    r = random.Random(seed)
    stage = r.choice([0, 1, 2, 3])
    cfg = dict(
        zero_stage=stage,
        num_microbatches=r.choice([1, 2, 3]),
        param_dtype=r.choice([None, None, "bfloat16"]),
        grad_reduce_in_fp32=r.random() < 0.4,
        average_in_collective=r.random() < 0.3,
        clip_grad=r.choice([None, 0.5]),
        bucket_size=r.choice([None, 20, 60, "auto"]),
        pad_buckets_for_high_nccl_busbw=r.random() < 0.3,
        check_for_nan_in_grad=r.random() < 0.3,
        bucket_layout=r.choice(["interleaved", "interleaved", "megatron"]),
        overlap_param_gather=r.random() < 0.25,
        deterministic_reduction=r.random() < 0.2,
    )
    if cfg["grad_reduce_in_fp32"] and r.random() < 0.5:
        cfg.update(grad_reduce_in_fp32=False, reduce_scatter_with_fp32_accumulation=True)
    return r.choice([3, 6, 8]), cfg


def accepted(seed):
    """The first draw DDPConfig accepts; the ones before it must be refused as documented."""
    for k in range(100):
        dp, kw = draw(100 * seed + k)
        try:
            return dp, DDPConfig(**kw)
        except ValueError as e:
            assert any(reason in str(e) for reason in REFUSALS), e
    raise AssertionError("no accepted draw")


@pytest.mark.parametrize("seed", range(10))
def test_drawn_config_matches_reference(seed):
    dp, cfg = accepted(seed)
    print(f"dp={dp}", cfg)  # shown with a failure
    opt = optax.adamw(1e-2, weight_decay=0.01)
    engine = DataParallel(loss_fn, opt, cfg, mesh=jaxdp.make_mesh(jax.devices()[:dp]))
    ref = Reference(loss_fn, opt, cfg, dp=dp)
    state, ref_state = engine.init(params()), ref.init(params())
    n = dp * cfg.num_microbatches * 2
    for s in range(2):
        k = jax.random.key(100 + s)
        batch = {
            "x": jax.random.normal(k, (n, 5)),
            "y": jax.random.normal(jax.random.fold_in(k, 1), (n, 3)),
        }
        state, metrics = engine.step(state, engine.shard_batch(batch))
        ref_state, ref_metrics = ref.step(ref_state, batch)
    assert_matches_reference(engine, state, ref, ref_state)
    rtol = tolerance(cfg.param_dtype or jnp.float32)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=rtol)
