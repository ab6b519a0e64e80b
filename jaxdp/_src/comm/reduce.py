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
import numpy as np

from ..layout.layout import Bucket, BucketLayout
from .wire import Wire

__all__ = [
    "Unpacked",
    "all_to_all_fp32_reduce_scatter",
    "check_count",
    "deferred_divisor",
    "divided",
    "finish_deferred",
    "float_for_sum",
    "metric_sum",
    "ordered_reduce_scatter",
    "outer_reduce",
    "ordered_sum",
    "reduce_one",
    "ring_reduce_scatter",
    "then",
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


def float_for_sum(wire: Any) -> Any:
    """The dtype a sum over ranks is carried in: fp32, or the wire dtype when it is wider."""
    wire = jnp.dtype(wire)
    return wire if wire.itemsize >= 4 else jnp.dtype(jnp.float32)


def ordered_reduce_scatter(x: jax.Array, axis_name: str, dp: int, sum_dtype: Any) -> jax.Array:
    """Reduce-scatter a 1-D ``x`` through one ``all_to_all`` and a local sum in rank order.

    Rank ``r`` receives chunk ``r`` of every rank's ``x`` (wire dtype: ``x.dtype``) and adds the
    ``dp`` chunks in ``sum_dtype``, always in rank order within one identical per-device program,
    so the result does not depend on how the devices are split into processes or on the
    collective library's algorithm. Returns the sum in ``sum_dtype`` (no cast back). Must run
    inside ``shard_map`` over ``axis_name``; ``x.shape[0]`` must be a multiple of ``dp``.
    """
    if dp == 1:
        return x.astype(sum_dtype)
    rows = x.reshape(dp, x.shape[0] // dp)
    recv = jax.lax.all_to_all(rows, axis_name, split_axis=0, concat_axis=0, tiled=True)
    return jnp.sum(recv.astype(sum_dtype), axis=0)


def _all_gather_invariant(x: jax.Array, axis_name: str, *, tiled: bool) -> jax.Array:
    """``all_gather`` whose result is typed as the same on every rank (``shard_map`` with
    ``check_vma``), so it can leave ``shard_map`` under ``P()``. Under ``vmap`` / ``pmap`` (no
    varying-ness types) it is a plain ``all_gather``."""
    try:
        return jax.lax.all_gather(x, axis_name, tiled=tiled, to="invarying")
    except ValueError:  # not under shard_map: there are no manual-axis types to set
        return jax.lax.all_gather(x, axis_name, tiled=tiled)


def ordered_sum(x: jax.Array, axis_name: str) -> jax.Array:
    """``psum`` of a (small) array whose summation order is fixed: all-gather, then add in rank
    order. Used for metrics under ``deterministic_reduction``. Inside ``shard_map`` only."""
    return jnp.sum(_all_gather_invariant(x, axis_name, tiled=False), axis=0)


def metric_sum(x: jax.Array, axis: Any, ordered: bool = False) -> jax.Array:
    """Sum a per-rank metric over ``axis``: in rank order where ``ordered``
    (:attr:`Wire.ordered_metrics`), else a ``psum``."""
    if ordered:
        return ordered_sum(x, axis)
    return jax.lax.psum(x, axis)


def _scaled(x: jax.Array, factor: float, dtype: Any) -> jax.Array:
    """``x * factor`` computed in ``dtype`` (x is cast first, so no low-precision arithmetic)."""
    x = x.astype(dtype)
    return x if factor == 1.0 else x * np.asarray(factor, dtype)


def divided(x: jax.Array, divisor: int, dtype: Any) -> jax.Array:
    """``x / divisor`` correctly rounded in ``dtype`` (a division, not a rounded reciprocal).

    XLA's algebraic simplifier rewrites a division by a broadcast scalar into a multiplication
    by its rounded reciprocal (``x / 15`` becomes ``x * 0.0666666701``), which is off by one
    ulp on some elements and turns exact bf16 ties the wrong way. Building the divisor
    elementwise from ``x`` (``x * 0 + d``, fused, never materialised) hides the broadcast, so a
    true IEEE division is emitted; a non-finite ``x`` stays non-finite (``inf`` becomes
    ``nan``). Divisions by powers of two are exact multiplications and keep the fast path.
    """
    x = x.astype(dtype)
    if divisor == 1:
        return x
    if divisor & (divisor - 1) == 0:  # a power of two: the reciprocal is exact
        return x * np.asarray(1.0 / divisor, dtype)
    return x / (x * np.asarray(0, dtype) + np.asarray(divisor, dtype))


#: A contiguous bucket of more than this many parameters is reduced from its
#: :class:`Unpacked` gradients. Below it XLA:GPU fuses the elementwise work into the
#: concatenation that packs the bucket, and doing it per gradient instead only moves it into
#: the gradients' producers, where it can cost a copy (the 100.7M GPT, about 50 parameters per
#: bucket: +0.25 gradient volumes per step); XLA:GPU caps a fusion's operands and outputs (96
#: in jaxlib 0.10), and a 100-leaf MLP's bucket is past it (measured: 80 fused, 94 not).
UNPACKED_OVER = 64


class Unpacked:
    """One contiguous bucket's gradients, not packed yet: :func:`reduce_one` takes it in place
    of the packed bucket and applies its elementwise work before the collective (the cast to
    the wire dtype, the pre-scaling) to each gradient, then packs the results.

    Elementwise, ``f(concatenate(g))`` and ``concatenate(f(g_i))`` are the same bits, but XLA
    does not compile them alike: ``f`` of each gradient fuses into that gradient's producer
    (or into the concatenation), while ``f`` of a concatenation of about 90 or more arrays
    stays a pass of its own over the packed bucket (XLA:GPU fuses no consumer into it). Compiled
    for compile-only GPUs, a 100-leaf MLP at stage 0 with an fp32 wire spent whole gradient
    volumes per step on scaling by 1/dp, gone when the gradients are scaled one by one
    (traffic as ``bench/bench_traffic.py`` counts it).

    Args:
        layout: the (contiguous) layout ``bucket`` belongs to.
        bucket: the bucket.
        leaves: every gradient of the layout, in leaf order (the bucket takes its slots').
        dtype: what the gradients are cast to before anything else (the accumulator dtype).
        fn: elementwise work queued so far (``None``: none).
    """

    def __init__(
        self,
        layout: BucketLayout,
        bucket: Bucket,
        leaves: Sequence[Any],
        dtype: Any,
        fn: Any = None,
    ):
        self.layout, self.bucket, self.leaves = layout, bucket, leaves
        self.dtype, self.fn = jnp.dtype(dtype), fn
        self.shape = (bucket.numel,)

    def map(self, fn: Any) -> Unpacked:
        """``fn`` (elementwise, zero to zero) queued after what is queued already."""
        first = self.fn
        both = fn if first is None else (lambda v: fn(first(v)))
        return Unpacked(self.layout, self.bucket, self.leaves, self.dtype, both)

    def packed(self) -> jax.Array:
        """The bucket: each gradient cast, put through the queued work, then packed (gaps and
        padding zero)."""
        fn = self.fn or (lambda v: v)
        pieces = {i: fn(jnp.ravel(self.leaves[i]).astype(self.dtype)) for i in self.bucket.slots}
        dt = next(iter(pieces.values())).dtype
        return self.layout.fill(self.bucket, pieces, dt)


def _apply(x: Any, fn: Any) -> jax.Array:
    """``fn(x)`` for a packed bucket; for an :class:`Unpacked` one, ``fn`` of each gradient,
    packed."""
    return x.map(fn).packed() if isinstance(x, Unpacked) else fn(x)


def then(x: Any, fn: Any) -> Any:
    """``fn(x)``, or ``fn`` queued on an :class:`Unpacked` bucket (still not packed)."""
    return x.map(fn) if isinstance(x, Unpacked) else fn(x)


def deferred_divisor(
    b: Bucket,
    layout: BucketLayout,
    wire: Wire,
    num_microbatches: int,
    *,
    dp: int | None = None,
    prescaled: bool = False,
    outer: int = 1,
) -> int:
    """What :func:`reduce_one` with ``deferred=True`` leaves for the caller to divide by, once,
    after the micro-batches' shards are summed (:func:`finish_deferred`): a static int, known
    before anything is traced (the plan's kernels carry it; without ``deferred`` it is 1).

    Example:
        >>> import jax.numpy as jnp, numpy as np
        >>> from jaxdp import BucketLayout
        >>> from jaxdp._src.comm.wire import Wire
        >>> from jaxdp._src.layout.layout import LayoutRules
        >>> lay = BucketLayout.build({"w": jnp.zeros(8)}, LayoutRules("interleaved", None), 8)
        >>> deferred_divisor(lay.buckets[0], lay, Wire(np.dtype("float32")), 4)  # G x dp
        32
    """
    if layout.kind == "contiguous":  # an all-reduce: nothing is deferred
        return 1
    dp = layout.dp_size if dp is None else dp
    per_token = wire.per_token or prescaled
    g_div = 1 if per_token else num_microbatches
    dp_div = 1 if per_token else dp * outer
    if wire.all_to_all or jnp.dtype(b.grad_dtype).itemsize >= 4:
        return g_div * dp_div  # the fp32 sum, divided once at the end
    # A low-precision wire: pre-scaled before the wire, except by a power of two that the
    # caller's one division applies bit for bit (one micro-batch, no average in the collective).
    avg = wire.average_in_collective and not per_token
    pre = g_div if avg else g_div * dp_div
    return pre if not avg and num_microbatches == 1 and pre & (pre - 1) == 0 else 1


def reduce_one(
    x: Any,
    b: Bucket,
    layout: BucketLayout,
    wire: Wire,
    num_microbatches: int,
    deferred: bool = False,
    *,
    axis: Any,
    dp: int | None = None,
    prescaled: bool = False,
    outer: int = 1,
) -> tuple[jax.Array, int]:
    """One bucket's collective. Every scaling is done in fp32 (or wider) before any rounding.

    ``x``: the packed bucket, or its :class:`Unpacked` gradients (then the elementwise work
    before the collective is done gradient by gradient, and they are packed after it).

    ``axis`` / ``dp`` (default ``layout.dp_size``) name the bucket's reduction group
    (:class:`jaxdp._src.topology.group.BucketGroup`); ``wire`` says how it reduces.
    ``prescaled``: ``x`` is already divided by ``G x dp`` (the loss was,
    :mod:`jaxdp._src.strategy.loss_divisor`); the collective sums it and divides by nothing.
    ``outer``: the number of instances whose results the caller sums afterwards
    (hierarchical groups, :class:`jaxdp._src.topology.group.BucketGroup`): the mean divides
    by ``dp * outer`` here, the outer sum divides by nothing.

    Returns ``(reduced, divisor)``. With ``deferred=False`` the result is final (``divisor`` is
    1). With ``deferred=True`` (stage 2: ``x`` is one micro-batch's gradient and the caller adds
    the results of all ``G`` micro-batches), fp32 paths return the unscaled sum in fp32 and the
    divisor the caller applies once to the accumulated sum (:func:`finish_deferred`), so the
    micro-batch sum is never rounded to a scaled value before it is complete.
    """
    dp = layout.dp_size if dp is None else dp
    g = num_microbatches
    wdt = jnp.dtype(b.grad_dtype)  # this bucket's wire dtype
    acc = float_for_sum(wdt)
    scatter = layout.kind != "contiguous"
    # Per-token loss: the engine divides by the global token count after the reduction.
    # Prescaled: the loss carried the divisor (its power of two commutes with every rounding).
    per_token = wire.per_token or prescaled
    g_div = 1 if per_token else g
    dp_div = 1 if per_token else dp * outer
    left = (
        deferred_divisor(b, layout, wire, g, dp=dp, prescaled=prescaled, outer=outer)
        if deferred
        else 1
    )

    if wire.all_to_all:
        # all_to_all on the wire, then a local sum in fp32. The 1/G of micro-batch accumulation
        # is applied before the cast (the value on the wire has the magnitude of one gradient;
        # with G = 1, or per micro-batch at stage 2, nothing is scaled, so bf16 gradients
        # travel exactly). The 1/dp is applied after the fp32 sum, so it is never rounded to
        # the wire dtype (Megatron pre-scales by 1/dp in bf16, inexact unless dp = 2**k).
        n = x.shape[0]
        pad = (-n) % dp  # contiguous (stage-0) buckets need not divide by dp
        sent = _apply(x, lambda v: divided(v, 1 if deferred else g_div, acc).astype(wdt))
        if pad:
            sent = jnp.pad(sent, (0, pad))
        total = ordered_reduce_scatter(sent, axis, dp, acc)
        if deferred and scatter:
            return total, left
        out = divided(total, dp_div, acc)
        if scatter:
            return out.astype(wdt), 1
        full = _all_gather_invariant(out.astype(wdt), axis, tiled=True)
        return (full[:n] if pad else full), 1

    if wdt.itemsize >= 4:
        # An fp32 (or wider) wire: cast first (exact for bf16 gradients), sum unscaled, then
        # divide once by G * dp. No rounding of the gradients happens before the sum. (With
        # ``prescaled`` the loss carried the power-of-two G * dp: div is 1, nothing to scale.)
        x = then(x, lambda v: v.astype(wdt))
        div = g_div * dp_div
        if not scatter and div & (div - 1) == 0:
            # An all-reduce and a power of two: scaling before the sum rounds exactly as after
            # it (barring subnormals), and fuses into the gradient's producer instead of being
            # a pass of its own over the reduced gradient, which the norm and the update both
            # read. (A reduce-scatter's shard is scaled after: 1/dp of the elements, fused
            # into the update.)
            return jax.lax.psum(_apply(x, lambda v: divided(v, div, wdt)), axis), 1
        x = _apply(x, lambda v: v)
        out = jax.lax.psum(x, axis) if not scatter else _psum_scatter(x, axis)
        if deferred and scatter:
            return out, left
        return divided(out, div, wdt), 1

    # A low-precision wire without fp32 accumulation (NCCL's bf16 ring): pre-scale in fp32 and
    # round once to the wire dtype; the collective itself sums in the wire dtype.
    avg = wire.average_in_collective and not per_token
    pre = g_div if avg else g_div * dp_div
    if deferred and scatter and not avg and g == 1 and pre & (pre - 1) == 0:
        # A power of two commutes with every rounding of the sum (barring subnormals), so
        # the caller's one division of the fp32 shard applies it, bit for bit as a pre-scale
        # would: the gradient goes on the wire as its GEMM wrote it, with no pass of its own
        # to scale it (less traffic per step for the 100.7M GPT at stages 1 and 3, measured
        # with bench/bench_traffic.py). Not with micro-batches: there each one's shard is scaled
        # before it is accumulated, which kept the loop's buffers smaller (ZeRO-3, G = 4,
        # compiled for compile-only GPUs).
        return _psum_scatter(_apply(x, lambda v: v.astype(wdt)), axis), left
    x = _apply(x, lambda v: divided(v, pre, acc).astype(wdt))
    out = jax.lax.psum(x, axis) if not scatter else _psum_scatter(x, axis)
    if avg:
        out = divided(out, dp * outer, acc).astype(wdt)
    return out, 1


def outer_reduce(
    x: jax.Array, axis: str, n: int, wire: Wire, wire_dtype: Any, scatter: bool
) -> jax.Array:
    """Combine the instances' reduced shards (hierarchical data parallelism), once per step:
    ``x`` is this rank's shard of its instance's mean (every division already done,
    :func:`reduce_one` with ``outer``), summed over the ``n`` ranks of ``axis`` (the outer
    axis). ``scatter``: a tiled reduce-scatter (``outer_dp_sharding_strategy="optim"``), else
    an all-reduce. The wire carries ``wire_dtype`` (the bucket's gradient dtype: fp32 with
    ``grad_reduce_in_fp32``, so both levels sum in fp32); with :attr:`Wire.all_to_all`
    (``reduce_scatter_with_fp32_accumulation``, ``deterministic_reduction``) the values
    travel in ``wire_dtype`` and are summed locally in fp32, in rank order, as within the
    instance. Returns ``x``'s dtype.
    """
    if n == 1:
        return x
    wdt = jnp.dtype(wire_dtype)
    acc = float_for_sum(wdt)
    sent = x.astype(wdt)
    if wire.all_to_all:
        if scatter:
            return ordered_reduce_scatter(sent, axis, n, acc).astype(x.dtype)
        every = _all_gather_invariant(sent, axis, tiled=False)
        return jnp.sum(every.astype(acc), axis=0).astype(x.dtype)
    out = _psum_scatter(sent, axis) if scatter else jax.lax.psum(sent, axis)
    return out.astype(x.dtype)


def finish_deferred(acc: Sequence[jax.Array], divisors: Sequence[int]) -> tuple[jax.Array, ...]:
    """Divide each accumulated deferred shard (:func:`reduce_one`) by its divisor
    (correctly rounded), in its own dtype."""
    return tuple(divided(a, d, a.dtype) for a, d in zip(acc, divisors, strict=True))


def check_count(buckets: Sequence[jax.Array], layout: BucketLayout, who: str) -> None:
    if len(buckets) != len(layout.buckets):
        raise ValueError(
            f"{who}: got {len(buckets)} buckets; the layout has "
            f"{len(layout.buckets)}. Fix: pass layout.pack(grads)."
        )


def _psum_scatter(x: jax.Array, axis: str) -> jax.Array:
    return jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
