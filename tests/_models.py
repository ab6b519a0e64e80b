"""Small models and plain single-device references shared by the engine tests."""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdp import DDPConfig
from jaxdp.testing import Reference


@contextlib.contextmanager
def counting_compiles():
    """``with counting_compiles() as compiles:``: ``len(compiles)`` is the number of XLA
    compiles (``backend_compile``) run inside the block."""
    compiles: list[str] = []

    def listen(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.clear_event_listeners()


def mlp_params(seed: int = 0, sizes=(6, 16, 16, 4)):
    rng = np.random.default_rng(seed)
    params = {}
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        params[f"layer{i}"] = {
            "w": jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((b,)) * 0.1, jnp.float32),
        }
    return params


def mlp_apply(params, x):
    n = len(params)
    for i in range(n):
        p = params[f"layer{i}"]
        x = x @ p["w"].astype(x.dtype) + p["b"].astype(x.dtype)
        if i < n - 1:
            x = jnp.tanh(x)
    return x


def mse_loss(params, batch):
    pred = mlp_apply(params, batch["x"].astype(jax.tree.leaves(params)[0].dtype))
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)


def make_batch(n: int, seed: int = 1, sizes=(6, 16, 16, 4)):
    rng = np.random.default_rng(seed)
    return {
        "x": jnp.asarray(rng.standard_normal((n, sizes[0])), jnp.float32),
        "y": jnp.asarray(rng.standard_normal((n, sizes[-1])), jnp.float32),
    }


def reference_train(loss_fn, optimizer, params, batches, param_dtype=None, clip=None):
    """Plain single-device training: the gradient of the global-batch mean loss + optax
    (``jaxdp.testing.Reference`` with one rank and one micro-batch). Returns the fp32 master
    weights and each step's gradient norm."""
    cfg = DDPConfig(param_dtype=param_dtype, clip_grad=clip)
    ref = Reference(loss_fn, optimizer, cfg, dp=1)
    state, norms = ref.init(params), []
    for batch in batches:
        state, metrics = ref.step(state, batch)
        norms.append(float(metrics["grad_norm"]))
    return state.master, norms


def train_steps(dp, state, batches):
    """Run ``dp.step`` over ``batches``; returns the final state and each step's gradient norm
    (the numbers a parity test compares with :func:`reference_train`'s)."""
    norms = []
    for b in batches:
        state, m = dp.step(state, dp.shard_batch(b))
        norms.append(float(m["grad_norm"]))
    return state, norms


def capture_grads():
    """An optax transformation that stores the gradient it is given and updates nothing:
    after a step its state is that step's (reduced) gradient."""

    def init(params):
        return jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        return jax.tree.map(jnp.zeros_like, grads), grads

    return optax.GradientTransformation(init, update)


def max_rel_err(a, b):
    """Largest per-leaf relative error ||a - b|| / ||b||."""
    errs = [
        float(jnp.linalg.norm((x - y).ravel()) / jnp.linalg.norm(y.ravel()))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    ]
    return max(errs)


def scan_mlp_params(seed: int = 0, layers: int = 4, width: int = 16, sizes=(6, 4)):
    """An MLP whose hidden layers are one ``[layers, ...]`` stack run by a raw ``lax.scan``."""
    rng = np.random.default_rng(seed)

    def dense(a, b, lead=()):
        return {
            "w": jnp.asarray(rng.standard_normal((*lead, a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((*lead, b)) * 0.1, jnp.float32),
        }

    return {
        "inp": dense(sizes[0], width),
        "stack": dense(width, width, (layers,)),
        "out": dense(width, sizes[1]),
    }


def scan_mlp_loss(params, batch):
    dt = params["inp"]["w"].dtype
    x = jnp.tanh(batch["x"].astype(dt) @ params["inp"]["w"] + params["inp"]["b"])

    def layer(h, p):
        return jnp.tanh(h @ p["w"] + p["b"]), None

    x, _ = jax.lax.scan(layer, x, params["stack"])
    pred = x @ params["out"]["w"] + params["out"]["b"]
    return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2)
