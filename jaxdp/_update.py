"""The global half of a step: clipping, the (sharded) optax update, and the parameter gather.

Runs on globally sharded arrays outside ``shard_map``: at stage 0 the gradients, master weights
and optimizer state are replicated; at stages >= 1 they are the layout's shard view, sharded over
the data axis, so XLA's partitioner runs rank ``r``'s part of every elementwise optimizer
operation on rank ``r`` and adds no collective (the tests check the compiled program). Then one
``all_gather`` per bucket, inside ``shard_map``, rebuilds the working params in their dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.experimental.xla_metadata import set_xla_metadata
from jax.sharding import PartitionSpec as P

from ._config import DDPConfig
from ._layout import BucketLayout
from ._order import after

__all__ = ["SCHEDULING_GROUP_BASE", "clip_by_norm", "gather_params", "optimizer_update"]

#: First XLA ``_scheduling_group_id`` of the end-of-step parameter gathers (one per bucket).
SCHEDULING_GROUP_BASE = 1_000_000


def clip_by_norm(grads: Any, norm: jax.Array, config: DDPConfig) -> Any:
    """Megatron's global-norm clipping: scale by ``min(1, clip_grad / (norm + 1e-6))``."""
    if config.clip_grad is None:
        return grads
    coef = jnp.minimum(1.0, config.clip_grad / (norm + 1e-6))
    return jax.tree.map(lambda gr: gr * coef.astype(gr.dtype), grads)


def optimizer_update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    norm: jax.Array,
    opt_state: Any,
    target: Any,
    config: DDPConfig,
) -> tuple[Any, Any]:
    """Cast, clip and apply one optax update to ``target`` (master weights, or the params when
    there is no master copy). Returns ``(new_target, new_opt_state)``."""
    grads = jax.tree.map(lambda gr, t: gr.astype(t.dtype), grads, target)
    grads = clip_by_norm(grads, norm, config)
    updates, opt_state = optimizer.update(grads, opt_state, target)
    return optax.apply_updates(target, updates), opt_state


def _gather_local(view: Any, last: Any, layout: BucketLayout, axis: str) -> Any:
    shards = layout.shard_unview(view)  # cast to each bucket's working dtype
    n = len(layout.buckets)
    first = jax.lax.all_gather(after(shards[0], last), axis, tiled=True, to="invarying")
    full = [first] + [None] * (n - 1)
    leaves: list[Any] = [None] * len(layout.slots)
    for k, b in enumerate(layout.buckets):
        # One XLA scheduling group per bucket: bucket k+1's gather runs while bucket k is
        # split into its leaves. Without it XLA's scheduler (with memory to spare) starts every
        # gather first and splits them all at the end, keeping every gathered bucket alive at
        # once: a full second copy of the params (GPU only; other backends ignore the group).
        # Bucket k+1's gather also depends on bucket k's, so that no combiner merges the two
        # (a collective merged across groups is a compile error).
        with set_xla_metadata(_scheduling_group_id=str(SCHEDULING_GROUP_BASE + k)):
            if k + 1 < n:
                nxt = after(shards[k + 1], full[k])
                full[k + 1] = jax.lax.all_gather(nxt, axis, tiled=True, to="invarying")
            for i, leaf in zip(b.slots, layout.unpack_bucket(b, full[k]), strict=True):
                leaves[i] = leaf
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


def gather_params(view: Any, layout: BucketLayout, config: DDPConfig, mesh: Any, last: Any) -> Any:
    """Sharded master view -> replicated working params, one ``all_gather`` per bucket, each
    overlapped with splitting the previous bucket into its leaves; the first starts once
    ``last`` (a value that needs every reduced gradient, e.g. the gradient norm) is known."""
    axis = config.data_axis
    gather = jax.shard_map(
        lambda v, a: _gather_local(v, a, layout, axis),
        mesh=mesh,
        in_specs=(P(axis), P()),
        out_specs=P(),
    )
    return gather(view, last)
