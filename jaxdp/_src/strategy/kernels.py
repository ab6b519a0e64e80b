"""Gradient kernels: how one rank turns micro-batches into (reduced) gradients.

A kernel is the per-device part of a ZeRO strategy (:mod:`jaxdp._src.strategy.strategy`), run by
the straight-line body :func:`jaxdp._src.strategy.local.local_gradients` inside the step's
``shard_map``. It is composed of two parts the plan picks, and none branches on the stage again:

* an :class:`Accumulator`, how micro-batch gradients add up on one rank:

  - :class:`Buckets`: flat buckets of ``main_grads_dtype``. With one micro-batch the gradients
    are packed right before their collective (``ops.pack_later``: a large contiguous bucket
    takes the collective's casts and scaling gradient by gradient,
    :class:`jaxdp._src.comm.reduce.Unpacked`).
  - :class:`PerParameter`: one accumulator per parameter, of its own shape, packed into
    buckets once after the last micro-batch. ``acc + dot`` then has the weight gradient's
    shape, so XLA can make the accumulation the weight-gradient GEMM fusion's epilogue instead
    of a separate pass over a packed bucket; elementwise the sums are the same. The plan uses
    it with micro-batches wherever the params are whole on each device.
  - :class:`Sharded`: this rank's shards, summing reduced gradients.

* a :class:`Reduction`, when and how they are reduced:

  - :class:`AtEnd`: one collective per bucket after the loop (all-reduce at stage 0;
    reduce-scatter at stage 1 and stage 2 with one micro-batch; :mod:`jaxdp._src.comm.reduce`).
  - :class:`EachMicrobatch` (stage 2): every micro-batch's buckets are reduce-scattered into
    the sharded accumulator (``G`` times the communication, ``1/dp`` of the accumulator
    memory), divided once at the end.
  - :class:`InGrad` (stage 3): the params arrive as shards and are gathered inside the
    differentiated function (:mod:`jaxdp._src.zero3.gather`; per layer for scanned stacks,
    :mod:`jaxdp._src.zero3.scan`); the gather's transpose is stage 2's reduce-scatter.

With ``overlap_param_gather`` (stages 1-2) the params arrive as shards and the kernel gathers
them once, up front (``gather_first``). Each sharded reduction's divisors are static values
(:func:`jaxdp._src.comm.reduce.deferred_divisor`), computed when the kernel is built.
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
from ..platform.gemm_padding import backward_fence
from ..zero3.gather import varying_over, zero3_divisors
from .loss_divisor import value_and_divided_grad
from .spec import StepSpec

__all__ = [
    "Accumulator",
    "AtEnd",
    "Buckets",
    "EachMicrobatch",
    "InGrad",
    "Kernel",
    "PerParameter",
    "Reduction",
    "Sharded",
]


def _plus(acc: Any, red: Any, dtype: Any) -> tuple[jax.Array, ...]:
    """``acc + red`` elementwise in ``dtype``; ``acc`` is ``None`` for the first (with one
    micro-batch, the only) addend: no zeros to build and add."""
    if acc is None:
        return tuple(r.astype(dtype) for r in red)
    return tuple(a + r.astype(dtype) for a, r in zip(acc, red, strict=True))


def _finite_flags(grads: Any) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(grads)])


class Accumulator:
    """How one rank's micro-batch gradients add up (a kernel's first half, module docstring)."""

    def start(self, k: Kernel, ctx: Any) -> None:
        """Once per step, after the kernel's context is built."""

    def zeros(self, k: Kernel) -> Any:
        """The zero accumulator (with one micro-batch the first addend starts it instead)."""
        raise NotImplementedError

    def add(self, k: Kernel, acc: Any, grads: Any) -> Any:
        """``acc + grads`` (``acc`` is ``None`` for the first addend)."""
        raise NotImplementedError

    def packed(self, k: Kernel, acc: Any) -> Any:
        """The accumulated gradient as the end-of-step collectives take it (one per bucket)."""
        raise NotImplementedError


class Buckets(Accumulator):
    """Flat buckets of ``main_grads_dtype``. With one micro-batch the gradients themselves,
    packed right before their collective (``ops.pack_later``: a large contiguous bucket takes
    the collective's casts and scaling gradient by gradient)."""

    def zeros(self, k: Kernel) -> Any:
        return k.ops.zeros(k.ops.numels(sharded=False), k.acc_dt)

    def add(self, k: Kernel, acc: Any, grads: Any) -> Any:
        if acc is None and k.g == 1:
            return grads  # packed by packed(), with the collective's casts and scaling
        flat = k.ops.pack(grads, k.acc_dt)
        return flat if acc is None else tuple(a + f for a, f in zip(acc, flat, strict=True))

    def packed(self, k: Kernel, acc: Any) -> Any:
        return k.ops.pack_later(acc, k.acc_dt) if k.g == 1 else acc


