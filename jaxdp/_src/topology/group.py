"""Who reduces with whom: the data-parallel group of a mesh, and each bucket's group in it.

:class:`ReductionGroup` is built once per engine from the mesh and the config's ``data_axis``
and ``expert_axis``. It answers every question about the group that the rest of the engine
asks: the axes the step's ``shard_map`` is manual over, how a batch is split, the dense
data-parallel size, and (:meth:`ReductionGroup.bucket_groups`) the group each bucket's
gradient is reduced over. Expert buffers reduce over the data axis only (Megatron's
expert-data-parallel group); everything else over the dense group.

Hierarchical groups (``num_distributed_optimizer_instances = N > 1``): the mesh is
``(outer, inner)`` (:func:`jaxdp._src.topology.mesh.instance_mesh`), ``data_axis`` is the
inner (instance) axis and ``outer_axis`` the axis across instances. A bucket reduces within
its instance (:class:`BucketGroup` over the inner axis, ``outer = N``: the mean divides by
``dp``) and the caller combines the instances' shards once per step
(:meth:`jaxdp._src.comm.nested.PlainOps.outer`): a sum (``no_shard``: the state is sharded
over the inner axis, replicated across instances) or a reduce-scatter (``shard_outer``,
``"optim"``: sharded over ``(inner, outer)``, rank ``(o, i)`` holding shard ``i * N + o``,
which is what reduce-scattering over the inner axis and then the outer one leaves it).

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

__all__ = ["BucketGroup", "Levels", "ReductionGroup"]


@dataclasses.dataclass(frozen=True)
class BucketGroup:
    """The reduction group of one bucket.

    Attributes:
        axes: mesh axis name(s) the bucket is reduced over.
        size: number of ranks in the group.
        prediv: divisor applied before the reduction (``|expert|`` for expert buckets, so that
            every gradient is the mean over the dense group's losses; :mod:`jaxdp._expert`).
        expert: whether the bucket holds expert params.
        outer: the number of instances whose reduced shards are summed after this group's
            reduction (hierarchical groups; 1 otherwise): the mean divides by
            ``size * outer``.
    """

    axes: Any
    size: int
    prediv: int = 1
    expert: bool = False
    outer: int = 1


@dataclasses.dataclass(frozen=True)
class Levels:
    """A hierarchical group's reduction as ZeRO-3's gathers transpose it: within the instance
    over ``axis`` (``inner`` ranks), the mean dividing by ``inner * outer``, which leaves each
    rank ``chunk`` shards (``outer_dp_sharding_strategy="optim"``: ``outer``; else 1); the
    instances are combined after the micro-batches
    (:meth:`jaxdp._src.comm.nested.PlainOps.outer`)."""

    axis: str
    inner: int
    outer: int
    chunk: int


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
    outer_axis: str | None = None
    shard_outer: bool = False

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes the step's ``shard_map`` is manual over."""
        if self.outer_axis is not None:
            return (self.outer_axis, self.data_axis)
        return (self.data_axis,) if self.expert_axis is None else (self.data_axis, self.expert_axis)

    @property
    def axes(self) -> Any:
        """The axis name (or tuple of names) a dense collective runs over."""
        if self.outer_axis is None and self.expert_axis is None:
            return self.data_axis
        return self.manual_axes

    @property
    def inner_size(self) -> int:
        """Ranks per instance (the whole group when flat)."""
        return int(self.mesh.shape[self.data_axis])

    @property
    def outer_size(self) -> int:
        """The number of instances (1 when flat)."""
        return 1 if self.outer_axis is None else int(self.mesh.shape[self.outer_axis])

    @property
    def shard_axes(self) -> Any:
        """The mesh axis (or axes, major first) the ZeRO shards of the master weights and
        optimizer state are split over: the data axis; with ``shard_outer``, ``(inner,
        outer)`` (module docstring)."""
        if self.shard_outer and self.outer_axis is not None:
            return (self.data_axis, self.outer_axis)
        return self.data_axis

    @property
    def shard_count(self) -> int:
        """How many ZeRO shards a bucket is split into (the layout's ``dp_size``)."""
        return self.inner_size * (self.outer_size if self.shard_outer else 1)

    @property
    def outer_chunk(self) -> int:
        """Shards per instance-level chunk: what the inner reduce-scatter leaves a rank holds
        (``outer_size`` with ``shard_outer``, else 1)."""
        return self.outer_size if self.shard_outer else 1

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

    @property
    def levels(self) -> Levels | None:
        """The reduction within an instance (:class:`Levels`), or ``None`` when flat."""
        if self.outer_axis is None:
            return None
        return Levels(self.data_axis, self.inner_size, self.outer_size, self.outer_chunk)

    def bucket_groups(self, layout: Any) -> tuple[BucketGroup, ...]:
        """One :class:`BucketGroup` per bucket of ``layout``: expert buffers (split over the
        expert axis) over the data axis, every other bucket over the dense group."""
        if self.outer_axis is not None:  # within the instance; instances combined after
            inner = BucketGroup(self.data_axis, self.inner_size, outer=self.outer_size)
            return (inner,) * len(layout.buckets)
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
