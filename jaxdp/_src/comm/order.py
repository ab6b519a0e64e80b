"""Data dependences that order an XLA program where nothing else does.

XLA's GPU pipeline drops ``optimization_barrier`` before it schedules a program, and its
latency-hiding scheduler, with memory to spare, is free to hoist independent work early (a
collective, or a whole micro-batch) and keep its buffers alive meanwhile. :func:`after` makes
the order a data dependence instead, at the cost of one fused elementwise OR, bit-exact.
:func:`hold` keeps buffers allocated until a value is computed (one ``optimization_barrier``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["after", "hold"]

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _zero_from(dep: jax.Array) -> jax.Array:
    """A uint32 zero computed from one element of ``dep`` (which XLA cannot prove is zero)."""
    d = jnp.ravel(dep)[0]
    if d.dtype == jnp.bool_:
        d = d.astype(jnp.uint8)
    bits = jax.lax.bitcast_convert_type(d, _UINT[d.dtype.itemsize]).astype(jnp.uint32)
    return (bits >> 16) >> 16


def _or_zero(v: jax.Array, zero: jax.Array) -> jax.Array:
    """``v`` bit for bit: its bits OR'ed with ``zero`` (a uint32 zero), so XLA computes it
    only once ``zero`` is."""
    if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):  # typed keys: their bits
        return jax.random.wrap_key_data(
            _or_zero(jax.random.key_data(v), zero), impl=jax.random.key_impl(v)
        )
    v = jnp.asarray(v)
    if v.size == 0:
        return v
    if v.dtype == jnp.bool_:
        return v | (zero != 0)
    u = _UINT[v.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(v, u) | zero.astype(u)
    return jax.lax.bitcast_convert_type(bits, v.dtype)


def after(x: Any, dep: Any) -> Any:
    """``x`` (a pytree), bit for bit, but computed only once ``dep``'s leaves are.

    Example:
        >>> import jax.numpy as jnp
        >>> x = jnp.array([1.5, -0.0, jnp.nan, jnp.inf], jnp.bfloat16)
        >>> bool(jnp.all(after(x, jnp.float32(jnp.nan)).view(jnp.uint16) == x.view(jnp.uint16)))
        True
    """
    deps = [d for d in jax.tree.leaves(dep) if jnp.size(d)]
    if not deps:
        return x
    zero = _zero_from(deps[0])
    for d in deps[1:]:
        zero = zero | _zero_from(d)

    return jax.tree.map(lambda v: _or_zero(v, zero), x)


def hold(x: Any, keep: Any, until: jax.Array) -> Any:
    """``x``, the same values, passed through one ``optimization_barrier`` with ``keep`` and
    ``until``: what reads the returned ``x`` waits for ``until``, and ``keep`` counts as read
    there, so XLA keeps its buffers allocated until then.

    A step that donates its state holds the old params until the gradient norm ahead of the
    optimizer update, where the strategy says (``Strategy.holds_params``;
    :meth:`jaxdp.DataParallel._step_fn`). Otherwise, once the backward pass has last read a
    param, XLA places temporaries in its buffer until the update writes the new param there.
    XLA assumes only 16-byte alignment for a buffer passed in (256 for its own), so the same
    fusion in two layers then compiles as two GPU kernels. Held, a 12-layer GPT
    (``bench/gpu_kernels.py``) compiles as many kernels as the bare step on one compile-only
    GPU, and stage 3 with clipping far fewer than unheld on 8. The price is memory where the
    gradients, not the activations, make the peak: those temporaries need buffers of their
    own (section 4's MLP; held replicated params would cost far more than sharded ones), and
    with more ranks the update waits for the norm (BENCHMARKS.md section 13, which has the
    kernel counts and the memory).

    Example:
        >>> import jax.numpy as jnp
        >>> hold(jnp.arange(3.0), jnp.ones(2), jnp.float32(2.0)).tolist()
        [0.0, 1.0, 2.0]
    """
    return jax.lax.optimization_barrier((x, keep, until))[0]