class PerParameter(Accumulator):
    """One ``main_grads_dtype`` array per parameter, shaped like it, packed into buckets once
    at the end: ``acc + dot`` has the weight gradient's shape, so XLA can make the add the
    weight-gradient GEMM's epilogue (module docstring)."""

    def start(self, k: Kernel, ctx: Any) -> None:
        k.acc_shapes = jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, k.acc_dt), ctx[0])

    def zeros(self, k: Kernel) -> Any:
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), k.acc_shapes)

    def add(self, k: Kernel, acc: Any, grads: Any) -> Any:
        if acc is None:
            return jax.tree.map(lambda g: g.astype(k.acc_dt), grads)
        return jax.tree.map(lambda a, g: a + g.astype(k.acc_dt), acc, grads)

    def packed(self, k: Kernel, acc: Any) -> Any:
        return k.ops.pack_later(acc, k.acc_dt)


class Sharded(Accumulator):
    """This rank's shard of every bucket (or parameter), summing reduced shards."""

    def zeros(self, k: Kernel) -> Any:
        return k.ops.zeros(k.ops.numels(sharded=True), k.acc_dt)

    def add(self, k: Kernel, acc: Any, grads: Any) -> Any:
        return _plus(acc, grads, k.acc_dt)


class Reduction:
    """When and how the gradients are reduced (a kernel's second half, module docstring).

    Attributes:
        peel_last: whether the plan may peel the last micro-batch out of the scan (see
            :attr:`Kernel.peel_last`): only where the reduction follows the loop.
        sharded: the reduced gradients are this rank's shard view (stages >= 1).
    """

    peel_last = True
    sharded = True

    def divisors(self, k: Kernel) -> tuple[int, ...]:
        """What each reduced array is left to be divided by after its collective, once
        (:func:`jaxdp._src.comm.reduce.finish_deferred`): static, known before tracing."""
        return k.ops.deferred_divisors(k.g)

    def prepare(self, k: Kernel, params: Any, mb0: Any) -> Any:
        """Once per step: the context the gradient function runs in. Differentiates w.r.t.
        a *varying* copy made outside the differentiated function: AD then yields per-device
        partial gradients and inserts no psum per use."""
        wv = k.ops.varying(k.source(params))
        d = k.ops.loss_divisor  # carried by the loss; the reductions only sum (ops)
        # StepSpec.fence_backward: weights XLA may pad; their padded copies stay out of the
        # forward pass (jaxdp._src.platform.gemm_padding)
        fence = backward_fence if k.spec.fence_backward else (lambda f: f)
        if not k.spec.fusion:
            return wv, value_and_divided_grad(fence(k.parts), d), k.parts
        # jaxdp.nn kernels differentiated as fp32: those of nn.scan stacks lifted once, here,
        # the others in each micro-batch's own body (jaxdp._src.core.fusion.Lift says why).
        lift, fused = fused_function(k.parts, wv, mb0)
        vg = value_and_divided_grad(fence(fused), d)
        within = lift.within
        return lift.ahead(wv), lambda w, mb: vg(within(w), mb), lambda w, mb: fused(within(w), mb)

    def forward(self, k: Kernel, ctx: Any, mb: Any) -> Any:
        return ctx[2](ctx[0], mb)

    def setup(self, k: Kernel) -> Any:
        """Once per trace, when the kernel is built: what :meth:`prepare` builds on."""
        return None

    def gradient(self, k: Kernel, ctx: Any, mb: Any) -> tuple[Any, Any, Callable[[], Any]]:
        """One micro-batch: ``(loss_parts output, its gradient, finite)``; ``finite()`` gives
        the per-parameter finite flags (asked after the gradient is accumulated)."""
        wv, grad_fn, _ = ctx
        out, grads = grad_fn(wv, mb)
        return out, grads, lambda: _finite_flags(grads)

    def each(self, k: Kernel, grads: Any) -> Any:
        """What a micro-batch's gradient becomes before it is accumulated."""
        return grads

    def finish(self, k: Kernel, acc: Any) -> tuple[jax.Array, ...]:
        """The accumulated gradient, reduced: one array per bucket (full or this rank's shard)."""
        raise NotImplementedError


