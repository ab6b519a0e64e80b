"""Stages 0-2 without bucket copies: one collective per parameter, combined by XLA.

The bucketed path (:class:`jaxdp._src.comm.nested.PlainOps`) packs every gradient into a flat bucket
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
:func:`jaxdp._src.comm.reduce.reduce_one` with its bucket's wire dtype and divisors (elementwise,
the
same sums over the same ranks). The all_to_all modes (``reduce_scatter_with_fp32_accumulation``,
``deterministic_reduction``) and ``bucket_layout="megatron"`` keep explicit buckets
(:func:`jaxdp._src.strategy.plan.per_parameter_collectives`).

Stage 0 all-reduces per parameter the same way (:class:`AllReduceOps`,
:func:`jaxdp._src.strategy.plan.per_parameter_all_reduce`): no bucket to pack before the ``psum``
and none to slice
into every optimizer update after it. On GPUs this needs one XLA pass off for the step
(:data:`PASSES_OFF`, which :meth:`AllReduceOps.passes_off` asks for and the engine merges into
the step's compiler options): ``all-reduce-contiguous`` copies the operands of every combined
all-reduce into one buffer and the results back out, the very pack and unpack. Without it
XLA:GPU's all-reduce is one NCCL group call over the separate buffers, as its reduce-scatter
and all-gather already are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from ..layout.layout import BucketLayout
from .gather import gather_levels
from .nested import PlainOps

__all__ = [
    "NORM_CHUNK",
    "PASSES_OFF",
    "AllReduceOps",
    "PerParamOps",
    "gather_leaves",
]


#: XLA passes a step that all-reduces per parameter on GPUs compiles without: XLA:GPU's
#: ``AllReduceContiguous`` rewrites every combined (variadic) all-reduce into a concatenation
#: of its operands, one all-reduce and a slice per result. Compiled for compile-only GPUs, the
#: 100.7M GPT of BENCHMARKS section 11 moves more gradient volumes per step with it than
#: without it or with packed buckets (BENCHMARKS.md section 7). No flag turns it off in
#: jaxlib 0.10.2 but the generic ``xla_disable_hlo_passes``, which a compile takes per program.
PASSES_OFF: Final = ("all-reduce-contiguous",)

#: Reduced gradients per concatenation the gradient norm sums on GPUs (:class:`_PerParameter`;
#: 8 compiled fastest of 4, 8, 16 and 32 for compile-only GPUs, BENCHMARKS.md section 7).
NORM_CHUNK: Final = 8


def nccl_collectives(platform: str, dp_size: int) -> bool:
    """Whether the step's collectives run on a GPU's collective library (any platform but
    XLA:CPU) with more than one rank. Decided here, once per engine (``_PerParameter.nccl``),
    for the two things that differ: the gradient norm summed over a few parameters at a time
    (:class:`_PerParameter`) and :data:`PASSES_OFF` (:meth:`AllReduceOps.passes_off`).
    XLA:CPU runs collectives one at a time in program order and has no
    ``all-reduce-contiguous`` pass; with one rank there is nothing on the wire."""
    return platform != "cpu" and dp_size > 1


class _PerParameter(PlainOps):
    """:class:`jaxdp._src.comm.nested.PlainOps` with one "bucket" per parameter: the accumulators,
    the
    collectives and the reduced arrays are per-parameter arrays in layout leaf order, each
    reduced with its own bucket's wire dtype and group.

    The gradient norm is summed the way each compiler builds fastest, with the same result up
    to the order of the fp32 additions:

    * on GPUs over concatenations of :data:`NORM_CHUNK` consecutive reduced gradients of one
      dtype (:func:`jaxdp._src.comm.nested.square_sums`). XLA:GPU fuses each concatenation into the
      reduction that reads it, so nothing is written (a 1/dp scale after the collective is fused
      into both the norm and the update). Summed parameter by parameter instead (as Megatron's
      multi-tensor L2 norm sums it), XLA joined every parameter's sum of squares to its update,
      one multi-output reduction fusion per parameter for the fusion passes and the code
      generator: compiled for compile-only GPUs, that step's compile executed clearly more
      instructions (callgrind) than summing in chunks, at stages 0 and 1 (BENCHMARKS.md
      section 7). The price: the norm reads each reduced gradient once more, outside its
      update (stage 0: the whole gradient in its wire dtype; stages 1-2: its 1/dp shard), in a
      few kernels more. Whole buckets rebuilt from their reduced parameters (as on XLA:CPU)
      cost more than either: XLA:GPU's multi-output fusion and partitioner spent much longer
      on those concatenations, and the 1/dp scale of every gradient ran as a pass of its own;
    * on XLA:CPU, and with one rank, over each bucket rebuilt by the layout's own fill (gaps and
      padding zero), so the norm is the bucketed path's (and stage 3's) bit for bit. XLA:CPU
      compiles one reduction of a concatenation far faster than one per parameter (its
      fusion pass, BENCHMARKS.md section 7); with one rank nothing is scaled, the
      concatenation fused into its reduction is one kernel, and one per parameter would add
      kernel launches over the bare step's (BENCHMARKS.md section 12).
    """

    packs_whole_buckets = False  # one array per parameter: the work before its collective fuses

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        lay = self.layout
        self.reduce_buckets = [lay.buckets[s.bucket] for s in lay.slots]
        self.reduce_groups = [self.groups[s.bucket] for s in lay.slots]
        self.nccl = nccl_collectives(self.group.platform, self.group.size)

    def per_array(self, per_bucket: Sequence[Any]) -> tuple[Any, ...]:
        return tuple(per_bucket[b.index] for b in self.reduce_buckets)

    def square_norm(
        self, red: Sequence[jax.Array], divisors: Sequence[int] | None = None
    ) -> jax.Array:
        if self.nccl:  # on GPUs over concatenations of NORM_CHUNK parameters (class docstring)
            return self._sum_squares(red, self.reduce_groups, NORM_CHUNK)
        lay = self.layout
        buckets = [self._bucket(b, red, divisors) for b in lay.buckets]
        return self._sum_squares(buckets, self.groups)

    def _bucket(self, b: Any, red: Sequence[jax.Array], divisors: Sequence[int] | None) -> Any:
        """Bucket ``b`` rebuilt from its reduced parameters, for the norm.

        Where each of them is its collective's output times ``1/d`` for one power of two ``d``
        (``divisors``: :func:`jaxdp._src.comm.reduce.finish_deferred`), it is rebuilt as
        ``fill(r * d) * (1/d)``: the same bits (both scalings are exact), but XLA cancels
        ``r * (1/d) * d`` and concatenates the collectives' outputs as they are. Otherwise
        XLA:CPU, which does not fuse a concatenation, first writes out every scaled
        parameter: one more fusion per parameter to compile (100 leaves at stage 1: 659
        fusions against 559)."""
        ds = {divisors[i] for i in b.slots} if divisors else {1}
        d = ds.pop() if len(ds) == 1 else 1
        dtype = red[b.slots[0]].dtype
        if d == 1 or d & (d - 1):
            return self.layout.fill(b, {i: red[i] for i in b.slots}, dtype)
        up, down = np.asarray(d, dtype), np.asarray(1.0 / d, dtype)
        return self.layout.fill(b, {i: red[i] * up for i in b.slots}, dtype) * down


class AllReduceOps(_PerParameter):
    """Stage 0 with one all-reduce per parameter, combined by XLA
    (:func:`jaxdp._src.strategy.plan.per_parameter_all_reduce`).

    The bucketed path packs every gradient into its bucket before the ``psum`` and slices each
    one back out afterwards; XLA fuses those slices into the optimizer's updates, and on
    XLA:CPU a loop fusion with a slice costs about 20x an elementwise one to compile (1,000
    leaves: 2,000 such fusions), while on GPUs the updates, each at its own offset of a
    bucket, are no two the same kernel. Here each gradient is reduced flattened, as it is (a
    bitcast, no padding: an all-reduce needs none), so there is neither a pack nor an unpack.
    The sums are the bucketed path's, elementwise."""

    def passes_off(self) -> tuple[str, ...]:
        """:data:`PASSES_OFF` on GPUs with more than one rank (XLA:CPU has no such pass, and
        with one rank there is no all-reduce)."""
        return PASSES_OFF if self.nccl else ()

    def numels(self, sharded: bool) -> list[int]:
        return [s.size for s in self.layout.slots]

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        leaves = self.layout.check_tree(grads, "pack")
        return tuple(jnp.ravel(g).astype(dtype) for g in leaves)

    def out_full(self, red: Sequence[jax.Array]) -> Any:
        out = [r.reshape(s.shape) for r, s in zip(red, self.layout.slots, strict=True)]
        return jax.tree_util.tree_unflatten(self.layout.treedef, out)


