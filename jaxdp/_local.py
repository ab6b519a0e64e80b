"""The per-device half of a step: micro-batches in, reduced gradients and metrics out.

Runs inside ``jax.shard_map`` over the data-parallel group's axes. :func:`local_gradients` is
the same straight line for every ZeRO stage, mesh and layout; what differs is the *kernel* the
strategy hands it (:mod:`jaxdp._kernels`: reduce at the end, reduce every micro-batch, or
gather the params inside the differentiated function) and the bucket operations of the mesh
(:mod:`jaxdp._nested`):

1. the kernel prepares the params once (a varying copy, an up-front gather, the shards);
2. micro-batches ``1..G-1`` run in a ``lax.scan``, each adding its gradient to the kernel's
   accumulator; the last micro-batch is peeled out of the scan so that its backward pass and
   the bucket collectives form one straight-line region XLA can overlap;
3. the kernel finishes the reduction (one collective per bucket, or the deferred division);
4. the metrics: mean loss (or per-token loss), aux outputs, the global fp32 gradient norm and,
   with ``check_for_nan_in_grad``, the number of ranks that saw a non-finite gradient per
   parameter.

Everything here is a pure function of static inputs (``loss_fn``, the kernel, the config).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import DDPConfig
from ._reduce import metric_sum

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
    kernel: Any,
    config: DDPConfig,
    group: Any,
) -> tuple[Any, dict[str, Any]]:
    """Per-device body of the step: reduced gradients and metrics (call inside ``shard_map``).

    Args:
        params: this rank's params in the strategy's form (replicated working params, or the
            shard view of them at stage 3 / ``overlap_param_gather``).
        batch: this rank's slice of the global batch (``G`` micro-batches along axis 0).
        kernel: the strategy's gradient kernel (:class:`jaxdp._kernels.Kernel`), built around
            the user's loss (see :func:`loss_parts`).
        config: the :class:`DDPConfig`.
        group: the :class:`jaxdp._group.ReductionGroup` (metric sums run over its axes).

    Returns:
        ``(grads, metrics)``: the reduced fp32 gradients (params-shaped, or this rank's shard
        view when ``kernel.sharded``) and the metrics dict (``loss``, ``grad_norm``,
        optionally ``aux``, ``num_tokens``, ``nonfinite_ranks``).
    """
    cfg, axis = config, group.axes
    g, dp = cfg.num_microbatches, group.size
    mbs = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)
    mb0 = jax.tree.map(lambda x: x[0], mbs)
    ctx = kernel.prepare(params, mb0)

    def micro(carry: Any, mb: Any) -> tuple[Any, None]:
        acc, loss, ntok, ok, aux_sum = carry
        (lval, (nt, aux)), acc, ok = kernel.micro(ctx, acc, ok, mb)
        if aux is not None:
            aux_sum = jax.tree.map(lambda s, a: s + jnp.asarray(a, jnp.float32), aux_sum, aux)
        return (acc, loss + lval.astype(jnp.float32), ntok + nt, ok, aux_sum), None

    aux_shape = jax.eval_shape(lambda: kernel.forward(ctx, mb0)[1][1])  # forward only
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    ok0 = jnp.ones((len(kernel.layout.slots),), bool)
    zero = jnp.zeros((), jnp.float32)
    # The scan carry must be varying like the per-device gradients it accumulates.
    carry = jax.tree.map(
        lambda v: jax.lax.pcast(v, axis, to="varying"), (kernel.acc0(), zero, zero, ok0, aux0)
    )
    if g > 1:
        head = jax.tree.map(lambda x: x[:-1], mbs)
        carry, _ = jax.lax.scan(micro, carry, head)
    # The last micro-batch is peeled out of the scan: its backward and the bucket
    # collectives below are one straight-line region that XLA can overlap.
    last = kernel.order_last(jax.tree.map(lambda x: x[-1], mbs), carry[1])
    (acc, loss, ntok, ok, aux_sum), _ = micro(carry, last)

    red = tuple(r.astype(jnp.float32) for r in kernel.finish(acc))
    metrics: dict[str, Any] = {}
    if cfg.calculate_per_token_loss:
        tokens = metric_sum(ntok, cfg, axis)
        inv = 1.0 / jnp.maximum(tokens, 1.0)
        red = tuple(r * inv for r in red)
        metrics["loss"] = metric_sum(loss, cfg, axis) * inv
        metrics["num_tokens"] = tokens
    else:
        metrics["loss"] = metric_sum(loss / g, cfg, axis) / dp
    if aux_sum is not None and jax.tree.leaves(aux_sum):
        metrics["aux"] = jax.tree.map(lambda a: metric_sum(a / g, cfg, axis) / dp, aux_sum)
    metrics["grad_norm"] = jnp.sqrt(kernel.square_norm(red))
    if cfg.check_for_nan_in_grad:
        metrics["nonfinite_ranks"] = jax.lax.psum((~ok).astype(jnp.int32), axis)
    return kernel.out(red), metrics
