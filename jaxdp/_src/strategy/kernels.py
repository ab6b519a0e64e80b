"""Gradient kernels: how one rank turns a micro-batch into (reduced) gradients.

A kernel is the per-device part of a ZeRO strategy (:mod:`jaxdp._src.strategy.strategy`), run by the
straight-line body :func:`jaxdp._src.strategy.local.local_gradients` inside the step's
``shard_map``. The
plan picks one per engine; none branches on the stage again:

* :class:`ReduceAtEnd` (stage 0) / :class:`ScatterAtEnd` (stage 1, stage 2 with one
  micro-batch): micro-batches accumulate into flat buckets of ``main_grads_dtype`` with no
  communication, then one collective per bucket (all-reduce for a contiguous layout,
  reduce-scatter otherwise; :mod:`jaxdp._src.comm.reduce`). With one micro-batch the gradients are
  packed right before their collective (``ops.pack_later``: a large contiguous bucket takes
  the collective's casts and scaling gradient by gradient,
  :class:`jaxdp._src.comm.reduce.Unpacked`).
* :class:`ReduceAtEndPerParam` / :class:`ScatterAtEndPerParam`: the same with one fp32
  accumulator per parameter, of the parameter's own shape, packed into buckets once, after the
  last micro-batch (fused with its add). ``acc + dot`` then has the weight gradient's shape, so
  XLA can make the accumulation the weight-gradient GEMM fusion's epilogue instead of a
  separate pass over a packed bucket (compiled for GPUs: the fusion's root is ``acc + dot``);
  elementwise the sums are the same. The plan uses these with micro-batches wherever the
  params are whole on each device.
* :class:`ReduceEachMicrobatch` (stage 2): every micro-batch's buckets are reduce-scattered
  into a sharded accumulator (``G`` times the communication, ``1/dp`` of the accumulator
  memory), divided once at the end.
* :class:`GatherInGrad` (stage 3): the params arrive as shards and are gathered inside the
  differentiated function (:mod:`jaxdp._src.zero3.gather`; per layer for scanned stacks,
  :mod:`jaxdp._src.zero3.scan`); the gather's transpose is stage 2's reduce-scatter.

With ``overlap_param_gather`` (stages 1-2) the params arrive as shards too and
:class:`ScatterAtEnd` / :class:`ReduceEachMicrobatch` gather them once, up front.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..comm.order import after
from ..comm.reduce import finish_deferred
from ..core.fusion import fused_function
from ..layout.layout import BucketLayout
from ..zero3.gather import zero3_divisors
from .loss_divisor import value_and_divided_grad
from .spec import StepSpec

__all__ = [
    "GatherInGrad",
    "Kernel",
    "ReduceAtEnd",
    "ReduceAtEndPerParam",
    "ReduceEachMicrobatch",
    "ScatterAtEnd",
    "ScatterAtEndPerParam",
]


def _plus(acc: Any, red: Any, dtype: Any) -> tuple[jax.Array, ...]:
    """``acc + red`` elementwise in ``dtype``; ``acc`` is ``None`` for the first (with one
    micro-batch, the only) addend: no zeros to build and add."""
    if acc is None:
        return tuple(r.astype(dtype) for r in red)
    return tuple(a + r.astype(dtype) for a, r in zip(acc, red, strict=True))


def _finite_flags(grads: Any) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(grads)])


class Kernel:
    """The interface :func:`jaxdp._src.strategy.local.local_gradients` drives (one instance per
    trace).

    Attributes:
        layout: the bucket layout.
        peel_last: run the last of ``G > 1`` micro-batches outside the ``lax.scan`` (see
            :func:`jaxdp._src.strategy.local.local_gradients`): right where the gradients are
            reduced
            after the loop, so that the last backward overlaps those collectives. Kernels
            that reduce inside every micro-batch's backward (stages 2-3) set it ``False``: a
            peeled copy of the model has nothing to overlap and doubles the program XLA
            compiles. The plan also turns it off where the group has one rank (no
            collective to overlap) and with ``overlap_grad_reduce=False`` (no overlap
            wanted); ``__init__``'s ``peel_last`` overrides the class's.
    """

    peel_last = True

    def out(self, red: Any) -> Any:
        """The reduced buckets as the gradients the optimizer takes (params-shaped)."""
        return self.ops.out_full(red)

    def square_norm(self, red: Any) -> jax.Array:
        """Squared global L2 norm of the reduced gradients (the same on every rank)."""
        return self.ops.square_norm(red)

    def __init__(
        self,
        parts: Callable[[Any, Any], Any],
        layout: BucketLayout,
        spec: StepSpec,
        ops: Any,
        *,
        peel_last: bool | None = None,
    ):
        self.parts, self.layout, self.spec, self.ops = parts, layout, spec, ops
        if peel_last is not None:
            self.peel_last = peel_last
        self.g = spec.num_microbatches
        self.acc_dt = ops.wire.accumulate
        self.check_nan = ops.wire.check_nan

    def prepare(self, params: Any, mb0: Any) -> Any:
        """Once per step, before the micro-batch loop: the per-step context."""
        raise NotImplementedError

    def forward(self, ctx: Any, mb: Any) -> Any:
        """``loss_parts`` of one micro-batch (traced for shapes only)."""
        raise NotImplementedError

    def acc0(self) -> Any:
        """The zero accumulator (used with micro-batches; with one, the first addend starts
        it: :meth:`micro` takes ``acc=None``)."""
        raise NotImplementedError

    def micro(self, ctx: Any, acc: Any, ok: Any, mb: Any) -> tuple[Any, Any, Any]:
        """One micro-batch: ``(loss_parts output, acc + its gradient, ok & finite)``."""
        raise NotImplementedError

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        """The accumulated gradient, reduced: one array per bucket (full or this rank's shard)."""
        raise NotImplementedError

    def order_last(self, last: Any, loss: Any) -> Any:
        """The last micro-batch, ordered after the loop's result ``loss`` where that helps."""
        return last

    def after_reduction(self, parts: Any, red: Any) -> Any:
        """``parts`` (what the step sums over the group next: the loss, token count, aux and
        model state), ordered after the reduced gradients ``red`` where the kernel was built
        with ``order_metrics`` (:class:`ReduceAtEnd`)."""
        return parts


class _Sharded(Kernel):
    """The reduced gradients are this rank's shard view (stages >= 1).

    ``divisors``: what each reduced array is left to be divided by after its collective, once
    (:func:`jaxdp._src.comm.reduce.finish_deferred`), static and known before anything is
    traced; the gradient norm is told them (:meth:`jaxdp._src.comm.nested.PlainOps.square_norm`)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.divisors = self._divisors()

    def _divisors(self) -> tuple[int, ...]:
        return self.ops.deferred_divisors(self.g)

    def out(self, red: Any) -> Any:
        return self.ops.out_shards(red)

    def square_norm(self, red: Any) -> jax.Array:
        return self.ops.group_sum(self.ops.square_norm(red, self.divisors))

    def _collective(self, packed: Any) -> tuple[jax.Array, ...]:
        # Reduce-scattered as a micro-batch is, then divided once in main_grads_dtype: the
        # same bits as the final collective (jaxdp._src.comm.reduce.reduce_one), but a power-of-two
        # 1/(G dp) is applied to this rank's shard, fused into the update, rather than to the
        # whole gradient before the wire in a pass of its own. (Where the loss carried it,
        # jaxdp._src.strategy.loss_divisor, every divisor is 1 and nothing is divided here.)
        red = self.ops.reduce_microbatch(packed, self.g)
        return finish_deferred(tuple(r.astype(self.acc_dt) for r in red), self.divisors)


class ReduceAtEnd(Kernel):
    """Accumulate local gradients in flat buckets, all-reduce once (module docstring).

    ``order_metrics`` (stage 0, buckets of whole parameters all-reduced with a ``psum``, more
    than one rank): the step's metric and model-state sums wait for every bucket's all-reduce
    (:meth:`after_reduction`). Otherwise XLA's all-reduce combiner may merge the loss's
    ``psum`` with a bucket's of the same dtype (the last, partly filled bucket is under the
    combine threshold), and XLA:GPU copies the operands of a combined all-reduce into one
    buffer and back: two more passes over that bucket for one scalar (seen compiled for GPUs
    with an fp32 wire, for the 100.7M GPT's largest bucket and a 100-leaf MLP's gradients;
    BENCHMARKS.md section 11).
    """

    def __init__(
        self,
        *args: Any,
        gather_first: bool = False,
        order_metrics: bool = False,
        **kw: Any,
    ):
        super().__init__(*args, **kw)
        # overlap_param_gather: the params arrive as shards; gather them once, up front.
        self.source = self.ops.gather_full if gather_first else (lambda p: p)
        self.order_metrics = order_metrics

    def prepare(self, params: Any, mb0: Any) -> Any:
        # Differentiate w.r.t. a *varying* copy made outside the differentiated function: AD
        # then yields per-device partial gradients and inserts no psum per use.
        wv = self.ops.varying(self.source(params))
        d = self.ops.loss_divisor  # carried by the loss; the reductions only sum (ops)
        if not self.spec.fusion:
            return wv, value_and_divided_grad(self.parts, d), self.parts
        # jaxdp.nn kernels differentiated as fp32: those of nn.scan stacks lifted once, here,
        # the others in each micro-batch's own body (jaxdp._src.core.fusion.Lift says why).
        lift, fused = fused_function(self.parts, wv, mb0)
        vg = value_and_divided_grad(fused, d)
        within = lift.within
        return lift.ahead(wv), lambda w, mb: vg(within(w), mb), lambda w, mb: fused(within(w), mb)

    def forward(self, ctx: Any, mb: Any) -> Any:
        return ctx[2](ctx[0], mb)

    def acc0(self) -> Any:
        return self.ops.zeros(self.ops.numels(sharded=False), self.acc_dt)

    def _add(self, acc: Any, grads: Any) -> Any:
        if acc is None and self.g == 1:
            return grads  # packed by finish, with the collective's casts and scaling
        flat = self.ops.pack(grads, self.acc_dt)
        return flat if acc is None else tuple(a + f for a, f in zip(acc, flat, strict=True))

    def micro(self, ctx: Any, acc: Any, ok: Any, mb: Any) -> tuple[Any, Any, Any]:
        wv, grad_fn, _ = ctx
        out, grads = grad_fn(wv, mb)
        acc = self._add(acc, grads)
        if self.check_nan:
            ok = ok & _finite_flags(grads)
        return out, acc, ok

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        if self.g == 1:  # the gradients themselves: the elementwise work, then the pack
            return self._collective(self.ops.pack_later(acc, self.acc_dt))
        return self._collective(acc)

    def _collective(self, packed: Any) -> tuple[jax.Array, ...]:
        return self.ops.reduce(packed, self.g)

    def after_reduction(self, parts: Any, red: Any) -> Any:
        return after(parts, red) if self.order_metrics else parts

    def order_last(self, last: Any, loss: Any) -> Any:
        # The last micro-batch does not depend on the scan, and XLA's scheduler hoists its
        # forward pass (and the start of its backward) above the loop, keeping its activations
        # and a packed gradient bucket alive through it: start it after the loop instead
        # (compiled for GPUs, when stage 2 still peeled its last micro-batch, this lowered
        # its peak at G = 4; measured with bench/bench_memory_gpu.py).
        return after(last, loss) if self.g > 1 else last


class ScatterAtEnd(_Sharded, ReduceAtEnd):
    """Stages 1-2 with one micro-batch: the same, reduce-scattered once."""


class _PerParamAccumulator(ReduceAtEnd):
    """Accumulate in one ``main_grads_dtype`` array per parameter, shaped like it; pack into
    buckets once, in :meth:`finish` (module docstring)."""

    def prepare(self, params: Any, mb0: Any) -> Any:
        ctx = super().prepare(params, mb0)
        self.acc_shapes = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, self.acc_dt), ctx[0])
        return ctx

    def acc0(self) -> Any:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.acc_shapes)

    def _add(self, acc: Any, grads: Any) -> Any:
        if acc is None:
            return jax.tree.map(lambda g: g.astype(self.acc_dt), grads)
        return jax.tree.map(lambda a, g: a + g.astype(self.acc_dt), acc, grads)

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        return self._collective(self.ops.pack_later(acc, self.acc_dt))


class ReduceAtEndPerParam(_PerParamAccumulator):
    """Stage 0 with micro-batches: per-parameter accumulators, all-reduced at the end."""


class ScatterAtEndPerParam(_Sharded, _PerParamAccumulator):
    """Stage 1 with micro-batches: per-parameter accumulators, reduce-scattered at the end."""


class ReduceEachMicrobatch(ScatterAtEnd):
    """Stage 2: reduce-scatter every micro-batch into a sharded fp32 accumulator."""

    peel_last = False

    def acc0(self) -> Any:
        return self.ops.zeros(self.ops.numels(sharded=True), self.acc_dt)

    def _add(self, acc: Any, grads: Any) -> Any:
        red = self.ops.reduce_microbatch(self.ops.pack(grads, self.acc_dt), self.g)
        return _plus(acc, red, self.acc_dt)

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        # one correctly rounded division of the accumulated sums
        return finish_deferred(acc, self.divisors)


class GatherInGrad(_Sharded, Kernel):
    """Stage 3: params held as shards, gathered bucket by bucket (or layer by layer) inside
    the differentiated function; the gathers' transpose reduce-scatters every micro-batch.

    ``value_and_grad`` is :func:`jaxdp._src.zero3.gather.zero3_value_and_grad` or, for a layout with
    scanned layer stacks, :func:`jaxdp._src.zero3.scan.zero3_scan_value_and_grad`; ``pre`` turns
    the shard view into what it takes (the plan picks both).

    Like stage 2 it runs every micro-batch in the scan (``peel_last = False``): a peeled copy
    of the model would have no end-of-step reduction to overlap, and doubles what XLA compiles.
    On GPUs the loop body's backward gathers need XLA's analytical cost model to stay in
    order (:func:`jaxdp.xla_compiler_options` sets it for this config, up to jaxlib 0.10: 0.11.2
    aborts in it, see ``jaxdp._src.platform.xla_flags.ANALYTICAL_ESTIMATOR_BROKEN``). Compiled for
    compile-only GPUs (a 6-layer GPT, G = 4, one bucket per layer), this program needs less
    memory per device and less compile time than the peeled one with XLA's default cost model
    (BENCHMARKS.md section 13)."""

    peel_last = False

    def __init__(
        self, *args: Any, value_and_grad: Callable[..., Any], pre: Callable[..., Any], **kw: Any
    ):
        super().__init__(*args, **kw)
        layout, axis = self.layout, self.ops.axis
        self.vg, self.loss = value_and_grad(
            self.parts, layout, self.ops.wire, num_microbatches=self.g, place=self.ops.place
        )
        self.pre = pre
        vary = lambda t: jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), t)  # noqa: E731
        # one accumulator per bucket, or per parameter (PerParamOps: reduces_per_parameter)
        self.accs0 = vary(self.ops.zeros(self.ops.numels(True), self.acc_dt))
        self.flags0 = vary(self.ops.zeros([len(b.slots) for b in layout.buckets], jnp.float32))
        slot_pos = [(bi, j) for bi, b in enumerate(layout.buckets) for j, _ in enumerate(b.slots)]
        slot_ids = [i for b in layout.buckets for i in b.slots]
        order = sorted(range(len(slot_ids)), key=lambda k: slot_ids[k])
        self.slot_pos = [slot_pos[k] for k in order]

    def _divisors(self) -> tuple[int, ...]:
        # one per accumulator: per bucket, or per parameter (PerParamOps)
        return self.ops.per_array(zero3_divisors(self.layout, self.ops.wire, self.g))

    def prepare(self, params: Any, mb0: Any) -> Any:
        return self.pre(params)

    def forward(self, ctx: Any, mb: Any) -> Any:
        return self.loss(self.accs0, self.flags0, ctx, mb)

    def acc0(self) -> Any:
        return self.ops.zeros(self.ops.numels(True), self.acc_dt)

    def micro(self, ctx: Any, acc: Any, ok: Any, mb: Any) -> tuple[Any, Any, Any]:
        out, (red, bad) = self.vg(self.accs0, self.flags0, ctx, mb)
        acc = _plus(acc, red, self.acc_dt)
        if self.check_nan:
            bad = self.ops.bucket_flags(bad)
            ok = ok & (jnp.stack([bad[bi][j] for bi, j in self.slot_pos]) == 0)
        return out, acc, ok

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        return finish_deferred(acc, self.divisors)
