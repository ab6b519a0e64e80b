"""The public adapters of the collectives: :func:`jaxdp.reduce_gradients` and
:func:`jaxdp.reduce_buckets` take a :class:`jaxdp.DDPConfig` (for a user's own ``shard_map``)
and hand the collectives the wire spec :func:`wire_of` reads from it, the same one the plan
gives the engine's step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..config.config import DDPConfig
from ..layout.layout import BucketLayout
from .reduce import check_count, reduce_one
from .wire import Wire

__all__ = ["reduce_buckets", "reduce_gradients", "wire_of"]


def wire_of(config: DDPConfig) -> Wire:
    """The gradient reduction's wire spec (:class:`jaxdp._src.comm.wire.Wire`) of ``config``.

    Example:
        >>> from jaxdp import DDPConfig
        >>> wire_of(DDPConfig(zero_stage=1, deterministic_reduction=True)).all_to_all
        True
    """
    return Wire(
        accumulate=np.dtype(config.main_grads_dtype),
        all_to_all=config.reduce_scatter_with_fp32_accumulation or config.deterministic_reduction,
        ordered_metrics=config.deterministic_reduction,
        average_in_collective=config.average_in_collective,
        per_token=config.calculate_per_token_loss,
        check_nan=config.check_for_nan_in_grad,
    )


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
    check_count(buckets, layout, "reduce_buckets")
    wire = wire_of(config)
    return tuple(
        reduce_one(x, b, layout, wire, num_microbatches, axis=config.data_axis)[0]
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
    # Pack in a dtype that holds every gradient and every wire dtype exactly (bf16 gradients
    # with an fp32 wire pack as fp32): no rounding before the collective's own cast.
    pack_dtype = jnp.result_type(
        *(jnp.dtype(x.dtype) for x in jax.tree.leaves(grads)),
        *(jnp.dtype(b.grad_dtype) for b in layout.buckets),
    )
    flat = layout.pack(grads, dtype=pack_dtype)
    reduced = reduce_buckets(flat, layout, config)
    if layout.kind == "contiguous":
        out = layout.unpack(reduced)
        return jax.tree.map(lambda g, ref: g.astype(ref.dtype), out, grads)
    return layout.shard_view(reduced)
