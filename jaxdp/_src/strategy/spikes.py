"""Spikes skipped, not absorbed: the step's update is dropped when the gradient is abnormal.

A loss spike from one bad batch (a corrupt sample, an overflow) poisons the optimizer's
moments for hundreds of steps after it. Megatron skips such steps (``grad_norm_skip_threshold``,
``check_for_large_grads``); so does jaxdp, inside the compiled step, with no host round trip:

* ``grad_norm_skip_threshold``: the global gradient norm over it, or not finite, skips;
* ``check_for_large_grads``: each bucket's gradient norm over :data:`FACTOR` times the largest
  of its last :data:`HISTORY` values skips, once :data:`WARMUP` values are recorded. The
  norms are of the reduced gradient, the same on every rank, so the ranks agree without a
  collective of their own; the history lives in ``TrainState.grad_history`` and is
  checkpointed.

A skipped step returns the input state unchanged (params, master copy, optimizer state, model
state, the history and the step counter), so ``[b1, spike, b2]`` ends where ``[b1, b2]`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .spec import StepSpec

__all__ = ["FACTOR", "HISTORY", "WARMUP", "bucket_norms", "check", "history0"]

#: Values of each bucket's gradient norm kept (Megatron keeps the last 100).
HISTORY = 100
#: A bucket whose norm exceeds this many times the largest kept value skips the step.
FACTOR = 10.0
#: Values recorded before the large-gradient check starts.
WARMUP = 10


def history0(num_buckets: int) -> tuple[jax.Array, jax.Array]:
    """The empty history: ``(float32[num_buckets, HISTORY], int32 count)``."""
    return jnp.zeros((num_buckets, HISTORY), jnp.float32), jnp.zeros((), jnp.int32)


def bucket_norms(grads: Any, leaf_buckets: Sequence[int], num_buckets: int) -> jax.Array:
    """Each bucket's L2 norm of ``grads`` (the reduced gradient in any view of the layout:
    ``leaf_buckets`` gives each leaf's bucket). Zero padding adds nothing."""
    sums = [jnp.zeros((), jnp.float32)] * num_buckets
    for g, b in zip(jax.tree.leaves(grads), leaf_buckets, strict=True):
        sums[b] = sums[b] + jnp.sum(jnp.square(g.astype(jnp.float32)))
    return jnp.sqrt(jnp.stack(sums))


def check(
    spec: StepSpec,
    norm: jax.Array,
    grads: Any,
    history: Any,
    leaf_buckets: Sequence[int],
) -> tuple[jax.Array, dict[str, jax.Array], Any]:
    """``(skip, metrics, new history)`` for one step: whether to drop its update, the metrics
    that say why (``skipped``; ``large_grad_bucket`` with ``check_for_large_grads``), and the
    history with this step's bucket norms recorded (kept only where the step is not skipped)."""
    skip = jnp.zeros((), bool)
    metrics: dict[str, jax.Array] = {}
    if spec.grad_norm_skip_threshold is not None:
        skip = ~jnp.isfinite(norm) | (norm > spec.grad_norm_skip_threshold)
    if spec.check_for_large_grads:
        values, count = history
        now = bucket_norms(grads, leaf_buckets, values.shape[0])
        over = (count >= WARMUP) & (now > FACTOR * jnp.max(values, axis=1))
        large = jnp.any(over)
        metrics["large_grad_bucket"] = jnp.where(large, jnp.argmax(over), -1).astype(jnp.int32)
        skip = skip | large
        history = (values.at[:, count % HISTORY].set(now), count + 1)
    metrics["skipped"] = skip.astype(jnp.int32)
    return skip, metrics, history
