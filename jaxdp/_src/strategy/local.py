"""The per-device half of a step: micro-batches in, reduced gradients and metrics out.

Runs inside ``jax.shard_map`` over the data-parallel group's axes. :func:`local_gradients` is
the same straight line for every ZeRO stage, mesh and layout; what differs is the *kernel* the
strategy hands it (:mod:`jaxdp._src.strategy.kernels`: reduce at the end, reduce every micro-batch,
or
gather the params inside the differentiated function) and the bucket operations of the mesh
(:mod:`jaxdp._src.comm.nested`):

1. the kernel prepares the params once (a varying copy, an up-front gather, the shards);
2. the micro-batches run in a ``lax.scan``, each adding its gradient to the kernel's
   accumulator; where the kernel reduces at the end (stages 0-1, ``Kernel.peel_last``: more
   than one rank and ``overlap_grad_reduce``) the last micro-batch is peeled out of the scan
   so that its backward pass and the bucket collectives form one straight-line region XLA
   can overlap;
3. the kernel finishes the reduction (one collective per bucket, or the deferred division);
4. the metrics: mean loss (or per-token loss), aux outputs, the global fp32 gradient norm and,
   with ``check_for_nan_in_grad``, the number of ranks that saw a non-finite gradient per
   parameter;
5. the model state (``DataParallel.init(params, model_state=...)``): each micro-batch's
   ``loss_fn`` gets the state the previous one returned, and the ranks' states are combined
   at the end (:func:`sync_model_state`). Each micro-batch's PRNG key is folded from the
   step's key and its global micro-batch position.

Everything here is a pure function of static inputs (``loss_fn``, the kernel, the step spec).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ..comm.reduce import metric_sum
from ..comm.wire import Wire
from ..core.loss import LossCall, warn_per_example_aux
from .spec import StepSpec

__all__ = ["local_gradients", "sync_model_state"]


def local_gradients(
    params: Any,
    batch: Any,
    *,
    kernel: Any,
    spec: StepSpec,
    wire: Wire,
    group: Any,
    call: LossCall = LossCall(),  # noqa: B008 - a frozen, hashable default
    model_state: Any = None,
    key: Any = None,
) -> tuple[Any, dict[str, Any], Any]:
    """Per-device body of the step: reduced gradients and metrics (call inside ``shard_map``).

    Args:
        params: this rank's params in the strategy's form (replicated working params, or the
            shard view of them at stage 3 / ``overlap_param_gather``).
        batch: this rank's slice of the global batch (``G`` micro-batches along axis 0).
        kernel: the strategy's gradient kernel (:class:`jaxdp._src.strategy.kernels.Kernel`), built
        around
            the user's loss (see :func:`loss_parts`).
        spec: the step's settings (:class:`jaxdp._src.strategy.spec.StepSpec`).
        wire: the reduction's spec (:class:`jaxdp._src.comm.wire.Wire`).
        group: the :class:`jaxdp._src.topology.group.ReductionGroup` (metric sums run over its
        axes).
        call: which keywords ``loss_fn`` gets (:class:`jaxdp._src.core.loss.LossCall`).
        model_state: the model state at the start of the step (the same on every rank), or
            ``None``; each micro-batch's ``loss_fn`` gets the state the previous one returned.
        key: the step's PRNG key, or ``None``; micro-batch ``m`` of rank ``r`` gets
            ``fold_in(key, r * G + m)``: its global micro-batch position.

    Returns:
        ``(grads, metrics, model_state)``: the reduced fp32 gradients (params-shaped, or this
        rank's shard view when ``kernel.sharded``), the metrics dict (``loss``,
        ``grad_norm``, optionally ``aux``, ``num_tokens``, ``nonfinite_ranks``) and the
        model state combined over the ranks (:func:`sync_model_state`; ``None`` without one).
    """
    axis, ordered = group.axes, wire.ordered_metrics
    g, dp = spec.num_microbatches, group.size
    mbs = jax.tree.map(lambda x: x.reshape(g, x.shape[0] // g, *x.shape[1:]), batch)
    mb0 = jax.tree.map(lambda x: x[0], mbs)
    first = g * group.rank() if call.rng else 0  # this rank's first global micro-batch

    def bind(mb: Any, state: Any, m: Any) -> Any:
        k = jax.random.fold_in(key, first + m) if call.rng else None
        return call.bind(mb, state, k)

    ctx = kernel.prepare(params, bind(mb0, model_state, 0))

    def micro(carry: Any, xs: Any) -> tuple[Any, None]:
        acc, loss, ntok, ok, aux_sum, state = carry
        mb, m = xs
        (lval, (nt, aux, state)), acc, ok = kernel.micro(ctx, acc, ok, bind(mb, state, m))
        if aux is not None:
            aux = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)
            aux_sum = aux if aux_sum is None else jax.tree.map(jnp.add, aux_sum, aux)
        return (acc, loss + lval.astype(jnp.float32), ntok + nt, ok, aux_sum, state), None

    aux0 = None
    if g > 1:
        # The scan's carry needs the aux shapes before the loss is traced: a forward pass
        # only, for them. (With one micro-batch the first sum is the aux itself, and the
        # model's forward is traced once, as under plain jit.) The state is an argument, not
        # a closure: flax nnx refuses to update Variables that were made in an outer trace.
        aux_shape = jax.eval_shape(
            lambda state: kernel.forward(ctx, bind(mb0, state, 0))[1][1], model_state
        )
        warn_per_example_aux(aux_shape, mb0)
        aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    ok0 = jnp.ones((len(kernel.layout.slots),), bool)
    zero = jnp.zeros((), jnp.float32)
    # The scan carry must be varying like the per-device gradients it accumulates.
    # With one micro-batch the accumulator starts as its gradient (no zeros to add to).
    carry = jax.tree.map(
        lambda v: jax.lax.pcast(v, axis, to="varying"),
        (kernel.acc0() if g > 1 else None, zero, zero, ok0, aux0, model_state),
    )
    # Where the kernel reduces at the end, the last micro-batch is peeled out of the scan: its
    # backward and the bucket collectives below are one straight-line region that XLA can
    # overlap. Kernels that reduce inside every micro-batch's backward (stages 2-3) have
    # nothing to overlap there, and a peeled copy of the model would double what XLA compiles.
    peel = g == 1 or kernel.peel_last
    if g > 1:
        n = g - 1 if peel else g
        head = jax.tree.map(lambda x: x[:n], mbs)
        carry, _ = jax.lax.scan(micro, carry, (head, jnp.arange(n)))
    if peel:
        last = kernel.order_last(jax.tree.map(lambda x: x[-1], mbs), carry[1])
        carry, _ = micro(carry, (last, g - 1))
    acc, loss, ntok, ok, aux_sum, state = carry
    if g == 1 and aux_sum is not None:
        warn_per_example_aux(aux_sum, mb0)

    red = tuple(r.astype(jnp.float32) for r in kernel.finish(acc))
    loss, ntok, aux_sum, state = kernel.after_reduction((loss, ntok, aux_sum, state), red)
    metrics: dict[str, Any] = {}
    if wire.per_token:
        tokens = metric_sum(ntok, axis, ordered)
        inv = 1.0 / jnp.maximum(tokens, 1.0)
        red = tuple(r * inv for r in red)
        metrics["loss"] = metric_sum(loss, axis, ordered) * inv
        metrics["num_tokens"] = tokens
    else:
        metrics["loss"] = metric_sum(loss / g, axis, ordered) / dp
    if aux_sum is not None and jax.tree.leaves(aux_sum):
        metrics["aux"] = jax.tree.map(lambda a: metric_sum(a / g, axis, ordered) / dp, aux_sum)
    metrics["grad_norm"] = jnp.sqrt(kernel.square_norm(red))
    if wire.check_nan:
        metrics["nonfinite_ranks"] = jax.lax.psum((~ok).astype(jnp.int32), axis)
    return kernel.out(red), metrics, sync_model_state(state, spec.model_state_sync, group)


def sync_model_state(state: Any, how: str, group: Any) -> Any:
    """Combine the ranks' model states by ``how`` (``model_state_sync``; one all-reduce per
    leaf): ``"mean"`` averages floating leaves (summed in fp32) and takes rank 0's integer
    leaves; ``"broadcast"`` takes rank 0's everywhere."""
    if state is None:
        return None
    axis, n = group.axes, group.size
    lead = group.rank() == 0

    def one(x: jax.Array) -> jax.Array:
        if how == "mean" and jnp.issubdtype(x.dtype, jnp.inexact):
            return (jax.lax.psum(x.astype(jnp.float32), axis) / n).astype(x.dtype)
        if x.dtype == jnp.bool_:
            return jax.lax.psum(jnp.where(lead, x, False).astype(jnp.int32), axis) > 0
        return jax.lax.psum(jnp.where(lead, x, jnp.zeros_like(x)), axis)

    return jax.tree.map(one, state)
