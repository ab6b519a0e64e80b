"""Bucket operations on rank-local pieces when parameters are split over other mesh axes.

The step's ``shard_map`` is manual over the data axis only; the other axes (tensor
parallelism) stay under the compiler, so the user's model sees whole, model-sharded params.
Flattening such a gradient there would make the compiler gather it. Every bucket operation
therefore runs in a *nested* ``shard_map`` that is manual over the parameters' other axes as
well: inside it each device holds its own blocks, and packing, the per-bucket collectives over
the data axis and the views are the 1-D code applied to those blocks, with no communication
but the bucket collectives themselves.

Between the nested regions a bucket of a buffer split over axes ``A`` is a 1-D array of
``M * numel`` elements sharded ``P(A)`` (``M`` rows of one block's bucket, rank-major); a bucket
of replicated parameters is ``numel`` elements, replicated over ``A``.

:class:`PlainOps` is the same interface for a mesh without such parameters (the 1-D path).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ..layout.layout import BucketLayout
from ..topology.group import ReductionGroup
from ..topology.sharding import ShardingPlan
from .gather import gather_buckets, gather_full
from .reduce import (
    UNPACKED_OVER,
    Unpacked,
    deferred_divisor,
    divided,
    float_for_sum,
    metric_sum,
    outer_reduce,
    reduce_one,
    then,
)
from .wire import Wire

__all__ = ["NestedOps", "PlainOps", "square_sums"]


def _entry(axes: Sequence[str]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


def square_sums(arrays: Sequence[jax.Array], chunk: int = 1) -> list[jax.Array]:
    """Partial sums of squares of the 1-D ``arrays``, each in its array's dtype: one per array
    (``chunk=1``), or one per concatenation of up to ``chunk`` consecutive arrays of one dtype.
    XLA fuses such a concatenation into the reduction that reads it, so nothing is written
    (:class:`jaxdp._src.comm.per_param._PerParameter` says when the norm is summed that way)."""
    if chunk == 1:
        return [jnp.sum(jnp.square(r)) for r in arrays]
    out: list[jax.Array] = []
    for _, same in itertools.groupby(arrays, key=lambda r: r.dtype):
        run = list(same)
        for i in range(0, len(run), chunk):
            part = run[i : i + chunk]
            out.append(jnp.sum(jnp.square(jnp.concatenate([jnp.ravel(r) for r in part]))))
    return out


class PlainOps:
    """Bucket operations on whole parameters (every parameter replicated over the axes the
    step is not manual over): the layout's own methods, each bucket reduced over its group
    (:meth:`jaxdp._src.topology.group.ReductionGroup.bucket_groups`)."""

    #: Buckets of whole parameters are packed here, in the step's own region (not in nested
    #: tensor-parallel regions, not one array per parameter): what :meth:`pack_later` may
    #: leave unpacked, and what stage 0's metric ordering waits for
    #: (``jaxdp._src.strategy.kernels.Kernel``, ``order_metrics``).
    packs_whole_buckets = True

    def __init__(
        self,
        layout: BucketLayout,
        wire: Wire,
        group: ReductionGroup,
        plan: ShardingPlan,
        loss_divisor: int = 1,
    ):
        self.layout, self.wire, self.group, self.plan = layout, wire, group, plan
        self.axis = group.axes
        # The ZeRO shards' axes; with distributed-optimizer instances the reduce within an
        # instance leaves each rank ``chunk`` shards, combined across instances once per step
        # (outer).
        self.shard_axes, self.chunk = group.shard_axes, group.outer_chunk
        self.groups = group.bucket_groups(layout)
        # > 1: the kernel divides the loss by it, so the gradients arrive divided by G x dp
        # already (jaxdp._src.strategy.loss_divisor); the reductions only sum them
        self.loss_divisor = loss_divisor
        self.divided = loss_divisor > 1
        # what _reduce reduces, one entry per array: buckets here, parameters in PerParamOps
        self.reduce_buckets, self.reduce_groups = list(layout.buckets), list(self.groups)

    def varying(self, params: Any) -> Any:
        """Per-device copies of ``params`` to differentiate (autodiff then adds no psum): each
        leaf made varying over the manual axes it is not already split over."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        out = []
        for w, ls in zip(leaves, self.plan.leaves, strict=True):
            axes = tuple(a for a in self.group.manual_axes if a not in ls.axes)
            out.append(jax.lax.pcast(w, axes, to="varying") if axes else w)
        return jax.tree_util.tree_unflatten(treedef, out)

    def square_norm(
        self, red: Sequence[jax.Array], divisors: Sequence[int] | None = None
    ) -> jax.Array:
        """Squared L2 norm of this rank's reduced gradients, summed array by array: one array
        per entry of ``reduce_buckets`` (a bucket, or a parameter in
        :mod:`jaxdp._src.comm.per_param`).
        ``divisors``: what each array of ``red`` was divided by after its collective
        (:func:`jaxdp._src.comm.reduce.finish_deferred`), or ``None``; unused here."""
        return self._sum_squares(red, self.reduce_groups)

    def _sum_squares(
        self, arrays: Sequence[jax.Array], groups: Sequence[Any], chunk: int = 1
    ) -> jax.Array:
        """The squares of ``arrays`` summed, each array reduced over its entry of ``groups``.
        Dense arrays are the same on every rank of the group; each expert rank holds other
        experts, whose squares are summed over the expert axis. ``chunk``: how many
        consecutive 1-D arrays of one dtype each partial sum reads, concatenated
        (:func:`square_sums`)."""
        pairs = list(zip(arrays, groups, strict=True))
        dense = square_sums([r for r, g in pairs if not g.expert], chunk)
        sq = jnp.sum(jnp.stack(dense or [jnp.zeros(())]))
        expert = square_sums([r for r, g in pairs if g.expert], chunk)
        if expert:
            sq = sq + jax.lax.psum(jnp.sum(jnp.stack(expert)), self.group.expert_axis)
        return sq

    def passes_off(self) -> tuple[str, ...]:
        """XLA passes the step must compile without for these collectives (none here; see
        :meth:`jaxdp._src.comm.per_param.AllReduceOps.passes_off`)."""
        return ()

    def group_sum(self, x: jax.Array) -> jax.Array:
        """Sum a per-rank value over the group (ordered with ``deterministic_reduction``)."""
        return metric_sum(x, self.axis, self.wire.ordered_metrics)

    def shard_sum(self, x: jax.Array) -> jax.Array:
        """Sum a per-shard value over the ranks holding distinct shards (the group, or with
        a hierarchical group whose instances hold the same shards, one instance)."""
        return metric_sum(x, self.shard_axes, self.wire.ordered_metrics)

    def numels(self, sharded: bool) -> list[int]:
        """Elements of each accumulator: a bucket (``sharded``: what the reduction within the
        group leaves a rank, its shard, or with ``outer_dp_sharding_strategy="optim"`` the
        ``chunk`` shards of its instance's level)."""
        return [b.shard_numel * self.chunk if sharded else b.numel for b in self.layout.buckets]

    def outer(self, red: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        """The instances' reduced shards combined, once per step (hierarchical groups; the
        identity otherwise): :func:`jaxdp._src.comm.reduce.outer_reduce` per array."""
        g = self.group
        if g.outer_axis is None:
            return tuple(red)
        return tuple(
            outer_reduce(r, g.outer_axis, g.outer_size, self.wire, b.grad_dtype, g.shard_outer)
            for r, b in zip(red, self.reduce_buckets, strict=True)
        )

    def per_array(self, per_bucket: Sequence[Any]) -> tuple[Any, ...]:
        """A value given per bucket (e.g. a divisor), for each accumulator of :meth:`numels`."""
        return tuple(per_bucket)

    def zeros(self, numels: Sequence[int], dtype: Any) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((n,), dtype) for n in numels)

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        return self.layout.pack(grads, dtype=dtype)

    def pack_later(self, grads: Any, dtype: Any) -> tuple[Any, ...]:
        """:meth:`pack` for :meth:`reduce`: where :attr:`packs_whole_buckets`, a contiguous
        bucket of more than :data:`jaxdp._src.comm.reduce.UNPACKED_OVER` parameters stays
        :class:`jaxdp._src.comm.reduce.Unpacked`, so the collective's elementwise work is done on
        each
        gradient before it is packed."""
        lay = self.layout
        if not self.packs_whole_buckets or lay.kind != "contiguous":
            return self.pack(grads, dtype)
        leaves = lay.check_tree(grads, "pack")
        return tuple(
            Unpacked(lay, b, leaves, dtype)
            if len(b.slots) > UNPACKED_OVER
            else lay.pack_contiguous(b, leaves, jnp.dtype(dtype))
            for b in lay.buckets
        )

    def _reduce(self, flat: Sequence[Any], g: int, deferred: bool) -> tuple[jax.Array, ...]:
        out = []
        for x, b, grp in zip(flat, self.reduce_buckets, self.reduce_groups, strict=True):
            if grp.prediv != 1 and not (self.wire.per_token or self.divided):
                d = grp.prediv
                x = then(x, lambda v, d=d: divided(v, d, float_for_sum(v.dtype)))
            red, _ = reduce_one(
                x,
                b,
                self.layout,
                self.wire,
                g,
                deferred,
                axis=grp.axes,
                dp=grp.size,
                prescaled=self.divided,
                outer=grp.outer,
            )
            out.append(red)
        return tuple(out)

    def deferred_divisors(self, g: int) -> tuple[int, ...]:
        """What each array :meth:`reduce_microbatch` returns is left to be divided by, once, at
        the end (:func:`jaxdp._src.comm.reduce.finish_deferred`): static, one per array."""
        return tuple(
            deferred_divisor(
                b, self.layout, self.wire, g, dp=grp.size, prescaled=self.divided, outer=grp.outer
            )
            for b, grp in zip(self.reduce_buckets, self.reduce_groups, strict=True)
        )

    def reduce_microbatch(self, flat: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        """One micro-batch's reduce-scatter for a sharded accumulator, each array left to be
        divided by its :meth:`deferred_divisors` entry."""
        return self._reduce(flat, g, True)

    def reduce(self, acc: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        """The accumulated buckets' collectives (all-reduce or reduce-scatter)."""
        return self._reduce(acc, g, False)

    def out_full(self, red: Sequence[jax.Array]) -> Any:
        """Full reduced buckets -> the params-shaped gradients."""
        return self.layout.unpack(red)

    def out_shards(self, red: Sequence[jax.Array]) -> Any:
        """This rank's reduced bucket shards -> its shard view of the gradients."""
        return self.layout.shard_view(red)

    def gather_full(self, view: Any) -> Any:
        """This rank's shard view -> the full working params (``overlap_param_gather``)."""
        return gather_full(view, self.layout, self.shard_axes)

    def gather_end(self, view: Any, axis: Any, last: Any) -> Any:
        """The end-of-step gather (stages 1-2): this device's shard view -> its full params,
        each bucket waiting for ``last`` (:func:`jaxdp._src.comm.gather.gather_buckets`)."""
        return gather_buckets(self.layout.shard_unview(view), self.layout, axis, last)

    def place(self, fn: Any, view: Any, accs: Any, flags: Any) -> Any:
        """Run the per-rank ZeRO-3 gather ``fn(view, accs, flags) -> params`` on this rank's
        blocks (here: the whole params)."""
        return fn(view, accs, flags)

    def bucket_flags(self, bad: Sequence[jax.Array]) -> Sequence[jax.Array]:
        """Per bucket, one non-finite flag per parameter (over all blocks)."""
        return bad


class NestedOps(PlainOps):
    """The same operations, each in a ``shard_map`` nested inside the step's data-manual one
    and manual over the parameters' other axes (module docstring)."""

    packs_whole_buckets = False  # the buckets cross the nested regions' boundary

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        plan, layout = self.plan, self.layout
        self.axes = set(plan.auto_axes)
        auto = plan.auto_axes
        keys = [tuple(a for a in b.shard_axes if a in auto) for b in layout.buffers]
        self.bucket_specs = tuple(
            P(_entry(keys[b.buffer])) if keys[b.buffer] else P() for b in layout.buckets
        )
        self.leaf_specs = jax.tree_util.tree_unflatten(
            layout.treedef, [ls.spec_over(plan.auto_axes) for ls in plan.leaves]
        )
        # The shard view of a split leaf is [M, k] here (data-manual): one row per block.
        self.view_specs = jax.tree_util.tree_unflatten(
            layout.treedef,
            [
                P(_entry(_local_axes(ls, auto)), None) if _local_axes(ls, auto) else P()
                for ls in plan.leaves
            ],
        )
        self.factors = [
            math.prod(int(plan.mesh.shape[a]) for a in keys[b.buffer]) for b in layout.buckets
        ]

    def _nest(self, f: Any, in_specs: Any, out_specs: Any) -> Any:
        return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names=self.axes)

    def zeros(self, numels: Sequence[int], dtype: Any) -> tuple[jax.Array, ...]:
        return self._nest(lambda: PlainOps.zeros(self, numels, dtype), (), self.bucket_specs)()

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        f = self._nest(
            lambda g: PlainOps.pack(self, g, dtype), (self.leaf_specs,), self.bucket_specs
        )
        return tuple(f(grads))

    def reduce_microbatch(self, flat: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        f = self._nest(
            lambda x: PlainOps.reduce_microbatch(self, x, g),
            (self.bucket_specs,),
            self.bucket_specs,
        )
        return tuple(f(tuple(flat)))

    def reduce(self, acc: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        f = self._nest(
            lambda x: PlainOps.reduce(self, x, g), (self.bucket_specs,), self.bucket_specs
        )
        return tuple(f(tuple(acc)))

    def out_full(self, red: Sequence[jax.Array]) -> Any:
        f = self._nest(lambda x: self.layout.unpack(x), (self.bucket_specs,), self.leaf_specs)
        return f(tuple(red))

    def out_shards(self, red: Sequence[jax.Array]) -> Any:
        layout, plan = self.layout, self.plan
        # A split leaf's local piece becomes one row of its [M, k] view.
        auto = plan.auto_axes

        def body(x: Any) -> Any:
            view = layout.shard_view(x)
            leaves = jax.tree_util.tree_leaves(view)
            rows = [
                v[None] if _local_axes(ls, auto) else v
                for v, ls in zip(leaves, plan.leaves, strict=True)
            ]
            return jax.tree_util.tree_unflatten(layout.treedef, rows)

        return self._nest(body, (self.bucket_specs,), self.view_specs)(tuple(red))

    def _rows(self, view: Any) -> Any:
        """Inside the nested region: a split leaf's ``[1, k]`` block -> its 1-D piece."""
        leaves = jax.tree_util.tree_leaves(view)
        auto = self.plan.auto_axes
        rows = [
            x[0] if _local_axes(ls, auto) else x
            for x, ls in zip(leaves, self.plan.leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.layout.treedef, rows)

    def gather_full(self, view: Any) -> Any:
        f = self._nest(
            lambda v: gather_full(self._rows(v), self.layout, self.axis),
            (self.view_specs,),
            self.leaf_specs,
        )
        return f(view)

    def place(self, fn: Any, view: Any, accs: Any, flags: Any) -> Any:
        f = self._nest(
            lambda v, a, fl: fn(self._rows(v), a, fl),
            (self.view_specs, self.bucket_specs, self.bucket_specs),
            self.leaf_specs,
        )
        return f(view, tuple(accs), tuple(flags))

    def bucket_flags(self, bad: Sequence[jax.Array]) -> Sequence[jax.Array]:
        return [x.reshape(m, -1).max(axis=0) for x, m in zip(bad, self.factors, strict=True)]


def _local_axes(ls: Any, auto: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in ls.axes if a in auto)
