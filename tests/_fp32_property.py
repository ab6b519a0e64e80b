"""Shared helpers for the FP32-accumulation property: "the reduced gradient is the correctly
rounded bf16 mean of the ranks' bf16 gradients".

Used in-process by ``tests/test_fp32_accumulation.py`` and, for device counts beyond the 8
simulated devices, by the subprocess ``tests/mp/fp32_engine.py``.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

from jaxdp import DataParallel, DDPConfig, make_mesh

BF16 = ml_dtypes.bfloat16

# Every fp32 mode the engine offers, with the micro-batch counts the property holds for. At
# stages 0-1 the bf16 wire of reduce_scatter_with_fp32_accumulation carries the fp32 sum of
# the G micro-batches rounded to bf16 once, so with G > 1 the result is no longer the correctly
# rounded mean of the G * dp gradients (Megatron has the same limit): tested at G = 1. Stage 2
# sends each micro-batch's bf16 gradient unscaled (exact) and sums in fp32: G = 3 holds too.
ENGINE_MODES = {
    "s0-fp32wire": (dict(zero_stage=0, grad_reduce_in_fp32=True), (1, 3)),
    "s1-fp32wire": (dict(zero_stage=1, grad_reduce_in_fp32=True), (1, 3)),
    "s2-fp32wire": (dict(zero_stage=2, grad_reduce_in_fp32=True), (1, 3)),
    "s1-a2a": (dict(zero_stage=1, reduce_scatter_with_fp32_accumulation=True), (1,)),
    "s2-a2a": (dict(zero_stage=2, reduce_scatter_with_fp32_accumulation=True), (1, 3)),
    "s1-a2a-megatron": (
        dict(zero_stage=1, reduce_scatter_with_fp32_accumulation=True, bucket_layout="megatron"),
        (1,),
    ),
    "s0-deterministic": (dict(zero_stage=0, deterministic_reduction=True), (1,)),
    "s1-deterministic": (dict(zero_stage=1, deterministic_reduction=True), (1,)),
}


def bf16_values(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Gradients of mixed magnitudes (eight binades), exactly representable in bf16."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp2(rng.uniform(-4, 4, shape[1:]))
    return x.astype(np.float32).astype(BF16)


def engine_reduced_gradient(mode: str, dp: int, g: int, n: int, devices=None) -> tuple:
    """Run one DataParallel step whose reduced gradient is recoverable from the exported params.

    ``loss(w, x) = sum(w * x)`` per example, so each example's gradient is its ``x``; SGD with
    learning rate 1 from zero fp32 master weights leaves ``-grad`` in the master copy, and
    ``params()`` hands it back rounded to the params' bf16 dtype. Returns ``(grad_bf16, x)``
    with ``x`` the ``[dp * g, n]`` per-example gradients.
    """
    kwargs, _ = ENGINE_MODES[mode]
    cfg = DDPConfig(num_microbatches=g, bucket_size=None, **kwargs)
    mesh = make_mesh(devices)
    assert mesh.shape["data"] == dp

    def loss_fn(params, batch):
        w = params["w"].astype(jnp.float32)
        return jnp.mean(jnp.sum(w[None] * batch["x"].astype(jnp.float32), axis=-1))

    engine = DataParallel(loss_fn, optax.sgd(1.0), cfg, mesh=mesh)
    state = engine.init({"w": jnp.zeros((n,), jnp.bfloat16)})
    x = bf16_values((dp * g, n), seed=1000 * dp + g)
    # Global batch order: rank-major, micro-batch minor (rank r's slice holds its G examples).
    state, _ = engine.step(state, engine.shard_batch({"x": jnp.asarray(x)}))
    grad = -np.asarray(engine.params(state)["w"]).astype(np.float64)
    return grad, x
