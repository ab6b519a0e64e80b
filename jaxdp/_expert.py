"""Expert data parallelism: expert buffers reduce over the expert-data-parallel group only.

With ``DDPConfig.expert_axis`` the mesh's data axis and expert axis together form the dense
data-parallel group (the batch is split over both, ``dp = |data| * |expert|``), and the step's
``shard_map`` is manual over both. Expert params are split over the expert axis, so each rank
holds its local experts; the model dispatches tokens to them with explicit collectives over
the expert axis. Their gradients are reduced over the data axis only (the ranks that hold the
same experts, Megatron's ``expt_dp`` group of size ``|data|``), dense gradients over both axes.

Scaling follows Megatron (``DistributedDataParallel``, reference/megatron-ddp.md §3.1) so that
every gradient is the mean over the dense group's losses:

=========================  ============  ======================  ========
mode                       dense factor  expert factor           op
=========================  ============  ======================  ========
default                    ``1/dp``      ``1/dp``                SUM
``average_in_collective``  ``1``         ``expt_dp / dp``        AVG
per-token loss             ``1``         ``1``                   SUM
=========================  ============  ======================  ========

jaxdp's reduction of a bucket (:func:`jaxdp._reduce._reduce_one`) already divides by its
group's size (or averages in the collective); an expert bucket is first divided by
``dp / expt_dp = |expert|`` (in fp32, before any rounding), which gives exactly the table's
factors for every wire dtype. With a per-token loss nothing is scaled and the engine divides by
the dense group's token count after the reduction.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ._config import DDPConfig
from ._layout import BucketLayout
from ._reduce import _divided, _float_for_sum, _reduce_one

__all__ = ["Group", "bucket_groups", "group_config", "reduce_grouped"]


@dataclasses.dataclass(frozen=True)
class Group:
    """The reduction group of one bucket.

    Attributes:
        axes: mesh axis name(s) the bucket is reduced over.
        size: number of ranks in the group.
        prediv: divisor applied before the reduction (``|expert|`` for expert buckets).
        expert: whether the bucket holds expert params.
    """

    axes: Any
    size: int
    prediv: int
    expert: bool


def group_config(config: DDPConfig, axes: Any) -> DDPConfig:
    """``config`` reducing over ``axes`` (a name or a tuple of names). Internal: the field is
    validated as a single name for users; jax's collectives take a tuple as well."""
    out = copy.copy(config)
    object.__setattr__(out, "data_axis", axes)
    return out


def bucket_groups(layout: BucketLayout, config: DDPConfig, mesh: Any) -> tuple[Group, ...]:
    """One :class:`Group` per bucket: expert buffers over the data axis, dense ones over
    ``(data_axis, expert_axis)``."""
    data, expert = config.data_axis, config.expert_axis
    assert expert is not None
    n_data, n_expert = int(mesh.shape[data]), int(mesh.shape[expert])
    out = []
    for b in layout.buckets:
        if expert in layout.buffers[b.buffer].shard_axes:
            out.append(Group(data, n_data, n_expert, True))
        else:
            out.append(Group((data, expert), n_data * n_expert, 1, False))
    return tuple(out)


def reduce_grouped(
    acc: Sequence[jax.Array],
    layout: BucketLayout,
    config: DDPConfig,
    groups: Sequence[Group],
    num_microbatches: int,
) -> tuple[jax.Array, ...]:
    """:func:`jaxdp.reduce_buckets` with each bucket reduced over its own group (stage 0)."""
    out = []
    for x, b, grp in zip(acc, layout.buckets, groups, strict=True):
        if grp.prediv != 1 and not config.calculate_per_token_loss:
            x = _divided(x, grp.prediv, _float_for_sum(x.dtype))
        sub = dataclasses.replace(layout, dp_size=grp.size)
        red, _ = _reduce_one(x, b, sub, group_config(config, grp.axes), num_microbatches)
        out.append(red)
    return tuple(out)


def square_norm_grouped(
    red: Sequence[jax.Array], groups: Sequence[Group], expert_axis: str
) -> jax.Array:
    """Squared L2 norm of all gradients at stage 0: dense buckets are the same on every rank;
    each expert rank holds other experts, whose squares are summed over the expert axis."""
    dense = [jnp.sum(jnp.square(r)) for r, g in zip(red, groups, strict=True) if not g.expert]
    expert = [jnp.sum(jnp.square(r)) for r, g in zip(red, groups, strict=True) if g.expert]
    sq = jnp.sum(jnp.stack(dense)) if dense else jnp.zeros((), jnp.float32)
    if expert:
        sq = sq + jax.lax.psum(jnp.sum(jnp.stack(expert)), expert_axis)
    return sq
