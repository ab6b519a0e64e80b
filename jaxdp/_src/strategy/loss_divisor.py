"""The gradient mean's divisor carried by the loss: ``d * grad(loss / d) == grad(loss)``.

A data-parallel step averages: every rank's gradient (summed over ``G`` micro-batches) is
summed over the group and divided by ``G x dp``. :mod:`jaxdp._src.comm.reduce` divides each reduced
gradient (or its shard) once, in fp32 and correctly rounded, wherever the mode puts it. Where
that divisor ``d`` is a power of two, dividing the *loss* by it instead gives the same bits:
every operation of a backward pass is linear in the loss's cotangent, and scaling a floating
point value by a power of two commutes with every rounding (barring subnormals). So the
backward pass starts from the cotangent ``1/d`` rather than ``1`` (one scalar multiply), the
gradients come out already divided, and the collectives sum them as they are.

What that saves is compile time: one multiply per parameter, which XLA fuses into a producer
or into the update at run time but which every pass of the compiler (Shardy's propagation and
export, the fusion passes, the code generators) has to carry. The 128 x 128 MLP of
``bench/bench_compile.py`` at 100 leaves, instructions of the step's XLA compile (callgrind),
for compile-only GPUs and on XLA:CPU: a few percent at stages 0 and 1 (BENCHMARKS.md
section 7).

:func:`loss_divisor` decides where it applies, once per engine (the plan hands the result to
the operations that reduce, and the kernel that differentiates reads it there): a mean over
ranks (not ``calculate_per_token_loss``, which divides by the global token count after the
reduction), one divisor for every bucket (an expert bucket's ``prediv x size`` is the dense
group's size) and a power of two above 1, and no float16 among the params, gradients or
accumulators (its 5-bit exponent would push small cotangents into subnormals ``log2(d)`` bits
earlier; bfloat16 and float32 share an 8-bit exponent). Stage 3 reduces inside its gathers'
transpose and keeps its own division.

Example:
    >>> import jax.numpy as jnp
    >>> vg = value_and_divided_grad(lambda w, mb: (jnp.sum(w * mb), None), 8)
    >>> (loss, _), g = vg(jnp.ones(3), jnp.arange(3.0))
    >>> float(loss), g.tolist()
    (3.0, [0.0, 0.125, 0.25])
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..comm.wire import Wire
from ..layout.layout import BucketLayout

__all__ = ["loss_divisor", "value_and_divided_grad"]


def loss_divisor(
    layout: BucketLayout,
    groups: Sequence[Any],
    wire: Wire,
    *,
    num_microbatches: int,
    param_dtype: str | None,
) -> int:
    """The divisor the loss carries for ``layout``'s buckets reduced over ``groups`` (one
    :class:`jaxdp._src.topology.group.BucketGroup` per bucket), or 1 where the reduction divides
    (module
    docstring)."""
    if wire.per_token or not groups:
        return 1
    totals = {g.size * g.prediv * g.outer for g in groups}
    if len(totals) != 1:
        return 1
    d = num_microbatches * totals.pop()
    if d == 1 or d & (d - 1):
        return 1
    dtypes = {np.dtype(param_dtype or s.dtype) for s in layout.slots}
    dtypes |= {np.dtype(s.dtype) for s in layout.slots}
    dtypes |= {np.dtype(b.grad_dtype) for b in layout.buckets}
    dtypes.add(wire.accumulate)
    if np.dtype(np.float16) in dtypes:
        return 1
    return d


def value_and_divided_grad(
    parts: Callable[[Any, Any], tuple[jax.Array, Any]], divisor: int
) -> Callable[[Any, Any], tuple[tuple[jax.Array, Any], Any]]:
    """``jax.value_and_grad(parts, has_aux=True)`` with the gradient divided by ``divisor``
    through the loss's cotangent; the value (``(loss, aux)``) is the loss as ``parts``
    returned it."""
    if divisor == 1:
        return jax.value_and_grad(parts, has_aux=True)
    inverse = 1.0 / divisor

    def divided(w: Any, mb: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        loss, aux = parts(w, mb)
        return loss * jnp.asarray(inverse, loss.dtype), (loss, aux)

    vg = jax.value_and_grad(divided, has_aux=True)

    def value_and_grad(w: Any, mb: Any) -> tuple[tuple[jax.Array, Any], Any]:
        (_, value), grads = vg(w, mb)
        return value, grads

    return value_and_grad
