"""The per-device half of a step: local gradients, micro-batch accumulation, bucket collectives.

Runs inside ``jax.shard_map`` over the data axis (manual over that axis):

1. each rank differentiates its local batch with respect to a *varying* copy of the replicated
   params (made outside the differentiated function, so autodiff inserts no collective per use);
2. micro-batches ``1..G-1`` accumulate into flat buffers of ``main_grads_dtype`` inside a
   ``lax.scan`` with no communication; the last micro-batch is peeled out of the scan so that
   its backward pass and the bucket collectives form one straight-line region XLA can overlap;
3. one collective per bucket (:mod:`jaxdp._reduce`). Stage 2 with ``G > 1`` reduce-scatters
   every micro-batch into a sharded accumulator instead and divides once at the end. Stage 3
   receives the params as shards and differentiates through the per-bucket gathers of
   :mod:`jaxdp._gather`, whose transpose is that same reduce-scatter (every micro-batch);
   with ``overlap_param_gather`` (stages 1-2) the shards are gathered once, up front. Scanned
   layer stacks are gathered (and reduce-scattered) one layer per scan iteration instead
   (:mod:`jaxdp._zero3_scan`);
4. the metrics: mean loss (or per-token loss), aux outputs, the global fp32 gradient norm and,
   with ``check_for_nan_in_grad``, the number of ranks that saw a non-finite gradient per
   parameter.

Everything here is a pure function of static inputs (``loss_fn``, the layout, the config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import DDPConfig
from ._gather import gather_full, zero3_value_and_grad
from ._layout import BucketLayout
from ._nested import PlainOps
from ._order import after
from ._reduce import finish_deferred, metric_sum
from ._zero3_scan import zero3_scan_value_and_grad
from .nn._fusion import fused_value_and_grad

__all__ = ["local_gradients", "loss_parts"]


def loss_parts(
    loss_fn: Callable[..., Any], config: DDPConfig, params: Any, mb: Any
) -> tuple[jax.Array, tuple[Any, Any]]:
    """``loss_fn``'s output as ``(loss, (num_tokens, aux))``, validated.

    ``num_tokens`` is the micro-batch's token count with ``calculate_per_token_loss`` (and a
    zero otherwise); ``aux`` is the second output of a ``(loss, aux)`` loss, or ``None``.
    """
    out = loss_fn(params, mb)
    if config.calculate_per_token_loss:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                "DataParallel: with calculate_per_token_loss=True, loss_fn must return "
                f"(loss_sum, num_tokens); got {type(out).__name__}."
            )
        loss_sum, ntok = out
        fix = (
            "return (loss_sum, num_tokens) for the micro-batch, both scalars: the sum of the "
            "per-token losses (e.g. jnp.sum(token_loss * mask)) and the token count "
            "(e.g. jnp.sum(mask))"
        )
        _check_scalar("loss_sum", loss_sum, mb, fix, floating=True)
        _check_scalar("num_tokens", ntok, mb, fix, floating=False)
        return loss_sum, (jnp.asarray(ntok, jnp.float32), None)
    fix = "return the mean over the micro-batch, e.g. jnp.mean(per_example_loss)"
    if isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(
                f"DataParallel: loss_fn must return loss or (loss, aux); got a tuple of {len(out)}."
            )
        loss, aux = out
        _check_scalar("loss (the first of (loss, aux))", loss, mb, fix, floating=True)
        return loss, (jnp.zeros((), jnp.float32), aux)
    _check_scalar("loss", out, mb, fix, floating=True)
    return out, (jnp.zeros((), jnp.float32), None)


def _check_scalar(what: str, x: Any, mb: Any, fix: str, *, floating: bool) -> None:
    """Raise if ``loss_fn``'s output ``x`` is not a scalar (a floating one if ``floating``).

    Runs while the step is traced, before XLA compiles anything (once per compilation, nothing
    per step), on the shapes ``loss_fn`` really sees: JAX's "Gradient only defined for
    scalar-output functions" and "grad requires real-valued outputs" become the output's name,
    shape and dtype and the fix.
    """
    if isinstance(x, (bool, int, float)):
        shape, dtype = (), np.result_type(type(x))
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        shape, dtype = tuple(x.shape), x.dtype
    else:
        raise TypeError(
            f"DataParallel: loss_fn returned a {type(x).__name__} as its {what} for one "
            f"micro-batch; expected a scalar array. Fix: {fix}."
        )
    not_float = floating and not jnp.issubdtype(dtype, jnp.floating)
    if shape == () and not not_float:
        return
    leaves = jax.tree.leaves(mb)
    size = leaves[0].shape[0] if leaves and leaves[0].ndim else "?"
    expected = "a floating-point scalar (gradients need a real float output)"
    if not not_float:
        expected = "a scalar"
    cast = ", in floating point (e.g. .astype(jnp.float32))" if not_float else ""
    raise ValueError(
        f"DataParallel: loss_fn returned a {what} of shape {shape} and dtype "
        f"{getattr(dtype, 'name', dtype)} for one micro-batch of {size} examples (on each "
        f"device); expected {expected}. Fix: {fix}{cast}."
    )


def local_gradients(
    params: Any,
    batch: Any,
    *,
    loss_fn: Callable[..., Any],
    layout: BucketLayout,
    config: DDPConfig,
    ops: PlainOps | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Per-device body of the step: reduced gradients and metrics (call inside ``shard_map``).

    Args:
        params: the replicated working params; with ``config.shards_params`` (stage 3,
            ``overlap_param_gather``) this rank's shard view of them instead.
        batch: this rank's slice of the global batch (``G`` micro-batches along axis 0).
        loss_fn: the user's loss (see :func:`loss_parts`).
        layout: the bucket layout of ``params``.
        config: the :class:`DDPConfig`.
        ops: the bucket operations (:mod:`jaxdp._nested`): ``None`` for whole params;
            ``NestedOps`` when params are split over other mesh axes.

    Returns:
        ``(grads, metrics)``: the reduced fp32 gradients, full and params-shaped at stage 0,
        else this rank's shard view (:meth:`BucketLayout.shard_view`); and the metrics dict
        (``loss``, ``grad_norm``, optionally ``aux``, ``num_tokens``, ``nonfinite_ranks``).
    """
    cfg = config
    axis, g, dp = cfg.data_axis, cfg.num_microbatches, layout.dp_size
    sharded = cfg.zero_stage >= 1
    zero3 = cfg.zero_stage == 3
    ops = PlainOps(layout, cfg) if ops is None else ops

    def parts(p: Any, mb: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        return loss_parts(loss_fn, cfg, p, mb)

    mbs = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)
    mb0 = jax.tree.map(lambda x: x[0], mbs)
    acc_dt = jnp.dtype(cfg.main_grads_dtype)
    # Stage 2 (G > 1) and stage 3 reduce-scatter every micro-batch into a sharded accumulator.
    deferred = (cfg.zero_stage == 2 and g > 1) or zero3
    divisors: list[tuple[int, ...]] = []

    def finite_flags(grads: Any) -> jax.Array:
        return jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(grads)])

    def varying(x: Any) -> Any:
        return jax.tree.map(lambda v: jax.lax.pcast(v, axis, to="varying"), x)

    if zero3:
        # params: this rank's shard view; every micro-batch gathers (and re-gathers in its
        # backward) each bucket, and the gather's transpose reduce-scatters its gradient.
        shards = layout.shard_unview(params)
        # Layer stacks (layout.stacked) are gathered one layer per scan iteration instead.
        z3 = zero3_scan_value_and_grad if layout.stacked else zero3_value_and_grad
        z3_vg, z3_divisors = z3(parts, layout, cfg, num_microbatches=g)
        accs0 = varying(tuple(jnp.zeros((b.shard_numel,), acc_dt) for b in layout.buckets))
        flags0 = varying(tuple(jnp.zeros((len(b.slots),), jnp.float32) for b in layout.buckets))
        slot_pos = [(bi, j) for bi, b in enumerate(layout.buckets) for j, _ in enumerate(b.slots)]
        slot_ids = [i for b in layout.buckets for i in b.slots]
        order = sorted(range(len(slot_ids)), key=lambda k: slot_ids[k])

        def forward(mb: Any) -> Any:  # only traced for shapes (eval_shape)
            full = tuple(jax.lax.all_gather(s, axis, tiled=True) for s in shards)
            return parts(layout.unpack(full), mb)
    else:
        if cfg.shards_params:  # overlap_param_gather: gather once, before the forward pass
            params = gather_full(params, layout, axis)
        # Differentiate w.r.t. a *varying* copy made outside the differentiated function: AD
        # then yields per-device partial gradients and inserts no psum per use.
        wv = ops.varying(params, axis)
        grad_fn = jax.value_and_grad(parts, has_aux=True)
        if cfg.gradient_accumulation_fusion:  # jaxdp.nn kernels differentiated as fp32
            wv, grad_fn = fused_value_and_grad(parts, wv, mb0, has_aux=True)

        def forward(mb: Any) -> Any:
            return parts(wv, mb)

    def micro(carry: Any, mb: Any) -> tuple[Any, None]:
        acc, loss, ntok, ok, aux_sum = carry
        if zero3:
            (lval, (nt, aux)), (red, bad) = z3_vg(
                accs0, flags0, shards if layout.stacked else params, mb
            )
            divisors.append(tuple(z3_divisors[-len(layout.buckets) :]))
            acc = tuple(a + r.astype(acc_dt) for a, r in zip(acc, red, strict=True))
            if cfg.check_for_nan_in_grad:
                flat_bad = jnp.stack([bad[bi][j] for bi, j in slot_pos])[jnp.asarray(order)]
                ok = ok & (flat_bad == 0)
        else:
            (lval, (nt, aux)), grads = grad_fn(wv, mb)
            flat = ops.pack(grads, acc_dt)
            if deferred:
                red, divs = ops.reduce_microbatch(flat, g)
                divisors.append(divs)  # static ints, the same at every trace
                acc = tuple(a + r.astype(acc_dt) for a, r in zip(acc, red, strict=True))
            else:
                acc = tuple(a + f for a, f in zip(acc, flat, strict=True))
            if cfg.check_for_nan_in_grad:
                ok = ok & finite_flags(grads)
        if aux is not None:
            aux_sum = jax.tree.map(lambda s, a: s + jnp.asarray(a, jnp.float32), aux_sum, aux)
        return (acc, loss + lval.astype(jnp.float32), ntok + nt, ok, aux_sum), None

    numel = (lambda b: b.shard_numel) if deferred else (lambda b: b.numel)
    acc0 = ops.zeros([numel(b) for b in layout.buckets], acc_dt)
    aux_shape = jax.eval_shape(lambda: forward(mb0)[1][1])  # forward only
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    ok0 = jnp.ones((len(layout.slots),), bool)
    zero = jnp.zeros((), jnp.float32)
    carry = (acc0, zero, zero, ok0, aux0)
    # The scan carry must be varying like the per-device gradients it accumulates.
    carry = varying(carry)
    if g > 1:
        head = jax.tree.map(lambda x: x[:-1], mbs)
        carry, _ = jax.lax.scan(micro, carry, head)
    # The last micro-batch is peeled out of the scan: its backward and the bucket
    # collectives below are one straight-line region that XLA can overlap.
    last = jax.tree.map(lambda x: x[-1], mbs)
    if g > 1 and not zero3:
        # The last micro-batch does not depend on the scan, and XLA's scheduler hoists its
        # forward pass (and the start of its backward) above the loop, keeping its activations
        # and a packed gradient bucket alive through it: start it after the loop instead
        # (compiled for H100s: stage 2, G = 4 peak 2.76 -> 2.23 B/param). Not at stage 3, whose
        # hoisted part is only its first gathers (there the order measured 2.75 -> 3.00).
        last = after(last, carry[1])
    (acc, loss, ntok, ok, aux_sum), _ = micro(carry, last)

    if deferred:  # one correctly rounded division of the accumulated sums
        red = finish_deferred(acc, divisors[-1])
    else:
        red = ops.reduce(acc, g)
    red = tuple(r.astype(jnp.float32) for r in red)
    metrics: dict[str, Any] = {}
    if cfg.calculate_per_token_loss:
        tokens = metric_sum(ntok, cfg)
        inv = 1.0 / jnp.maximum(tokens, 1.0)
        red = tuple(r * inv for r in red)
        metrics["loss"] = metric_sum(loss, cfg) * inv
        metrics["num_tokens"] = tokens
    else:
        metrics["loss"] = metric_sum(loss / g, cfg) / dp
    if aux_sum is not None and jax.tree.leaves(aux_sum):
        metrics["aux"] = jax.tree.map(lambda a: metric_sum(a / g, cfg) / dp, aux_sum)
    metrics["grad_norm"] = jnp.sqrt(ops.square_norm(red, sharded))
    if cfg.check_for_nan_in_grad:
        metrics["nonfinite_ranks"] = jax.lax.psum((~ok).astype(jnp.int32), axis)
    grads = ops.out(red, sharded)
    return grads, metrics