class PerParamOps(_PerParameter):
    """Stages 1-2: each parameter's gradient reduce-scattered into its shard of the
    interleaved view, and each shard gathered back, on its own."""

    def numels(self, sharded: bool) -> list[int]:
        dp = self.chunk if sharded else self.layout.dp_size
        return [(s.end - s.start) * dp for s in self.layout.slots]

    def pack(self, grads: Any, dtype: Any) -> tuple[jax.Array, ...]:
        leaves = self.layout.check_tree(grads, "pack")
        return tuple(self.layout.leaf_to_global(i, g, dtype) for i, g in enumerate(leaves))

    def out_shards(self, red: Sequence[jax.Array]) -> Any:
        return jax.tree_util.tree_unflatten(self.layout.treedef, list(red))

    def _working(self, view: Any) -> list[Any]:
        leaves = jax.tree_util.tree_leaves(view)
        return [x.astype(b.dtype) for x, b in zip(leaves, self.reduce_buckets, strict=True)]

    def gather_full(self, view: Any) -> Any:
        return gather_leaves(self._working(view), self.layout, self.shard_axes)

    def gather_end(self, view: Any, axis: Any, last: Any) -> Any:
        # Unordered on every platform (``last``, the gradient norm, is not waited for): each
        # gathered shard is its parameter (a reshape, or a slice where the layout padded it),
        # so XLA keeps no gathered copy alive (see :func:`gather_leaves`).
        return gather_leaves(self._working(view), self.layout, axis)


def gather_leaves(shards: Sequence[Any], layout: BucketLayout, axis: Any) -> Any:
    """This rank's per-parameter shards (working dtype) -> the full params: one ``all_gather``
    per parameter, typed as identical on every rank, for XLA to combine.

    Unlike a bucket's gather (:func:`jaxdp._src.comm.gather.gather_buckets`), these need no
    ordering:
    a gathered parameter is the param itself, reshaped (or, where the layout padded it to a
    multiple of dp, sliced), not a bucket that stays alive until it is split. The data
    dependences that ordered them bucket by bucket on GPUs until 2026-11-28 (an OR with zero
    per parameter, XLA scheduling groups) saved no memory (compile-only GPUs, the 100.7M GPT
    of BENCHMARKS section 11, bf16 params: the same peak per device with or without them)
    and cost XLA:GPU a good part of that GPT's stage 1-2 compile (BENCHMARKS section 7)."""
    gathered = [gather_levels(x, axis) for x in shards]
    return layout.from_global_view(gathered)
