"""Stages 1-2 without bucket copies: one collective per parameter, combined by XLA.

The bucketed path (:class:`jaxdp._nested.PlainOps`) packs every gradient into a flat bucket
before its reduce-scatter and splits every gathered bucket back into parameters afterwards: two
full copies of the gradients and one of the params per step. XLA's collective combiners do the
same grouping without the copies: on GPUs a combined (variadic) reduce-scatter or all-gather is
one NCCL group call over the separate operand buffers. So with the interleaved layout on a
data-parallel mesh (every parameter whole on each device) the gradient of each parameter is
reduce-scattered on its own, in the layout's per-parameter shard form (flattened, zero-padded
to a multiple of dp: exactly the shard view the optimizer state has, so nothing is re-laid
out), and the combiner thresholds :func:`jaxdp.combine_thresholds` sets from the bucket size
group them into bucket-sized collectives, as stage 3 already does.

The numerics are the bucketed path's: each parameter goes through the same
:func:`jaxdp._reduce._reduce_one` with its bucket's wire dtype and divisors (elementwise, the
same sums over the same ranks). The all_to_all modes (``reduce_scatter_with_fp32_accumulation``,
``deterministic_reduction``) and ``bucket_layout="megatron"`` keep explicit buckets
(:func:`per_parameter_collectives`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from ._config import DDPConfig
from ._gather import SCHEDULING_GROUP_BASE
from ._layout import BucketLayout
from ._nested import PlainOps
from ._order import after

__all__ = ["PerParamOps", "gather_leaves", "per_parameter_collectives"]


def per_parameter_collectives(config: DDPConfig, layout: BucketLayout) -> bool:
    """Whether a stage-1/2 engine with params whole on each device reduces and gathers per
    parameter: the interleaved layout without scanned stacks, a reduce-scatter on the wire
    (the all_to_all modes sum explicit buckets)."""
    return (
        layout.kind == "interleaved"
        and not layout.stacked
        and not config.reduce_scatter_with_fp32_accumulation
        and not config.deterministic_reduction
    )


class PerParamOps(PlainOps):
    """:class:`jaxdp._nested.PlainOps` with one "bucket" per parameter: the accumulators, the
    collectives and the reduced shards are per-parameter arrays in layout leaf order."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        lay = self.layout
        self.reduce_buckets = [lay.buckets[s.bucket] for s in lay.slots]
        self.reduce_groups = [self.groups[s.bucket] for s in lay.slots]

    def numels(self, sharded: bool) -> list[int]:
        dp = 1 if sharded else self.layout.dp_size
        return [(s.end - s.start) * dp for s in self.layout.slots]

    def square_norm(self, red: Sequence[jax.Array]) -> jax.Array:
        # Summed over each bucket's shard as the bucketed path (and stage 3) sums it, so the
        # norm is theirs bit for bit; XLA fuses the concatenation into the reduction.
        lay = self.layout
        shards = [
            lay._fill(b, {i: red[i] for i in b.slots}, red[b.slots[0]].dtype) for b in lay.buckets
        ]
        return super().square_norm(shards)

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        leaves = self.layout._check_tree(grads, "pack")
        return tuple(self.layout._leaf_to_global(i, g, dtype) for i, g in enumerate(leaves))

    def out_shards(self, red: Sequence[jax.Array]) -> Any:
        return jax.tree_util.tree_unflatten(self.layout.treedef, list(red))

    def _working(self, view: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(view)
        return [x.astype(b.dtype) for x, b in zip(leaves, self.reduce_buckets, strict=True)]

    def gather_full(self, view: Any) -> Any:
        return gather_leaves(self._working(view), self.layout, self.axis)

    def gather_end(self, view: Any, axis: Any, last: Any) -> Any:
        return gather_leaves(self._working(view), self.layout, axis, last)


def gather_leaves(shards: Sequence[Any], layout: BucketLayout, axis: Any, last: Any = None) -> Any:
    """This rank's per-parameter shards (working dtype) -> the full params: one ``all_gather``
    per parameter, typed as identical on every rank, for XLA to combine.

    As :func:`jaxdp._gather.gather_buckets`: with ``last`` (the gradient norm) the first
    bucket's gathers wait for it; bucket ``k+1``'s gathers wait for all of bucket ``k``'s and
    share an XLA scheduling group with turning bucket ``k``'s into params, so a combined
    gather never spans two buckets and the gathered params are not all alive before the
    first is in place."""

    def gather(x: Any) -> Any:
        return jax.lax.all_gather(x, axis, tiled=True, to="invarying")

    def unpack(i: int, full: Any) -> Any:
        return layout._leaf_from_global(i, full)

    if last is None:
        out = [unpack(i, gather(x)) for i, x in enumerate(shards)]
        return jax.tree_util.tree_unflatten(layout.treedef, out)
    buckets = layout.buckets
    leaves: list[Any] = [None] * len(layout.slots)

    def gather_bucket(k: int, dep: Any) -> list[Any]:
        # one after() per bucket: its zero is computed once from all of dep's leaves (one
        # per shard would be |bucket k| x |bucket k+1| ops for XLA to simplify away)
        return [gather(x) for x in after([shards[i] for i in buckets[k].slots], dep)]

    gathered = [gather_bucket(0, last)]
    for k, b in enumerate(buckets):
        with set_xla_metadata(_scheduling_group_id=str(SCHEDULING_GROUP_BASE + k)):
            if k + 1 < len(buckets):
                gathered.append(gather_bucket(k + 1, gathered[k]))
            for i, full in zip(b.slots, gathered[k], strict=True):
                leaves[i] = unpack(i, full)
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)