class AtEnd(Reduction):
    """One collective per bucket after the micro-batch loop: an all-reduce of the full
    buckets (``sharded=False``, stage 0) or a reduce-scatter divided once in
    ``main_grads_dtype`` (stage 1, stage 2 with one micro-batch)."""

    def __init__(self, sharded: bool):
        self.sharded = sharded

    def finish(self, k: Kernel, acc: Any) -> tuple[jax.Array, ...]:
        packed = k.accumulator.packed(k, acc)
        if not self.sharded:
            return k.ops.reduce(packed, k.g)
        # Reduce-scattered as a micro-batch is, then divided once in main_grads_dtype: the
        # same bits as the final collective (jaxdp._src.comm.reduce.reduce_one), but a power-of-two
        # 1/(G dp) is applied to this rank's shard, fused into the update, rather than to the
        # whole gradient before the wire in a pass of its own. (Where the loss carried it,
        # jaxdp._src.strategy.loss_divisor, every divisor is 1 and nothing is divided here.)
        red = k.ops.reduce_microbatch(packed, k.g)
        return finish_deferred(tuple(r.astype(k.acc_dt) for r in red), k.divisors)


class EachMicrobatch(Reduction):
    """Stage 2: every micro-batch's buckets are reduce-scattered into the (sharded)
    accumulator, ``G`` times the communication for ``1/dp`` of the accumulator memory, and
    divided once at the end."""

    peel_last = False

    def each(self, k: Kernel, grads: Any) -> Any:
        return k.ops.reduce_microbatch(k.ops.pack(grads, k.acc_dt), k.g)

    def finish(self, k: Kernel, acc: Any) -> tuple[jax.Array, ...]:
        return finish_deferred(acc, k.divisors)  # one correctly rounded division of the sums


class InGrad(Reduction):
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

    def __init__(self, value_and_grad: Callable[..., Any], pre: Callable[..., Any]):
        self.value_and_grad, self.pre = value_and_grad, pre

    def divisors(self, k: Kernel) -> tuple[int, ...]:
        # one per accumulator: per bucket, or per parameter (PerParamOps)
        return k.ops.per_array(zero3_divisors(k.layout, k.ops.wire, k.g, k.ops.group.levels))

    def setup(self, k: Kernel) -> Any:
        layout, axis = k.layout, k.ops.axis
        vg, loss = self.value_and_grad(
            k.parts, layout, k.ops.wire, num_microbatches=k.g, place=k.ops.place
        )
        vary = lambda t: jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), t)  # noqa: E731
        # one accumulator per bucket, or per parameter (PerParamOps: reduces_per_parameter)
        accs0 = vary(k.ops.zeros(k.ops.numels(True), k.acc_dt))
        flags0 = vary(k.ops.zeros([len(b.slots) for b in layout.buckets], jnp.float32))
        slot_pos = [(bi, j) for bi, b in enumerate(layout.buckets) for j, _ in enumerate(b.slots)]
        slot_ids = [i for b in layout.buckets for i in b.slots]
        order = sorted(range(len(slot_ids)), key=lambda i: slot_ids[i])
        return vg, loss, accs0, flags0, [slot_pos[i] for i in order]

    def prepare(self, k: Kernel, params: Any, mb0: Any) -> Any:
        # varying over the whole group (a hierarchical view is the same on every instance):
        # the gathers' transpose then leaves the instances' sum to the end of the step
        return jax.tree.map(lambda v: varying_over(v, k.ops.axis), self.pre(params))

    def forward(self, k: Kernel, ctx: Any, mb: Any) -> Any:
        _, loss, accs0, flags0, _ = k.setup
        return loss(accs0, flags0, ctx, mb)

    def gradient(self, k: Kernel, ctx: Any, mb: Any) -> tuple[Any, Any, Callable[[], Any]]:
        vg, _, accs0, flags0, slot_pos = k.setup
        out, (red, bad) = vg(accs0, flags0, ctx, mb)

        def finite() -> Any:
            flags = k.ops.bucket_flags(bad)
            return jnp.stack([flags[bi][j] for bi, j in slot_pos]) == 0

        return out, red, finite

    def finish(self, k: Kernel, acc: Any) -> tuple[jax.Array, ...]:
        return finish_deferred(acc, k.divisors)


