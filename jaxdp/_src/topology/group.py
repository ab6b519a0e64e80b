"""Who reduces with whom: the data-parallel group of a mesh, and each bucket's group in it.

:class:`ReductionGroup` is built once per engine from the mesh and the config's ``data_axis``
and ``expert_axis``. It answers every question about the group that the rest of the engine
asks: the axes the step's ``shard_map`` is manual over, how a batch is split, the dense
data-parallel size, and (:meth:`ReductionGroup.bucket_groups`) the group each bucket's
gradient is reduced over. Expert buffers reduce over the data axis only (Megatron's
expert-data-parallel group); everything else over the dense group. A hierarchical
(intra-/inter-node) group would be one more kind of :class:`BucketGroup` here.

Expert scaling follows Megatron (reference/megatron-ddp.md §3.1), so that every gradient is
the mean over the dense group's losses: a bucket's reduction
(:func:`jaxdp._src.comm.reduce.reduce_one`)
divides by its group's size (or averages in the collective), and an expert bucket is first
divided by ``prediv = dp / expt_dp = |expert|`` (in fp32, before any rounding). That gives
Megatron's factors for every wire dtype: ``1/dp`` for dense and expert gradients by default,
``1`` and ``expt_dp / dp`` with ``average_in_collective``; with a per-token loss nothing is
scaled and the engine divides by the dense group's token count after the reduction.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["BucketGroup", "ReductionGroup"]


@dataclasses.dataclass(frozen=True)
class BucketGroup:
    """The reduction group of one bucket.

    Attributes:
        axes: mesh axis name(s) the bucket is reduced over.
        size: number of ranks in the group.
        prediv: divisor applied before the reduction (``|expert|`` for expert buckets, so that
            every gradient is the mean over the dense group's losses; :mod:`jaxdp._expert`).
        expert: whether the bucket holds expert params.
    """

    axes: Any
    size: int
    prediv: int = 1
    expert: bool = False


@dataclasses.dataclass(frozen=True)
class ReductionGroup:
    """The dense data-parallel group: the data axis, times the expert axis if any.

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
        >>> g = ReductionGroup(mesh, "data")
        >>> g.axes, g.manual_axes, g.size == jax.device_count(), g.batch_spec() == P("data")
        ('data', ('data',), True, True)
    """

    mesh: Any
    data_axis: str
    expert_axis: str | None = None

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes the step's ``shard_map`` is manual over."""
        return (self.data_axis,) if self.expert_axis is None else (self.data_axis, self.expert_axis)

    @property
    def axes(self) -> Any:
        """The axis name (or tuple of names) a dense collective runs over."""
        return self.data_axis if self.expert_axis is None else self.manual_axes

    @property
    def platform(self) -> str:
        """The mesh's device platform (``"cpu"``, ``"gpu"``, ...; compile-only GPUs: ``"gpu"``)."""
        return str(self.mesh.devices.flat[0].platform)

    @property
    def size(self) -> int:
        """The dense data-parallel size (the number of ranks a batch is split over)."""
        return math.prod(int(self.mesh.shape[a]) for a in self.manual_axes)

    def rank(self) -> Any:
        """This rank's index in the group, in the batch's split order (inside the step's
        ``shard_map``): rank ``r`` holds the ``r``-th slice of the global batch."""
        return jax.lax.axis_index(self.axes)

    def batch_spec(self) -> P:
        """How a global batch is split: over the data axis, and the expert axis if any."""
        return P(self.axes)

    def bucket_groups(self, layout: Any) -> tuple[BucketGroup, ...]:
        """One :class:`BucketGroup` per bucket of ``layout``: expert buffers (split over the
        expert axis) over the data axis, every other bucket over the dense group."""
        dense = BucketGroup(self.axes, self.size)
        if self.expert_axis is None:
            return (dense,) * len(layout.buckets)
        n_data, n_expert = (
            int(self.mesh.shape[self.data_axis]),
            int(self.mesh.shape[self.expert_axis]),
        )
        expert = BucketGroup(self.data_axis, n_data, n_expert, True)
        return tuple(
            expert if self.expert_axis in layout.buffers[b.buffer].shard_axes else dense
            for b in layout.buckets
        )
