"""The jitted step's host side: batch signatures, abstract lowering and the NaN report."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ._state import TrainState


def _batch_signature(batch: Any) -> list[tuple[str, tuple[int, ...], str]]:
    out = []
    for kp, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        # Read shape/dtype from the array itself: np.asarray would copy a device array to the
        # host on every step, and fails for arrays that span other processes' devices.
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            leaf = np.asarray(leaf)
        shape = tuple(leaf.shape)
        # Typed PRNG keys (jax.random.key) have a dtype numpy cannot interpret: key<fry>.
        dt = leaf.dtype
        key = not isinstance(dt, np.dtype) and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        dtype = str(dt) if key else np.dtype(dt).name
        out.append((jax.tree_util.keystr(kp) or "<batch>", shape, dtype))
    return out


def _with_sharding(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x


def _check_not_donated(state: Any) -> None:
    """Raise if ``state`` was donated to an earlier step (a donating jit segfaults on it).

    A step donates the whole state at once, so every leaf of a donated state is deleted; the
    ``step`` counter stands for all of them (one attribute read and one C++ call per step;
    checking every leaf would cost a tree flatten, ~0.25 us per leaf). A state assembled by hand
    from a live ``step`` and another state's donated leaves is not caught.
    """
    step = getattr(state, "step", None)
    try:
        deleted = step.is_deleted()  # type: ignore[union-attr]
    except AttributeError:  # not a jax.Array (a tracer, numpy, a foreign pytree)
        return
    if deleted:
        raise ValueError(
            "DataParallel.step: state was donated to an earlier step (its buffers are deleted: "
            "state.step.is_deleted() is True); a donated state cannot be passed again. Fix: use "
            "the state returned by that step (state, metrics = dp.step(state, batch)), keep a "
            "copy before stepping (jax.tree.map(jnp.copy, state)), or build the engine with "
            "DataParallel(..., donate=False)."
        )


class _Step:
    """The jitted step plus the host-side checks (batch validation, NaN report)."""

    def __init__(self, engine: Any, jitted: Any):
        self._engine = engine
        self._jitted = jitted

    def lower(self, state: TrainState, batch: Any) -> Any:
        """``jax.jit(...).lower`` of the step, for inspection and AOT compilation.

        ``state`` and ``batch`` may be abstract (``jax.eval_shape(dp.init, params)`` and
        ``jax.ShapeDtypeStruct`` batches): leaves without a sharding get the engine's own, so
        the program (donation, memory analysis) is the one ``step`` runs.
        """
        eng = self._engine
        eng._check_batch(batch)
        state = jax.tree.map(_with_sharding, state, eng._shardings)
        batch_sharding = eng._sharding(eng.group.batch_spec())
        batch = jax.tree.map(lambda x: _with_sharding(x, batch_sharding), batch)
        return self._jitted.lower(state, batch)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        eng = self._engine
        if eng.donate:
            _check_not_donated(state)
        eng._check_batch(batch)
        new_state, metrics = self._jitted(state, batch)
        if eng.config.check_for_nan_in_grad:
            bad = np.asarray(metrics.pop("nonfinite_ranks"))
            if bad.any():
                paths = [eng.layout.slots[i].path for i in np.flatnonzero(bad)]
                err = FloatingPointError(
                    f"DataParallel.step: NaN or Inf in the local gradients of {paths} at step "
                    f"{int(np.asarray(new_state.step))} (on {int(bad.max())} of {eng.dp} "
                    "ranks), found before the reduction. "
                    "The update was skipped; the last good state is in this exception's "
                    "`.state` attribute (the input state was donated)."
                )
                err.state = new_state  # type: ignore[attr-defined]
                err.paths = paths  # type: ignore[attr-defined]
                raise err
        return new_state, metrics
