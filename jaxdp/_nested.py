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

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ._config import DDPConfig
from ._expert import Group, reduce_grouped, square_norm_grouped
from ._layout import BucketLayout
from ._reduce import metric_sum, reduce_buckets, reduce_microbatch_buckets
from ._sharding import ShardingPlan

__all__ = ["NestedOps", "PlainOps", "gather_params_nested"]


def _entry(axes: Sequence[str]) -> Any:
    return axes[0] if len(axes) == 1 else tuple(axes)


class PlainOps:
    """Bucket operations on whole (replicated) parameters: the layout's own methods.

    With ``plan`` and ``groups`` (expert parallelism, :mod:`jaxdp._expert`) each bucket is
    reduced over its own group and each param is made varying over the manual axes it is not
    already split over."""

    def __init__(
        self,
        layout: BucketLayout,
        config: DDPConfig,
        plan: ShardingPlan | None = None,
        groups: Sequence[Group] | None = None,
    ):
        self.layout, self.config, self.plan, self.groups = layout, config, plan, groups

    def varying(self, params: Any, axis: Any) -> Any:
        """Per-device copies of ``params`` to differentiate (autodiff then adds no psum)."""
        if self.plan is None or len(self.plan.manual_axes) == 1:
            return jax.tree.map(lambda w: jax.lax.pcast(w, axis, to="varying"), params)
        manual = self.plan.manual_axes
        leaves, treedef = jax.tree_util.tree_flatten(params)
        out = []
        for w, ls in zip(leaves, self.plan.leaves, strict=True):
            axes = tuple(a for a in manual if a not in ls.axes)
            out.append(jax.lax.pcast(w, axes, to="varying") if axes else w)
        return jax.tree_util.tree_unflatten(treedef, out)

    def square_norm(self, red: Sequence[jax.Array], sharded: bool) -> jax.Array:
        """Squared L2 norm of all reduced gradients (the same on every rank)."""
        if self.groups is not None and self.plan is not None and self.plan.expert_axis:
            return square_norm_grouped(red, self.groups, self.plan.expert_axis)
        sq = jnp.sum(jnp.stack([jnp.sum(jnp.square(r)) for r in red]))
        return metric_sum(sq, self.config) if sharded else sq

    def zeros(self, numels: Sequence[int], dtype: Any) -> tuple[jax.Array, ...]:
        return tuple(jnp.zeros((n,), dtype) for n in numels)

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        return self.layout.pack(grads, dtype=dtype)

    def reduce_microbatch(
        self, flat: Sequence[jax.Array], g: int
    ) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
        return reduce_microbatch_buckets(flat, self.layout, self.config, num_microbatches=g)

    def reduce(self, acc: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        if self.groups is not None:
            return reduce_grouped(acc, self.layout, self.config, self.groups, g)
        return reduce_buckets(acc, self.layout, self.config, num_microbatches=g)

    def out(self, red: Sequence[jax.Array], sharded: bool) -> Any:
        return self.layout.shard_view(red) if sharded else self.layout.unpack(red)


class NestedOps(PlainOps):
    """The same operations, each in a ``shard_map`` nested inside the step's data-manual one
    and manual over the parameters' other axes (module docstring)."""

    def __init__(
        self,
        layout: BucketLayout,
        config: DDPConfig,
        plan: ShardingPlan,
        groups: Sequence[Group] | None = None,
    ):
        super().__init__(layout, config, plan, groups)
        self.nested_plan = plan
        self.axes = set(plan.auto_axes)
        auto = plan.auto_axes
        keys = [tuple(a for a in b.shard_axes if a in auto) for b in layout.buffers]
        self.bucket_specs = tuple(
            P(_entry(keys[b.buffer])) if keys[b.buffer] else P() for b in layout.buckets
        )
        self.leaf_specs = jax.tree_util.tree_unflatten(
            layout.treedef, [ls.spec_over(plan.auto_axes) for ls in plan.leaves]
        )

    def _nest(self, f: Any, in_specs: Any, out_specs: Any) -> Any:
        return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names=self.axes)

    def zeros(self, numels: Sequence[int], dtype: Any) -> tuple[jax.Array, ...]:
        return self._nest(lambda: PlainOps.zeros(self, numels, dtype), (), self.bucket_specs)()

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        f = self._nest(
            lambda g: PlainOps.pack(self, g, dtype), (self.leaf_specs,), self.bucket_specs
        )
        return tuple(f(grads))

    def reduce_microbatch(
        self, flat: Sequence[jax.Array], g: int
    ) -> tuple[tuple[jax.Array, ...], tuple[int, ...]]:
        divisors: list[tuple[int, ...]] = []

        def body(x: Any) -> Any:
            out, d = PlainOps.reduce_microbatch(self, x, g)
            divisors.append(d)  # static ints
            return out

        out = self._nest(body, (self.bucket_specs,), self.bucket_specs)(tuple(flat))
        return tuple(out), divisors[-1]

    def reduce(self, acc: Sequence[jax.Array], g: int) -> tuple[jax.Array, ...]:
        f = self._nest(
            lambda x: PlainOps.reduce(self, x, g), (self.bucket_specs,), self.bucket_specs
        )
        return tuple(f(tuple(acc)))

    def out(self, red: Sequence[jax.Array], sharded: bool) -> Any:
        layout, plan = self.layout, self.nested_plan
        if not sharded:
            f = self._nest(lambda x: layout.unpack(x), (self.bucket_specs,), self.leaf_specs)
            return f(tuple(red))
        # Stage >= 1: a split leaf's local piece becomes one row of its [M, k] view.
        auto = plan.auto_axes

        def body(x: Any) -> Any:
            view = layout.shard_view(x)
            leaves = jax.tree_util.tree_leaves(view)
            rows = [
                v[None] if _local_axes(ls, auto) else v
                for v, ls in zip(leaves, plan.leaves, strict=True)
            ]
            return jax.tree_util.tree_unflatten(layout.treedef, rows)

        out_specs = jax.tree_util.tree_unflatten(
            layout.treedef,
            [
                P(_entry(_local_axes(ls, auto)), None) if _local_axes(ls, auto) else P()
                for ls in plan.leaves
            ],
        )
        return self._nest(body, (self.bucket_specs,), out_specs)(tuple(red))


def _local_axes(ls: Any, auto: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in ls.axes if a in auto)


def gather_params_nested(
    view: Any, layout: BucketLayout, config: DDPConfig, plan: ShardingPlan
) -> Any:
    """Sharded master view -> working params split like the originals, one ``all_gather``
    over the data axis per bucket, in a ``shard_map`` manual over every mesh axis."""
    axis = config.data_axis
    view_specs = jax.tree_util.tree_unflatten(layout.treedef, plan.view_specs())
    param_specs = jax.tree_util.tree_unflatten(layout.treedef, plan.param_specs())

    def local(v: Any) -> Any:
        leaves = [
            x[0] if ls.axes else x
            for x, ls in zip(jax.tree_util.tree_leaves(v), plan.leaves, strict=True)
        ]
        shards = layout.shard_unview(jax.tree_util.tree_unflatten(layout.treedef, leaves))
        full = tuple(jax.lax.all_gather(x, axis, tiled=True, to="invarying") for x in shards)
        return layout.unpack(full)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(view_specs,), out_specs=param_specs)(view)
