"""Per-bucket gradient collectives, to be called inside ``jax.shard_map`` over the data axis.

One collective per bucket, each depending only on that bucket's gradients, so XLA's scheduler is
free to start a bucket's collective as soon as its part of the backward pass is done.

* stage 0: all-reduce (``psum``; ``pmean`` with ``average_in_collective``), full bucket back;
* stages >= 1: tiled reduce-scatter (``psum_scatter``), this rank's ``numel // dp`` shard back;
* ``reduce_scatter_with_fp32_accumulation``: Megatron's variant, an ``all_to_all`` in the
  gradient dtype (e.g. bf16 on the wire) followed by a local fp32 sum and a single cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._config import DDPConfig
from ._layout import Bucket, BucketLayout

__all__ = [
    "reduce_buckets",
    "reduce_gradients",
    "all_to_all_fp32_reduce_scatter",
    "ring_reduce_scatter",
]


def all_to_all_fp32_reduce_scatter(x: jax.Array, axis_name: str, dp: int) -> jax.Array:
    """Reduce-scatter a 1-D ``x`` with the wire in ``x.dtype`` and the sum in fp32.

    Rank ``r`` receives chunk ``r`` of every rank's ``x`` through one ``all_to_all`` (bytes on the
    wire equal those of a ring reduce-scatter), sums the ``dp`` chunks in float32 and rounds once
    to ``x.dtype``. Must run inside ``shard_map`` over ``axis_name``.
    """
    if dp == 1:
        return x
    rows = x.reshape(dp, x.shape[0] // dp)
    recv = jax.lax.all_to_all(rows, axis_name, split_axis=0, concat_axis=0, tiled=True)
    return jnp.sum(recv.astype(jnp.float32), axis=0).astype(x.dtype)


def ring_reduce_scatter(x: jax.Array, axis_name: str, dp: int) -> jax.Array:
    """A ring reduce-scatter with ``ppermute`` that rounds to ``x.dtype`` at every hop.

    This is what an NCCL ring does with a bf16 buffer: ``dp - 1`` hops, each adding one rank's
    chunk to the running partial sum and rounding it back to bf16. It is the *baseline* whose
    error the fp32 paths remove; jaxdp never uses it for training. Returns chunk ``r`` on rank
    ``r``, like a tiled ``psum_scatter``.
    """
    if dp == 1:
        return x
    chunks = x.reshape(dp, x.shape[0] // dp)
    r = jax.lax.axis_index(axis_name)
    perm = [(i, (i + 1) % dp) for i in range(dp)]
    partial = chunks[(r - 1) % dp]
    for t in range(dp - 1):
        partial = jax.lax.ppermute(partial, axis_name, perm)
        partial = (partial + chunks[(r - t - 2) % dp]).astype(x.dtype)
    return partial


def _reduce_one(x: jax.Array, b: Bucket, layout: BucketLayout, config: DDPConfig, scale: float):
    axis, dp = config.data_axis, layout.dp_size
    wire = jnp.dtype(b.grad_dtype)
    # Scale in the accumulator's precision, then round once to the wire dtype.
    if scale != 1.0:
        x = x * jnp.asarray(scale, x.dtype)
    x = x.astype(wire)
    avg = config.average_in_collective and not config.calculate_per_token_loss
    if layout.kind == "contiguous":
        return jax.lax.pmean(x, axis) if avg else jax.lax.psum(x, axis)
    if config.reduce_scatter_with_fp32_accumulation:
        return all_to_all_fp32_reduce_scatter(x, axis, dp)
    out = jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    if avg:
        out = out / jnp.asarray(dp, out.dtype)
    return out


def bucket_scale(config: DDPConfig, dp: int, num_microbatches: int = 1) -> float:
    """The factor applied to each bucket before its collective.

    Gradients are summed over micro-batches, so ``1/G`` always applies; ``1/dp`` applies unless
    the collective averages (``average_in_collective``) or the loss is per-token (normalised by
    the global token count after the reduction instead).
    """
    if config.calculate_per_token_loss:
        return 1.0
    scale = 1.0 / num_microbatches
    if not config.average_in_collective:
        scale /= dp
    return scale


def reduce_buckets(
    buckets: Sequence[jax.Array],
    layout: BucketLayout,
    config: DDPConfig,
    *,
    num_microbatches: int = 1,
) -> tuple[jax.Array, ...]:
    """Reduce packed, per-device gradient buckets (``layout.pack`` output), one collective each.

    Returns full reduced buckets for ``zero_stage == 0`` and this rank's shard of each bucket
    otherwise, in each bucket's ``grad_dtype``. ``num_microbatches`` folds the ``1/G`` of
    gradient accumulation into the pre-scaling. Call inside ``shard_map``.
    """
    if len(buckets) != len(layout.buckets):
        raise ValueError(
            f"reduce_buckets: got {len(buckets)} buckets; the layout has "
            f"{len(layout.buckets)}. Fix: pass layout.pack(grads)."
        )
    scale = bucket_scale(config, layout.dp_size, num_microbatches)
    return tuple(
        _reduce_one(x, b, layout, config, scale)
        for x, b in zip(buckets, layout.buckets, strict=True)
    )


def reduce_gradients(grads: Any, layout: BucketLayout, config: DDPConfig) -> Any:
    """Average per-device gradients over ``config.data_axis``, bucket by bucket.

    Call inside ``jax.shard_map`` with the per-device (unreduced) gradients of the mean loss of
    the local batch. With ``zero_stage == 0`` it returns the averaged gradient pytree in the
    params' dtypes; otherwise this rank's shard, as :meth:`BucketLayout.shard_view` gives it
    (``"interleaved"``: a pytree like ``grads`` with 1-D leaves, rank ``r``'s piece of each
    parameter; ``"megatron"``: a tuple of per-bucket shards).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxdp import BucketLayout, DDPConfig, make_mesh, reduce_gradients
        >>> mesh = make_mesh()
        >>> cfg = DDPConfig()
        >>> grads = {"w": jnp.ones((3, 2))}
        >>> layout = BucketLayout.from_params(grads, cfg, mesh.shape["data"])
        >>> f = jax.shard_map(lambda g: reduce_gradients(g, layout, cfg), mesh=mesh,
        ...                   in_specs=P(), out_specs=P())
        >>> f(grads)["w"].tolist()
        [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]]
    """
    if config.calculate_per_token_loss:
        raise ValueError(
            "reduce_gradients: calculate_per_token_loss=True needs the global token count; "
            "expected a config without it. Fix: use DataParallel, or reduce_buckets and divide "
            "by psum(num_tokens) yourself."
        )
    flat = layout.pack(grads, dtype=None)
    reduced = reduce_buckets(flat, layout, config)
    if layout.kind == "contiguous":
        out = layout.unpack(reduced)
        return jax.tree.map(lambda g, ref: g.astype(ref.dtype), out, grads)
    return layout.shard_view(reduced)
