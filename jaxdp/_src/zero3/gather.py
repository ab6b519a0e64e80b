"""The parameter side: per-bucket gathers of sharded working params, and their transpose.

Two uses, both inside ``jax.shard_map`` over the data axis, on the local shard view of the
working params (``TrainState.params`` when the params are sharded):

* (stages 1-2's plain gathers are :mod:`jaxdp._src.comm.gather`.)
* :func:`make_leaf_gather` / :func:`make_bucket_gather` (ZeRO-3): a ``custom_vjp`` gather of one
  bucket (per parameter for interleaved layouts, whole for megatron layouts) whose transpose is the
  bucket's gradient reduce-scatter in the configured precision
  (:func:`jaxdp._src.comm.reduce.reduce_one`,
  the same numerics as stage 2). The primal is bf16 (the working dtype) but the reduced gradient
  must be fp32, so the gather takes two extra zero inputs, ``acc`` (the fp32 shard) and ``flags``
  (one per parameter of the bucket), and the step differentiates with respect to *those*: the
  cotangent of ``acc`` is this rank's reduced fp32 shard, the cotangent of ``flags`` counts
  non-finite local gradients (``check_for_nan_in_grad``), the cotangent of the shard is zero.
  :func:`zero3_value_and_grad` wraps the user's loss in ``jax.checkpoint`` with the policy of
  ``remat_policy`` (:func:`jaxdp._src.zero3.remat.remat_policy_for`), none of which saves
  the
  gathered values (named :data:`jaxdp._src.zero3.remat.GATHERED`) or what layout primitives derive
  from
  them, so the backward pass gathers every bucket again instead of keeping the full params
  alive as residuals.

Hook for scanned layer stacks: :func:`sharded_gather` takes any 1-D shard whose full value is its
tiled ``all_gather`` (a bucket shard, or rank ``r``'s piece of one layer of a stacked parameter)
and a ``reduce`` for its transpose. A transform that gathers one layer per ``lax.scan`` iteration
calls it on the per-layer slice of the shard with the per-layer slices of ``acc``/``flags`` and a
``reduce`` built like :func:`make_bucket_gather`'s (``reduce_one`` on the layer's slice), and
tags the result with :data:`GATHERED` so no policy of :func:`remat_policy_for` saves it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..comm.gather import gather_levels
from ..comm.reduce import deferred_divisor, reduce_one
from ..comm.wire import Wire
from ..layout.layout import Bucket, BucketLayout
from ..topology.group import Levels
from .remat import GATHERED

__all__ = [
    "gathers_per_parameter",
    "make_bucket_gather",
    "make_leaf_gather",
    "reduces_leaf_by_leaf",
    "sharded_gather",
    "varying_over",
    "zero3_divisors",
    "zero3_value_and_grad",
]


def _reduce_over(axis: Any, layout: BucketLayout, levels: Levels | None) -> dict[str, Any]:
    """``reduce_one``'s group keywords for a gather over ``axis``."""
    if levels is None:
        return {"axis": axis}
    return {"axis": levels.axis, "dp": levels.inner, "outer": levels.outer}


def gathers_per_parameter(layout: BucketLayout) -> bool:
    """Whether ZeRO-3 gathers ``layout``'s buckets per parameter (:func:`make_leaf_gather`):
    interleaved layouts without layer stacks. Others gather whole buckets."""
    return layout.kind == "interleaved" and not layout.stacked


