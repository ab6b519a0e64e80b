"""The jitted step's host side: batch signatures and checks, abstract lowering and the NaN
report."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np

from ..core.loss import unbound_axis
from ..core.state import TrainState
from ..strategy.plan import unbound_axis_error
from ..zero3.scan import find_stacks


def warn_if_undetected(engine: Any, batch: Any) -> None:
    """First step at stage 3 without an ``example_batch`` at ``init``: warn if stacks exist.
    The engine installs it as its batch guard's first-batch hook only where the plan finds
    stacks."""
    cfg, layout = engine.config, engine.layout
    params = jax.tree_util.tree_unflatten(
        layout.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.slots]
    )
    try:
        found = find_stacks(
            engine.plain_loss,
            params,
            batch,
            1,
            num_microbatches=cfg.num_microbatches,
            param_dtype=cfg.param_dtype,
            axes=engine.group.manual_axes,
        )
    except Exception:  # detection is advice only; the step reports real errors itself
        return
    missing = [layout.slots[i].path for i in found if i not in dict(layout.stacked)]
    if missing:
        warnings.warn(
            f"DataParallel: zero_stage=3 gathers the scanned layer stacks {missing} whole, "
            "because init() got no example batch to detect them. Fix: "
            "dp.init(params, example_batch=batch) to gather them one layer per scan iteration "
            "(or mark them with scan_param_patterns in the config).",
            stacklevel=4,  # the caller of step / shard_batch
        )


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
        # The dtype the step will see: jax canonicalises NumPy's float64/int64 defaults to
        # float32/int32 (without jax_enable_x64) when it places or traces the batch, so a NumPy
        # batch given to shard_batch and the device batch it returns have one signature.
        dtype = str(dt) if key else np.dtype(jax.dtypes.canonicalize_dtype(dt)).name
        out.append((jax.tree_util.keystr(kp) or "<batch>", shape, dtype))
    return out


class BatchGuard:
    """The engine's batch checks, run on the host before a batch reaches a compiled program.

    Raises a clear error for a batch the engine cannot step on: no array leaves, leaves without
    one shared leading axis, a leading axis that is not a multiple of ``num_microbatches x dp``
    (``local``: of this process's share), or a tree, shape or dtype other than the first
    batch's. Remembers the first batch's signature and the last good batch's shapes (a batch
    shaped like it passes at once). ``first_batch``, when set, is called with the first batch
    it sees (the engine warns there about layer stacks ``init`` could not look for).
    """

    def __init__(self, num_microbatches: int, dp: int):
        self.num_microbatches, self.dp = num_microbatches, dp
        self.first_batch: Any = None
        self.signature: Any = None  # (treedef, per-example shapes and dtypes) of the first
        self.last_good: Any = None  # (local, treedef, leaf shapes/dtypes) of the last good

    def check(self, batch: Any, local: bool = False) -> None:
        """Raise ``ValueError`` for a batch the engine cannot step on (class docstring)."""
        if self.first_batch is not None:
            hook, self.first_batch = self.first_batch, None
            hook(batch)
        # Fast path (host time per step): a batch shaped like the last one that passed is valid.
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        try:
            seen = (local, treedef, tuple((x.shape, x.dtype) for x in leaves))
        except AttributeError:  # a leaf that is not an array (a list, a scalar): the full check
            seen = None
        if seen is not None and seen == self.last_good:
            return
        self._check_signature(batch, treedef, local)
        self.last_good = seen

    def _check_signature(self, batch: Any, treedef: Any, local: bool) -> None:
        sig = _batch_signature(batch)
        if not sig:
            raise ValueError(
                "DataParallel.step: the batch has no array leaves; expected a pytree of arrays "
                "whose leading axis is the global batch."
            )
        g, dp = self.num_microbatches, self.dp
        div = g * (dp // jax.process_count() if local else dp)
        lead = {s[1][0] if s[1] else None for s in sig}
        if None in lead or len(lead) != 1:
            sized = lead - {None}
            for p, sh, dt in sig:
                if not sh and dt.startswith("key<"):  # _batch_signature's typed-key dtype names
                    size = sized.pop() if len(sized) == 1 else "global_batch"
                    raise ValueError(
                        f"DataParallel.step: batch leaf {p} is a single PRNG key (shape (), "
                        f"dtype {dt}); expected one key per example along the batch's leading "
                        "axis (a scalar has no batch axis to split over the devices). Fix: "
                        f"split it, e.g. jax.random.split(key, {size}), and jax.vmap over the keys "
                        "in loss_fn. (For dropout, init(params, rng=key) hands loss_fn a fresh "
                        "key every step instead: loss_fn(params, batch, *, rng).)"
                    )
            raise ValueError(
                "DataParallel.step: every batch leaf must share one leading (batch) axis; got "
                f"shapes {[(p, sh) for p, sh, _ in sig]}. Fix: stack examples along axis 0."
            )
        n = lead.pop()
        assert n is not None
        if n % div or n == 0:
            raise ValueError(
                f"DataParallel.step: the batch's leading dimension is {n}; expected a positive "
                f"multiple of num_microbatches x dp = {g} x "
                f"{div // g} = {div}. Fix: use a global batch of "
                f"{max(div, n // div * div)} (or {(n // div + 1) * div})."
            )
        rest = [(p, sh[1:], dt) for p, sh, dt in sig]
        if self.signature is None:
            self.signature = (treedef, rest)
            return
        want_def, want_rest = self.signature
        if treedef != want_def:
            raise ValueError(
                f"DataParallel.step: the batch's tree structure {treedef} differs from the first "
                f"batch's {want_def}. Fix: keep the same keys in every batch."
            )
        for (p, shape, dt), (_, wshape, wdt) in zip(rest, want_rest, strict=True):
            if shape != wshape or dt != wdt:
                raise ValueError(
                    f"DataParallel.step: batch leaf {p} has per-example shape {shape} and dtype "
                    f"{dt}; expected {wshape} and {wdt} as in the first batch. Fix: pad or cast "
                    "the batch (a new shape would also force a recompilation)."
                )


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


def _explain_trace_error(eng: Any, batch: Any, err: Exception) -> None:
    """Raise a ``ValueError`` naming the axis when the step's first trace failed because
    ``loss_fn`` runs a collective over an axis name the step does not bind (return otherwise,
    and the caller re-raises ``err``). Runs only after a failed trace: no cost per step."""
    cfg = eng.config
    axes = {a: int(eng.mesh.shape[a]) for a in eng.group.manual_axes}
    abstract = eng.abstract_state
    name = unbound_axis(
        eng.loss_fn,
        eng.loss_call,
        eng.work_params,
        batch,
        None if abstract is None else abstract.model_state,
        None if abstract is None else abstract.rng,
        axes,
        cfg.num_microbatches,
    )
    if name is None or name in axes:
        return
    raise unbound_axis_error("DataParallel.step", name, tuple(axes), cfg.data_axis) from err


class Step:
    """The jitted step plus the host-side checks (batch validation, NaN report)."""

    def __init__(self, engine: Any, jitted: Any):
        self._engine = engine
        self._jitted = jitted

    def lower(
        self, state: TrainState, batch: Any, *, lowering_platforms: tuple[str, ...] | None = None
    ) -> Any:
        """``jax.jit(...).lower`` of the step, for inspection and AOT compilation.

        ``state`` and ``batch`` may be abstract (``jax.eval_shape(dp.init, params)`` and
        ``jax.ShapeDtypeStruct`` batches): leaves without a sharding get the engine's own, so
        the program (donation, memory analysis) is the one ``step`` runs.
        ``lowering_platforms``: lower for these platforms instead of the mesh's
        (``jaxdp.aot.cross_compile_step``).
        """
        eng = self._engine
        eng.batch_guard.check(batch)
        state = jax.tree.map(_with_sharding, state, eng.state_shardings)
        batch_sharding = eng.batch_sharding
        batch = jax.tree.map(lambda x: _with_sharding(x, batch_sharding), batch)
        try:
            if lowering_platforms is not None:
                traced = self._jitted.trace(state, batch)
                return traced.lower(lowering_platforms=lowering_platforms)
            return self._jitted.lower(state, batch)
        except (AssertionError, NameError) as e:
            _explain_trace_error(eng, batch, e)
            raise

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        eng = self._engine
        if eng.donate:
            _check_not_donated(state)
        eng.batch_guard.check(batch)
        try:
            new_state, metrics = self._jitted(state, batch)
        except (AssertionError, NameError) as e:  # raised by the trace, before compiling
            _explain_trace_error(eng, batch, e)
            raise
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
