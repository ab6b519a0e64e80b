"""Assertions that an engine matches its :class:`~jaxdp.testing.Reference`, and the reduced
gradient of one engine step."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np

from .. import TrainState
from ._reference import Reference, ReferenceState

__all__ = ["assert_matches_reference", "assert_trees_close", "reduced_gradient", "tolerance"]


def tolerance(dtype: Any, factor: float = 8.0) -> float:
    """The relative tolerance for values computed in ``dtype`` in two summation orders:
    ``factor`` units of roundoff (``factor * finfo(dtype).eps``; 8 covers the reordered
    reductions of a data-parallel step). fp32: 9.5e-7; bf16: 0.0625.

    Example:
        >>> import jax.numpy as jnp
        >>> f"{tolerance(jnp.float32):.2e}"
        '9.54e-07'
    """
    return float(factor * jnp.finfo(jnp.dtype(dtype)).eps)


def assert_trees_close(actual: Any, expected: Any, *, rtol: float, what: str = "tree") -> None:
    """Assert two pytrees of arrays have one structure and shapes, and that every leaf's
    norm-wise relative error ``||a - e|| / ||e||`` is at most ``rtol`` (``||a - e|| <= rtol``
    for a zero leaf). Errors name the leaf and its error.

    Example:
        >>> import jax.numpy as jnp
        >>> assert_trees_close({"w": jnp.ones(3)}, {"w": jnp.ones(3) * (1 + 1e-8)}, rtol=1e-6)
    """
    chex.assert_trees_all_equal_shapes(actual, expected)
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (kp, e), a in zip(flat, jax.tree.leaves(actual), strict=True):
        a64, e64 = np.asarray(a, np.float64), np.asarray(e, np.float64)
        scale = float(np.linalg.norm(e64.ravel())) or 1.0
        err = float(np.linalg.norm((a64 - e64).ravel())) / scale
        if not err <= rtol:
            raise AssertionError(
                f"{what}{jax.tree_util.keystr(kp)}: relative error {err:.3e} > rtol {rtol:.3e} "
                f"(shape {e64.shape})."
            )


def assert_matches_reference(
    engine: Any,
    state: TrainState,
    reference: Reference,
    ref_state: ReferenceState,
    *,
    rtol: float | None = None,
    batch: Any = None,
) -> None:
    """Assert that an engine's state matches the reference's after the same steps: the step
    count, the params (``engine.params(state)``, from the fp32 master) and the model state.

    With ``batch``, assert instead that the reduced gradient of the engine's next step on
    ``batch`` (:func:`reduced_gradient`) matches the reference's gradient *at the engine's own
    params* (``reference.restart(ref_state, engine, state)``, then one reference step from the
    engine's params, model state and step count). Call it before each engine step: each
    comparison measures that step's error alone. Use it for models with kinks (ReLU,
    max-pooling, clipping) over several steps, where params that differ by rounding put a
    pre-activation within rounding of a kink on different sides and the plain comparison
    fails on a correct engine (a pre-activation 3e-7 from zero gave a 1e-2 gradient
    difference after 5 fp32 steps). ``state`` is not changed.

    ``rtol`` defaults to :func:`tolerance` of the dtype the step computes in
    (``config.param_dtype``, else the params' dtype): the master weights' error comes from the
    gradients, which are computed in it.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> from jaxdp.testing import Reference, assert_matches_reference
        >>> def loss_fn(p, b):
        ...     return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> cfg = DDPConfig(zero_stage=1)
        >>> dp = DataParallel(loss_fn, optax.adam(1e-2), cfg)
        >>> ref = Reference(loss_fn, optax.adam(1e-2), cfg, dp=dp.dp)
        >>> params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)}
        >>> state, ref_state = dp.init(params), ref.init(params)
        >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 3))}
        >>> state, _ = dp.step(state, dp.shard_batch(batch))
        >>> ref_state, _ = ref.step(ref_state, batch)
        >>> assert_matches_reference(dp, state, ref, ref_state)
    """
    if rtol is None:
        dts = {jnp.dtype(d) for d in jax.tree.leaves(ref_state.dtypes)}
        dt = engine.config.param_dtype or max(dts, key=lambda d: jnp.finfo(d).eps)
        rtol = tolerance(dt)
    if batch is not None:
        start = reference.restart(ref_state, engine, state)
        _, metrics = reference.step(start, jax.device_get(batch))
        got_grads = reduced_gradient(engine, state, batch)
        assert_trees_close(got_grads, metrics["grads"], rtol=rtol, what="grads")
        return
    got = int(np.asarray(state.step))
    if got != ref_state.step:
        raise AssertionError(
            f"step: the engine is at step {got}, the reference at {ref_state.step}."
        )
    try:
        assert_trees_close(
            engine.params(state), reference.params(ref_state), rtol=rtol, what="params"
        )
    except AssertionError as e:
        if got <= 1:
            raise
        raise AssertionError(
            f"{e} After {got} steps: if the model has kinks (ReLU, max-pooling, clipping), "
            "params that differ by rounding can put a pre-activation on different sides of "
            "one, and a correct engine then fails this comparison. Compare each step's "
            "gradient at the engine's own params instead: call "
            "assert_matches_reference(engine, state, reference, ref_state, batch=batch) "
            "before each engine step (docs/loss-contract.md, 'Testing your model')."
        ) from None
    ms, want = engine.model_state(state), ref_state.model_state
    if (ms is None) != (want is None):
        raise AssertionError(
            f"model_state: the engine's is {'None' if ms is None else 'set'}, the "
            f"reference's is {'None' if want is None else 'set'}: give both init calls one."
        )
    if ms is not None:
        assert_trees_close(ms, want, rtol=rtol, what="model_state")


def reduced_gradient(engine: Any, state: TrainState, batch: Any) -> Any:
    """The reduced fp32 gradient one step of ``engine`` would hand the optimizer (before
    clipping), as whole params-shaped arrays, at any ZeRO stage; ``state`` is not changed.

    ``batch`` is a global batch (placed with ``engine.shard_batch`` if it is not yet).

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> from jaxdp.testing import reduced_gradient
        >>> def loss_fn(p, b):
        ...     return jnp.mean(b["x"] @ p["w"])
        >>> dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=2), donate=False)
        >>> state = dp.init({"w": jnp.zeros((2, 1))})
        >>> g = reduced_gradient(dp, state, {"x": jnp.ones((8, 2))})
        >>> g["w"].ravel().tolist()
        [1.0, 1.0]
    """
    strategy, call = engine.plan.strategy, engine.loss_call
    placed = all(
        isinstance(x, jax.Array) and not x.is_fully_addressable for x in jax.tree.leaves(batch)
    )
    if not placed:  # a global array spanning processes is already placed
        batch = engine.shard_batch(batch)

    def grads(st: TrainState, b: Any) -> Any:
        key = jax.random.fold_in(st.rng, st.step) if call.rng else None
        g, _, _ = strategy.local_step(engine.loss_fn, st.params, b, call, st.model_state, key)
        return strategy.master_codec.from_view(g)

    return jax.jit(grads)(state, batch)