def _vma(x: jax.Array) -> frozenset[str]:
    """The manual axes ``x`` varies over inside ``shard_map`` (jax 0.10: ``manual_axis_type``;
    older and newer: ``vma``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def varying_over(x: jax.Array, axes: Any) -> jax.Array:
    """``x`` typed as varying over the manual ``axes`` (a name or a tuple) as well. Stage 3's
    shard view must vary over every axis the loss does: the cotangent of a value typed as the
    same on every instance would be summed over the instances by autodiff itself, once per
    micro-batch, where a hierarchical group combines them once per step."""
    names = axes if isinstance(axes, tuple) else (axes,)
    missing = tuple(a for a in names if a not in _vma(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varying_like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """``x`` typed as varying over the manual axes ``ref`` varies over (``shard_map``)."""
    missing = tuple(sorted(_vma(ref) - _vma(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _nonfinite_flags(parts: Any) -> jax.Array:
    """1.0 per array of ``parts`` that holds a non-finite value, else 0.0."""
    return jnp.stack([(~jnp.all(jnp.isfinite(p))).astype(jnp.float32) for p in parts])


def _nonfinite(ct: jax.Array, b: Bucket, layout: BucketLayout) -> jax.Array:
    """1.0 per parameter of bucket ``b`` whose slice of the local gradient ``ct`` is not finite."""
    if layout.kind == "interleaved":
        mat = ct.reshape(layout.dp_size, b.numel // layout.dp_size)
        parts = [
            mat[:, layout.slots[i].start - b.start : layout.slots[i].end - b.start] for i in b.slots
        ]
    else:
        parts = [
            ct[layout.slots[i].start - b.start : layout.slots[i].end - b.start] for i in b.slots
        ]
    return _nonfinite_flags(parts)


def sharded_gather(
    axis: str,
    reduce: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``gather(shard, acc, flags) -> all_gather(shard)`` whose transpose is ``reduce``.

    The building block of ZeRO-3 (call inside ``shard_map`` over ``axis``). ``shard`` is a 1-D
    array whose full value is its tiled ``all_gather`` (a bucket shard of the interleaved or
    megatron layout, or a per-layer slice of one); ``acc`` and ``flags`` are zeros the caller
    differentiates with respect to. In the backward pass ``reduce(ct)`` receives the local
    gradient of the full value and returns ``(reduced_shard, nonfinite_flags)``, which become the
    cotangents of ``acc`` and ``flags`` (so they must match their shapes and dtypes); the
    cotangent of ``shard`` is zero. Nothing but shapes is saved for the backward pass.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxdp import make_mesh
        >>> mesh = make_mesh()
        >>> def red(ct):  # the local gradient of the full value -> (shard, flags)
        ...     flags = jax.lax.pcast(jnp.zeros((1,)), "data", to="varying")
        ...     return jax.lax.psum_scatter(ct, "data", tiled=True), flags
        >>> gather = sharded_gather("data", red)
        >>> def body(shard, acc, flags):
        ...     return jax.grad(lambda a: jnp.sum(gather(shard, a, flags) ** 2))(acc)
        >>> n = jax.device_count()
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        >>> f(jnp.ones(2 * n), jnp.zeros(2 * n), jnp.zeros(n)).tolist() == [2.0 * n] * (2 * n)
        True
    """

    axes = axis if isinstance(axis, tuple) else (axis,)

    @jax.custom_vjp
    def gather(shard: jax.Array, acc: jax.Array, flags: jax.Array) -> jax.Array:
        del acc, flags
        return gather_levels(shard, axis, invarying=False)

    def fwd(shard: jax.Array, acc: jax.Array, flags: jax.Array) -> tuple[jax.Array, None]:
        return gather(shard, acc, flags), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        red, bad = reduce(ct)
        # the shard's shape and dtype follow from the full value's (a tiled gather)
        n = ct.shape[0] // math.prod(jax.lax.axis_size(a) for a in axes)
        zero = _varying_like(jnp.zeros((n,), ct.dtype), ct)
        return zero, red, bad

    gather.defvjp(fwd, bwd)
    return gather


def reduces_leaf_by_leaf(b: Bucket, wire: Wire) -> bool:
    """Whether :func:`make_leaf_gather` reduce-scatters bucket ``b``'s gradients one leaf at a
    time (a low-precision wire summed by ``psum_scatter``) rather than packed."""
    return not (wire.all_to_all or jnp.dtype(b.grad_dtype).itemsize >= 4)


