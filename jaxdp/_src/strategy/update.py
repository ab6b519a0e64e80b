"""The global half of a step: clipping, the (sharded) optax update, and the parameter gather.

Runs on globally sharded arrays outside ``shard_map``: at stage 0 the gradients, master weights
and optimizer state are replicated; at stages >= 1 they are the layout's shard view, sharded over
the data axis, so XLA's partitioner runs rank ``r``'s part of every elementwise optimizer
operation on rank ``r`` and adds no collective (the tests check the compiled program). Then
``all_gather`` per bucket (or per parameter), inside ``shard_map``, rebuilds the working
params in their dtype; on a 1-D mesh with per-parameter views the partitioner does that
gather itself (:meth:`jaxdp._src.strategy.strategy.ShardedOpt._gather_global`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from ..forms.codec import StatePolicy

__all__ = ["clip_by_norm", "gather_params", "optimizer_update"]


def clip_by_norm(grads: Any, norm: jax.Array, clip_grad: float | None) -> Any:
    """Megatron's global-norm clipping: scale by ``min(1, clip_grad / (norm + 1e-6))``."""
    if clip_grad is None:
        return grads
    coef = jnp.minimum(1.0, clip_grad / (norm + 1e-6))
    return jax.tree.map(lambda gr: gr * coef.astype(gr.dtype), grads)


def optimizer_update(
    optimizer: optax.GradientTransformation,
    grads: Any,
    norm: jax.Array,
    opt_state: Any,
    target: Any,
    clip_grad: float | None,
    policy: StatePolicy,
) -> tuple[Any, Any]:
    """Cast, clip and apply one optax update to ``target`` (master weights, or the params when
    there is no master copy). Returns ``(new_target, new_opt_state)``.

    ``policy``: the optimizer state's storage dtypes. Narrowed moments are widened before
    optax sees them, so that its update computes in the master's dtype (optax casts the new
    second moment to the dtype of the one it was given), and rounded to nearest after it."""
    grads = jax.tree.map(lambda gr, t: gr.astype(t.dtype), grads, target)
    grads = clip_by_norm(grads, norm, clip_grad)
    updates, opt_state = optimizer.update(grads, policy.load(opt_state), target)
    return optax.apply_updates(target, updates), policy.store(opt_state)


def gather_params(view: Any, last: Any, view_codec: Any, param_codec: Any, ops: Any) -> Any:
    """Sharded master view -> the working params (stages 1-2), gathered over the data axis by
    ``ops.gather_end`` (per bucket, :func:`jaxdp._src.comm.gather.gather_buckets`, or per
    parameter,
    :func:`jaxdp._src.comm.per_param.gather_leaves`), in a ``shard_map`` manual over the whole mesh:
    each device gathers its own blocks; ``param_codec`` gives the result's shardings
    (replicated, or split over tensor-parallel axes as the params were)."""
    mesh, axis = view_codec.sharding.mesh, view_codec.axis

    def local(v: Any, lst: Any) -> Any:
        return ops.gather_end(view_codec.unblock(v), axis, lst)

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(view_codec.specs(), P()),
        out_specs=param_codec.specs(),
    )(view, last)
