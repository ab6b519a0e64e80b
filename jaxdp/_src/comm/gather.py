"""The shard -> full gather of the working params at stages 1-2, one ``all_gather`` per bucket.

Inside ``jax.shard_map`` over the data axis, on the local shard view of the working params:
at the start of a step (:func:`gather_full`, ``overlap_param_gather``: outside the
differentiated function, so the gathered params serve every micro-batch and XLA can overlap
bucket ``k+1``'s gather with the forward of the layers in bucket ``k``) and at its end
(:func:`gather_buckets`, after the update). ZeRO-3's gathers, whose transpose is the gradient
reduction, are :mod:`jaxdp._src.zero3.gather`.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from ..layout.layout import BucketLayout
from .order import after

__all__ = ["SCHEDULING_GROUP_BASE", "gather_buckets", "gather_full", "gather_levels"]

#: First XLA ``_scheduling_group_id`` of the end-of-step parameter gathers (one per bucket).
SCHEDULING_GROUP_BASE = 1_000_000


def gather_levels(x: jax.Array, axis: Any, *, invarying: bool = True) -> jax.Array:
    """Tiled ``all_gather`` of ``x`` over ``axis``. A tuple of axes (major first, e.g. a
    hierarchical shard's ``(inner, outer)``) is gathered one axis at a time, the minor one
    first, the same result as one gather over the tuple, but no collective spans every rank:
    the instances' level (small, across nodes) and then the instance's (over its fast
    links)."""
    axes = axis if isinstance(axis, tuple) else (axis,)
    typed = {"to": "invarying"} if invarying else {}
    for a in reversed(axes):
        x = jax.lax.all_gather(x, a, tiled=True, **typed)
    return x


def gather_buckets(shards: Any, layout: BucketLayout, axis: str, last: Any = None) -> Any:
    """Bucket shards (this rank's, in the working dtypes) -> the full params, one
    ``all_gather`` per bucket, typed as identical on every rank (``to="invarying"``).

    The one shard -> full gather of the engine: at the start of a step
    (:func:`gather_full`, ``overlap_param_gather``) and at its end (stages 1-2,
    :func:`jaxdp._src.strategy.update.gather_params`). With ``last`` (a value that needs every
    reduced
    gradient, e.g. the gradient norm) the first gather waits for it and each bucket's gather
    is its own XLA scheduling group, overlapped with splitting the previous bucket into its
    leaves: without the groups XLA's scheduler (with memory to spare) starts every gather
    first and splits them all at the end, keeping every gathered bucket alive at once, a full
    second copy of the params (GPU only; other backends ignore the group). Bucket ``k+1``'s
    gather also depends on bucket ``k``'s, so that no combiner merges the two (a collective
    merged across groups is a compile error).
    """
    # A dependency between buffers of params split over different tensor-parallel axes would
    # make one vary over the other's axes: those are gathered unordered, as at the start.
    if last is None or len({buf.shard_axes for buf in layout.buffers}) > 1:
        full = tuple(gather_levels(x, axis) for x in shards)
        return layout.unpack(full)
    n = len(layout.buckets)
    gathered = [gather_levels(after(shards[0], last), axis)]
    leaves: list[Any] = [None] * len(layout.slots)
    for k, b in enumerate(layout.buckets):
        with set_xla_metadata(_scheduling_group_id=str(SCHEDULING_GROUP_BASE + k)):
            if k + 1 < n:
                nxt = after(shards[k + 1], gathered[k])
                gathered.append(gather_levels(nxt, axis))
            for i, leaf in zip(b.slots, layout.unpack_bucket(b, gathered[k]), strict=True):
                leaves[i] = leaf
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def gather_full(view: Any, layout: BucketLayout, axis: str) -> Any:
    """Local shard view -> the full working params, one ``all_gather`` per bucket
    (:func:`gather_buckets` without ordering)."""
    return gather_buckets(layout.shard_unview(view), layout, axis)