def zero3_divisors(
    layout: BucketLayout, wire: Wire, num_microbatches: int, levels: Levels | None = None
) -> tuple[int, ...]:
    """Per bucket, what stage 3's reduced shard is left to be divided by after the gathers'
    transpose (:func:`jaxdp._src.comm.reduce.finish_deferred`): deferred with micro-batches,
    and always where the leaves reduce one by one (a power-of-two scale left to the end).
    ``levels``: a hierarchical group's (:class:`Levels`)."""
    per_leaf = gathers_per_parameter(layout)
    dp, outer = (None, 1) if levels is None else (levels.inner, levels.outer)
    return tuple(
        deferred_divisor(b, layout, wire, num_microbatches, dp=dp, outer=outer)
        if num_microbatches > 1 or (per_leaf and reduces_leaf_by_leaf(b, wire))
        else 1
        for b in layout.buckets
    )


def make_bucket_gather(
    b: Bucket,
    layout: BucketLayout,
    wire: Wire,
    *,
    axis: Any,
    num_microbatches: int,
    deferred: bool,
    levels: Levels | None = None,
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The ZeRO-3 gather of bucket ``b``: :func:`sharded_gather` with stage 2's reduction.

    Forward: ``all_gather(shard)`` (tiled, wire dtype = the working dtype). Backward: the local
    gradient of the full bucket is cast to ``wire.accumulate`` and reduce-scattered over ``axis`` as
    stage 2 does (``deferred``: unscaled fp32 sums for a micro-batch accumulator, to be divided
    by :func:`zero3_divisors`' entry; else the final mean). Cotangents: zero for
    ``shard``, the reduced shard (``main_grads_dtype[b.shard_numel]``) for ``acc``, non-finite
    flags for ``flags`` (``float32[len(b.slots)]``).
    """
    acc_dt = wire.accumulate

    over = _reduce_over(axis, layout, levels)

    def reduce(ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        ct = ct.astype(acc_dt)
        red, _ = reduce_one(ct, b, layout, wire, num_microbatches, deferred, **over)
        if wire.check_nan:
            bad = _nonfinite(ct, b, layout)
        else:
            bad = _varying_like(jnp.zeros((len(b.slots),), jnp.float32), ct)
        return red.astype(acc_dt), bad

    return sharded_gather(axis, reduce)


def make_leaf_gather(
    b: Bucket,
    layout: BucketLayout,
    wire: Wire,
    *,
    axis: Any,
    per_slot_acc: bool,
    num_microbatches: int,
    deferred: bool,
    levels: Levels | None = None,
) -> Callable[[tuple[jax.Array, ...], jax.Array, jax.Array], list[jax.Array]]:
    """The ZeRO-3 gather of an interleaved bucket ``b``, one ``all_gather`` per parameter.

    ``gather(pieces, acc, flags) -> leaves``: ``pieces`` are this rank's pieces of ``b``'s
    parameters (the leaves of the interleaved shard view, in ``b.slots`` order), ``leaves`` the
    full parameters, in the working dtype.

    Why per parameter: an interleaved bucket's gathered ``[dp, numel // dp]`` matrix holds every
    parameter in strided columns, so splitting it into leaves copies the whole bucket, and XLA
    keeps the gathered bucket alive next to those copies (it fuses some slices into their
    consumers). In the backward pass, packing the leaves' gradients into the bucket is a second
    copy that waits for every leaf. Gathering and reduce-scattering each parameter's piece on
    its own yields every leaf (and takes every gradient) as its own buffer, which dies after its
    last use. XLA's combiners merge the per-parameter collectives again into groups smaller than
    one bucket (:func:`jaxdp.combine_thresholds`), so the number of collectives stays about one
    per bucket. Compiled for compile-only GPUs (``bench/bench_memory_gpu.py``, BENCHMARKS.md
    section 4), this brought stage 3 from above its memory formula to below it.

    Backward: each leaf's gradient is cast to ``wire.accumulate`` and reduce-scattered
    as :func:`make_bucket_gather` reduces a bucket (the same
    :func:`jaxdp._src.comm.reduce.reduce_one`
    numerics, applied to the leaf's columns). The gradients are packed and reduced per bucket
    instead with ``reduce_scatter_with_fp32_accumulation`` or ``deterministic_reduction`` (one
    ``all_to_all``: XLA:GPU has no all-to-all combiner) and with an fp32 wire
    (``grad_reduce_in_fp32``), where per-parameter reduce-scatters saved no memory in the same
    compile (1.47x either way) and XLA left the first one without overlap. Cotangents: zero for
    ``pieces``, the reduced bucket shard for ``acc`` (or, where
    :func:`jaxdp._src.strategy.plan.reduces_per_parameter`,
    ``acc`` is a tuple of this rank's per-parameter pieces and so is its cotangent), the
    non-finite flags for ``flags``.
    """
    acc_dt = wire.accumulate
    if not gathers_per_parameter(layout):
        raise ValueError(
            f"make_leaf_gather: layout kind {layout.kind!r}"
            f"{' with stacked params' if layout.stacked else ''}; expected an interleaved "
            "layout without stacks (use make_bucket_gather or jaxdp._src.zero3.scan)."
        )
    slots = list(b.slots)
    reduce_per_leaf = reduces_leaf_by_leaf(b, wire)
    over = _reduce_over(axis, layout, levels)
    chunk = 1 if levels is None else levels.chunk  # shards per reduced piece

    @jax.custom_vjp
    def gather(pieces: tuple[jax.Array, ...], acc: jax.Array, flags: jax.Array) -> list[jax.Array]:
        del acc, flags
        return [
            layout.leaf_from_global(i, gather_levels(x, axis, invarying=False))
            for i, x in zip(slots, pieces, strict=True)
        ]

    def fwd(pieces: Any, acc: jax.Array, flags: jax.Array) -> tuple[list[jax.Array], Any]:
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pieces]
        return gather(pieces, acc, flags), shapes

    def bwd(shapes: Any, cts: list[jax.Array]) -> tuple[Any, jax.Array, jax.Array]:
        if reduce_per_leaf:
            parts = {}
            for i, ct in zip(slots, cts, strict=True):
                flat = layout.leaf_to_global(i, ct, acc_dt)
                # deferred even with one micro-batch: a power-of-two scale is left to the
                # final division (reduce_one), the same bits without a pass over the gradient
                parts[i], _ = reduce_one(flat, b, layout, wire, num_microbatches, True, **over)
            red: Any
            if per_slot_acc:
                red = tuple(parts[i] for i in slots)
            elif chunk == 1:
                red = layout.fill(b, parts, parts[slots[0]].dtype)
            else:  # each piece holds ``chunk`` consecutive shards' pieces: one row each
                rows = {i: p.reshape(chunk, -1) for i, p in parts.items()}
                red = layout.fill(b, rows, parts[slots[0]].dtype, rows=chunk)
        else:
            leaves: list[Any] = [None] * len(layout.slots)
            for i, ct in zip(slots, cts, strict=True):
                leaves[i] = ct
            flat = layout.pack_interleaved(b, leaves, acc_dt)
            red, _ = reduce_one(flat, b, layout, wire, num_microbatches, deferred, **over)
        if wire.check_nan:
            bad = _nonfinite_flags(cts)
        else:
            bad = _varying_like(jnp.zeros((len(slots),), jnp.float32), cts[0])
        # Zero cotangents vary over the axes the pieces do: the data axis, and the model axes
        # of a rank's block on a tensor-parallel mesh (the gathered leaves' cotangents tell).
        zeros = tuple(
            _varying_like(jnp.zeros(s.shape, s.dtype), ct)
            for s, ct in zip(shapes, cts, strict=True)
        )
        acc_ct = jax.tree.map(lambda r: _varying_like(r.astype(acc_dt), cts[0]), red)
        return zeros, acc_ct, bad

    gather.defvjp(fwd, bwd)
    return gather


def zero3_value_and_grad(
    parts: Callable[[Any, Any], Any],
    layout: BucketLayout,
    wire: Wire,
    *,
    axis: str,
    policy: Callable[..., bool] | None,
    per_slot: bool,
    num_microbatches: int,
    place: Callable[..., Any] | None = None,
    levels: Levels | None = None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Value-and-grad of ``parts(params, mb)`` for params held as local bucket shards.

    ``policy``: what ``jax.checkpoint`` around the loss saves (:func:`remat_policy_for`);
    ``None``: no checkpoint, where every gather is an identity (one shard:
    :func:`jaxdp._src.strategy.plan.rematerialises`).

    ``place(gather_all, view, accs, flags)`` runs the per-rank gather ``gather_all`` where the
    rank's blocks live (default: calls it; on a tensor-parallel mesh a ``shard_map`` nested
    over the model axes, :meth:`jaxdp._src.comm.nested.NestedOps.place`).

    Returns ``(vg, loss)``: ``vg(accs, flags, view, mb) -> ((loss, aux), (d_accs,
    d_flags))`` (``loss`` is the same function undifferentiated) where ``view`` is this rank's
    shard view of the working params (:meth:`BucketLayout.shard_view`, working dtype), ``accs``
    zeros per bucket (``main_grads_dtype[shard_numel]``; per parameter, this rank's piece,
    where :func:`jaxdp._src.strategy.plan.reduces_per_parameter`) and ``flags`` zeros per bucket
    (``float32[len(slots)]``);
    ``d_accs`` are the reduced gradient shards and ``d_flags`` the non-finite flags. With
    ``num_microbatches > 1`` the reductions are deferred (unscaled sums, as at stage 2):
    :func:`jaxdp._src.comm.reduce.finish_deferred` with :func:`zero3_divisors` ends
    them.
    Interleaved layouts use :func:`make_leaf_gather` (collectives per parameter, combined by
    XLA), megatron layouts :func:`make_bucket_gather` (one collective per bucket).
    """
    # Interleaved layouts gather (and reduce-scatter) per parameter: see make_leaf_gather.
    per_leaf = gathers_per_parameter(layout)
    make = (
        functools.partial(make_leaf_gather, per_slot_acc=per_slot)
        if per_leaf
        else make_bucket_gather
    )
    gathers: list[Callable[..., Any]] = [
        make(
            b,
            layout,
            wire,
            axis=axis,
            num_microbatches=num_microbatches,
            deferred=num_microbatches > 1,
            levels=levels,
        )
        for b in layout.buckets
    ]

    def gather_all(view: Any, accs: Any, flags: Any) -> Any:
        if per_leaf:  # the shard view's leaves are this rank's pieces of each parameter
            pieces = jax.tree_util.tree_leaves(view)
            leaves: list[Any] = [None] * len(layout.slots)
            for k in reversed(range(len(gathers))):  # forward order, as below
                b = layout.buckets[k]
                mine = tuple(pieces[i].astype(b.dtype) for i in b.slots)
                acc = tuple(accs[i] for i in b.slots) if per_slot else accs[k]
                for i, leaf in zip(b.slots, gathers[k](mine, acc, flags[k]), strict=True):
                    leaves[i] = checkpoint_name(leaf, GATHERED)
            return jax.tree_util.tree_unflatten(layout.treedef, leaves)
        # The bucket shards are assembled from the shard view in here, not by the caller: a
        # concatenation is not saved for the backward pass (by any remat policy), so the
        # backward pass assembles them again instead of keeping a copy alive between the two.
        shards = layout.shard_unview(view)
        # Gather in forward order (bucket 0 holds the output end of the model, so the last
        # bucket's layers run first): the program order XLA's scheduler starts from.
        full = [None] * len(gathers)
        for i in reversed(range(len(gathers))):
            full[i] = checkpoint_name(gathers[i](shards[i], accs[i], flags[i]), GATHERED)
        return layout.unpack(tuple(full))

    run = place if place is not None else (lambda f, *args: f(*args))

    def loss(accs: Any, flags: Any, view: Any, mb: Any) -> Any:
        return parts(run(gather_all, view, accs, flags), mb)

    body = loss if policy is None else jax.checkpoint(loss, policy=policy)
    vg = jax.value_and_grad(body, argnums=(0, 1), has_aux=True)
    return vg, loss
