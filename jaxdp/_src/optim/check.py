"""Check, before anything compiles, that an optax optimizer can run on sharded parameters.

With a distributed optimizer (ZeRO >= 1, interleaved layout) the optimizer sees, per parameter,
the flattened tensor zero-padded to a multiple of ``dp`` and sharded over the data axis. Any
elementwise transformation (sgd, momentum, adam, adamw, lion, schedules, masks given as pytrees)
and any that uses whole-tensor norms (global-norm clipping, LAMB's trust ratio: zero padding
does not change a norm) gives the same result as on the unsharded params. Transformations that
depend on a tensor's shape (factored Adafactor) or on its element count (RMS or mean statistics,
which padding changes) do not, and neither do masks computed from ``ndim``. Two checks catch them:

1. structure: ``optimizer.init`` on the real shapes and on the sharded view must give the same
   state tree, leaf for leaf (shape-dependent state such as factored moments differs);
2. numbers: a few steps on small probe tensors (every dimension ``dp + 1``, so padding occurs)
   must agree between the view and the plain tensors. ``init`` and one step are traced once per
   tree and evaluated with NumPy (:mod:`jaxdp._src.optim.host_eval`), which compiles nothing: op by
   op
   through jax, the probe of a 10-parameter AdamW took 1 s in a fresh process, twice the
   plain-``jit`` step's whole compile.
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ..layout.layout import BucketLayout
from .host_eval import evaluate
from .known import known_elementwise

__all__ = ["check_optimizer"]

_WHY = (
    "with zero_stage >= 1 each rank updates its 1-D piece of every parameter (the flattened "
    "tensor, zero-padded to a multiple of dp), so an optimizer whose result depends on a "
    "tensor's shape or element count (factored Adafactor, RMS/mean statistics, masks computed "
    "from ndim) would silently change. Fix: use an elementwise optimizer (sgd, adam, adamw, "
    "lion, ...) with masks given as pytrees of bools built from the params, or zero_stage=0"
)


def _padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def _structure_check(optimizer: Any, layout: BucketLayout, dtype: Any) -> None:
    full_params = jax.tree_util.tree_unflatten(
        layout.treedef, [jax.ShapeDtypeStruct(s.shape, dtype) for s in layout.slots]
    )
    view_params = jax.tree_util.tree_unflatten(
        layout.treedef,
        [jax.ShapeDtypeStruct((_padded(s.size, layout.dp_size),), dtype) for s in layout.slots],
    )
    full = jax.eval_shape(optimizer.init, full_params)
    view = jax.eval_shape(optimizer.init, view_params)
    full_leaves, full_def = jax.tree_util.tree_flatten_with_path(full)
    view_leaves, view_def = jax.tree_util.tree_flatten_with_path(view)
    if full_def != view_def:  # type: ignore[operator]
        raise ValueError(
            "DataParallel.init: the optimizer's state has a different structure on sharded "
            f"parameters ({len(view_leaves)} leaves) than on whole ones ({len(full_leaves)} "
            f"leaves); {_WHY}."
        )
    for (kp, a), (_, b) in zip(full_leaves, view_leaves, strict=True):
        if a.shape == b.shape:
            continue
        # A parameter's state follows its view: 1-D, the size padded to a multiple of dp (a
        # scalar parameter, shape (), has a view of dp elements).
        if len(b.shape) == 1 and b.shape[0] == _padded(math.prod(a.shape), layout.dp_size):
            continue
        raise ValueError(
            f"DataParallel.init: optimizer state leaf {jax.tree_util.keystr(kp)} has shape "
            f"{a.shape} for whole parameters but {b.shape} for sharded ones; {_WHY}."
        )


def _probe_shape(shape: tuple[int, ...], dp: int) -> tuple[int, ...]:
    # Every dimension becomes dp + 1 (size = 1 mod dp, so a sharded view needs padding);
    # size-1 dimensions stay 1 so broadcasting semantics are kept.
    return tuple(1 if d == 1 else dp + 1 for d in shape)


def _steps(optimizer: Any, params: Any, grads: list[Any]) -> Any:
    """``params`` (a pytree of NumPy arrays) after one optimizer step per entry of ``grads``.

    ``init`` and one step are traced once and evaluated with NumPy
    (:mod:`jaxdp._src.optim.host_eval`):
    no XLA compile and no per-op dispatch. An optimizer that cannot be traced on its own runs
    op by op through jax instead, as before."""

    def step(p: Any, g: Any, s: Any) -> Any:
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    try:
        init, state_shape = jax.make_jaxpr(optimizer.init, return_shape=True)(params)
        traced = jax.make_jaxpr(step)(params, grads[0], state_shape)
    except (jax.errors.JAXTypeError, jax.errors.JAXIndexError):  # Python branches on values
        with jax.ensure_compile_time_eval():
            state = optimizer.init(params)
            for g in grads:
                params, state = step(params, g, state)
        return params
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    state = evaluate(init, p_leaves)
    for g in grads:
        out = evaluate(traced, [*p_leaves, *jax.tree_util.tree_leaves(g), *state])
        p_leaves, state = out[: len(p_leaves)], out[len(p_leaves) :]
    return jax.tree_util.tree_unflatten(p_def, p_leaves)


def _numeric_check(optimizer: Any, layout: BucketLayout) -> None:
    dp = layout.dp_size
    rng = np.random.default_rng(0)
    shapes = [_probe_shape(s.shape, dp) for s in layout.slots]
    sizes = [math.prod(sh) for sh in shapes]
    params = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    grads = [[rng.standard_normal(sh).astype(np.float32) for sh in shapes] for _ in range(3)]

    def tree(leaves):
        return jax.tree_util.tree_unflatten(layout.treedef, list(leaves))

    if layout.kind == "interleaved":

        def to_view(leaves):
            return tree([np.pad(x.ravel(), (0, _padded(x.size, dp) - x.size)) for x in leaves])

        def from_view(view):
            return [np.asarray(v) for v in jax.tree_util.tree_leaves(view)]

    else:  # megatron: one flat array per bucket, parameters separated by zero gaps

        def to_view(leaves):
            return tuple(
                np.concatenate([np.pad(leaves[i].ravel(), (0, 7)) for i in b.slots])
                for b in layout.buckets
            )

        def from_view(view):
            out: list[Any] = [None] * len(sizes)
            for b, v in zip(layout.buckets, view, strict=True):
                off = 0
                for i in b.slots:
                    out[i] = np.asarray(v)[off : off + sizes[i] + 7]
                    off += sizes[i] + 7
            return out

    full = jax.tree_util.tree_leaves(_steps(optimizer, tree(params), [tree(g) for g in grads]))
    view = from_view(_steps(optimizer, to_view(params), [to_view(g) for g in grads]))
    # Compare the total change of each parameter, relative to its size: an effect as small as
    # a default weight decay (1e-4 of the update) must show, reduction-order noise must not.
    for s, a, b, p0 in zip(layout.slots, full, view, params, strict=True):
        da = np.asarray(a).ravel() - p0.ravel()
        db = np.asarray(b)[: da.size] - p0.ravel()
        scale = max(float(np.max(np.abs(da))), 1e-30)
        if float(np.max(np.abs(da - db))) > 1e-5 * scale or np.any(np.asarray(b)[da.size :] != 0):
            raise ValueError(
                f"DataParallel.init: the optimizer updates parameter {s.path!r} differently "
                f"when it is sharded (probe of 3 steps); {_WHY}."
            )


def _untraced(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a thread of its own, outside any trace the caller is in.

    ``init`` runs under ``jax.eval_shape`` for compile-only programs (``jaxdp.aot``) and for
    ``jaxdp-train --resume``. There an operation the probe binds through jax (the primitives
    :mod:`jaxdp._src.optim.host_eval` leaves to jax, or an untraceable optimizer run op by op)
    would be
    staged into the caller's trace, or take jax's slow dispatch path under
    ``ensure_compile_time_eval`` (3x the time). jax keeps the trace per thread, so a fresh
    thread runs as at top level. Exceptions are re-raised here."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxdp-probe") as pool:
        return pool.submit(fn, *args).result()


def check_optimizer(optimizer: Any, layout: BucketLayout, dtype: Any = jnp.float32) -> None:
    """Raise ``ValueError`` if ``optimizer`` would give different results on ``layout``'s shards.

    Only the interleaved layout needs the check; the Megatron layout hands the optimizer a
    tuple of flat per-bucket shards, so it accepts only optimizers that ignore the tree
    structure (no masks) and are elementwise, which the same probe verifies. On the interleaved
    layout an optimizer made only of optax transformations known to be elementwise
    (:func:`jaxdp._src.optim.known.known_elementwise`: adam, adamw, sgd, lion, lamb, clipping,
    masks given as pytrees, schedules) needs no probe. The numeric probe runs outside any trace
    the caller is in (:func:`_untraced`).
    """
    if layout.kind == "contiguous":
        return
    if layout.kind == "interleaved" and known_elementwise(optimizer, layout.treedef):
        return
    if layout.kind == "megatron":
        try:
            jax.eval_shape(
                optimizer.init,
                tuple(jax.ShapeDtypeStruct((b.numel,), dtype) for b in layout.buckets),
            )
        except Exception as e:  # optax raises assorted errors for a tree mismatch
            raise ValueError(
                "DataParallel.init: with bucket_layout='megatron' the optimizer sees a tuple of "
                "flat bucket shards, and this optimizer could not be initialised on it "
                f"({type(e).__name__}: {e}). Fix: use bucket_layout='interleaved', which keeps "
                "the params' tree structure (needed for masks keyed by parameter)."
            ) from e
    else:
        _structure_check(optimizer, layout, dtype)
    _untraced(_numeric_check, optimizer, layout)