class Kernel:
    """The interface :func:`jaxdp._src.strategy.local.local_gradients` drives (one instance per
    trace): an :class:`Accumulator` and a :class:`Reduction`, composed.

    Args:
        parts: the user's loss as ``loss_parts`` (``(loss, (num_tokens, aux, state))``).
        layout, spec, ops: the bucket layout, the step spec and the bucket operations.
        accumulator: :class:`Buckets`, :class:`PerParameter` or :class:`Sharded`.
        reduction: :class:`AtEnd`, :class:`EachMicrobatch` or :class:`InGrad`.
        peel_last: run the last of ``G > 1`` micro-batches outside the ``lax.scan`` (see
            :func:`jaxdp._src.strategy.local.local_gradients`): right where the gradients are
            reduced after the loop, so that the last backward overlaps those collectives. Only
            where the reduction follows the loop (:attr:`Reduction.peel_last`): a peeled copy
            of the model would have nothing to overlap and doubles the program XLA compiles.
            The plan turns it off where the group has one rank (no collective to overlap) and
            with ``overlap_grad_reduce=False`` (no overlap wanted).
        gather_first: ``overlap_param_gather``: the params arrive as shards; gather them once,
            up front.
        order_metrics: (stage 0, buckets of whole parameters all-reduced with a ``psum``, more
            than one rank) the step's metric and model-state sums wait for every bucket's
            all-reduce (:meth:`after_reduction`). Otherwise XLA's all-reduce combiner may merge
            the loss's ``psum`` with a bucket's of the same dtype (the last, partly filled
            bucket is under the combine threshold), and XLA:GPU copies the operands of a
            combined all-reduce into one buffer and back: two more passes over that bucket
            for one scalar (BENCHMARKS.md section 11).
    """

    def __init__(
        self,
        parts: Callable[[Any, Any], Any],
        layout: BucketLayout,
        spec: StepSpec,
        ops: Any,
        *,
        accumulator: Accumulator,
        reduction: Reduction,
        peel_last: bool = True,
        gather_first: bool = False,
        order_metrics: bool = False,
    ):
        self.parts, self.layout, self.spec, self.ops = parts, layout, spec, ops
        self.accumulator, self.reduction = accumulator, reduction
        self.peel_last = peel_last and reduction.peel_last
        self.source = ops.gather_full if gather_first else (lambda p: p)
        self.order_metrics = order_metrics
        self.g = spec.num_microbatches
        self.acc_dt = ops.wire.accumulate
        self.check_nan = ops.wire.check_nan
        self.divisors = reduction.divisors(self) if reduction.sharded else ()
        self.setup = reduction.setup(self)  # once per trace, before the step's context
        self.acc_shapes: Any = None  # PerParameter: the accumulators' shapes (prepare sets them)

    def prepare(self, params: Any, mb0: Any) -> Any:
        """Once per step, before the micro-batch loop: the per-step context."""
        ctx = self.reduction.prepare(self, params, mb0)
        self.accumulator.start(self, ctx)
        return ctx

    def forward(self, ctx: Any, mb: Any) -> Any:
        """``loss_parts`` of one micro-batch (traced for shapes only)."""
        return self.reduction.forward(self, ctx, mb)

    def acc0(self) -> Any:
        """The zero accumulator (used with micro-batches; with one, the first addend starts
        it: :meth:`micro` takes ``acc=None``)."""
        return self.accumulator.zeros(self)

    def micro(self, ctx: Any, acc: Any, ok: Any, mb: Any) -> tuple[Any, Any, Any]:
        """One micro-batch: ``(loss_parts output, acc + its gradient, ok & finite)``."""
        out, grads, finite = self.reduction.gradient(self, ctx, mb)
        acc = self.accumulator.add(self, acc, self.reduction.each(self, grads))
        if self.check_nan:
            ok = ok & finite()
        return out, acc, ok

    def finish(self, acc: Any) -> tuple[jax.Array, ...]:
        """The accumulated gradient, reduced: one array per bucket (full or this rank's shard).
        With a hierarchical group the instances' shards are combined here, once per step,
        after the last micro-batch (``ops.outer``)."""
        red = self.reduction.finish(self, acc)
        return self.ops.outer(red) if self.reduction.sharded else red

    def out(self, red: Any) -> Any:
        """The reduced buckets as the gradients the optimizer takes (params-shaped, or this
        rank's shard view)."""
        return self.ops.out_shards(red) if self.reduction.sharded else self.ops.out_full(red)

    def square_norm(self, red: Any) -> jax.Array:
        """Squared global L2 norm of the reduced gradients (the same on every rank)."""
        if not self.reduction.sharded:
            return self.ops.square_norm(red)
        return self.ops.shard_sum(self.ops.square_norm(red, self.divisors))

    def order_last(self, last: Any, loss: Any) -> Any:
        """The last micro-batch, ordered after the loop's result ``loss`` where that helps.

        The last micro-batch does not depend on the scan, and XLA's scheduler hoists its
        forward pass (and the start of its backward) above the loop, keeping its activations
        and a packed gradient bucket alive through it: start it after the loop instead
        (compiled for GPUs, when stage 2 still peeled its last micro-batch, this lowered its
        peak at G = 4; measured with bench/bench_memory_gpu.py)."""
        if self.reduction.peel_last and self.g > 1:
            return after(last, loss)
        return last

    def after_reduction(self, parts: Any, red: Any) -> Any:
        """``parts`` (what the step sums over the group next: the loss, token count, aux and
        model state), ordered after the reduced gradients ``red`` where the kernel was built
        with ``order_metrics``."""
        return after(parts, red) if self.order_metrics else parts
