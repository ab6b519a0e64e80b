"""The example models that several scripts in bench/ share (import after the devices are set:
this imports jax and flax).

* :class:`MLP` (flax ``Dense``, float32 by default) with :func:`mse_loss` and
  :func:`regression_data`: the step-time, scaling and CPU memory benchmarks' network;
* :func:`dense_mlp_problem`: an MLP of ``jaxdp.nn.Dense`` in bf16 (gradient-accumulation fusion:
  ``bench_fusion.py``, ``gpu_fusion_kernels.py``, ``bench_gpu.py``);
* :func:`gpt_problem`: a ``jaxdp.models.GPT`` as abstract shapes (``bench_remat.py``,
  ``bench_traffic.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxdp import nn as jaxdp_nn
from jaxdp.models import GPT, GPTConfig, next_byte_loss

WIDTH, DEPTH, OUT = 512, 6, 16
BF16 = jnp.bfloat16


class MLP(nn.Module):
    width: int = WIDTH
    depth: int = DEPTH
    out: int = OUT
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.relu(nn.Dense(self.width, name=f"dense_{i}", param_dtype=self.param_dtype)(x))
        return nn.Dense(self.out, name="head", param_dtype=self.param_dtype)(x)


def mse_loss(model: nn.Module) -> Callable[[Any, Any], jax.Array]:
    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"].astype(jax.tree.leaves(params)[0].dtype))
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)

    return loss_fn


def regression_data(batch: int, width: int = WIDTH, out: int = OUT, seed: int = 0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((batch, width)).astype(np.float32),
        "y": rng.standard_normal((batch, out)).astype(np.float32),
    }


class DenseMLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = jax.nn.relu(jaxdp_nn.Dense(self.width, dtype=BF16, name=f"dense_{i}")(x))
        return x


def dense_mlp_problem(width: int, depth: int, batch: int):
    """``(loss_fn, params, data)`` of a :class:`DenseMLP` regression in bf16."""
    model = DenseMLP(width, depth)
    params = model.init(jax.random.key(0), jnp.ones((1, width)))["params"]
    rng = np.random.default_rng(0)
    data = {
        "x": rng.standard_normal((batch, width)).astype(np.float32),
        "y": rng.standard_normal((batch, width)).astype(np.float32),
    }

    def loss_fn(p, b):
        pred = model.apply({"params": p}, b["x"].astype(BF16)).astype(jnp.float32)
        return jnp.mean((pred - b["y"]) ** 2)

    return loss_fn, params, data


def gpt_problem(quick: bool, g: int, n: int = 8) -> tuple[Any, Any, Any, dict[str, Any]]:
    cfg = (
        GPTConfig(layers=2, width=128, heads=2, context=64)
        if quick
        else GPTConfig(layers=12, width=832, heads=13, context=512)
    )
    model = GPT(cfg)
    params = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, cfg.context), jnp.int32))["params"]
    )
    per_device = 2 if quick else 8  # sequences per device and micro-batch, whatever G
    batch = {"tokens": jax.ShapeDtypeStruct((n * per_device * g, cfg.context + 1), jnp.int32)}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        return next_byte_loss(model, p, b)

    what = (
        f"GPT (`jaxdp.models.GPT`) of {cfg.layers} layers x width {cfg.width}, {cfg.heads} heads, "
        f"context {cfg.context}, {per_device} sequences per device and micro-batch"
    )
    return loss_fn, params, batch, {"what": what, "bucket_size": "auto"}
