"""Per-layer shard order of a stacked ``[.., L, ..]`` parameter (ZeRO-3 with scanned layers).

A stacked leaf (one a ``lax.scan`` slices layer by layer, see :mod:`jaxdp._src.zero3.scan_gather`)
is laid
out *per layer*: layer ``l`` (``moveaxis(leaf, axis, 0)[l]``, ``n`` elements) is flattened,
zero-padded to ``dp * p`` with ``p = ceil(n / dp)`` and cut into ``dp`` pieces; rank ``r`` holds
piece ``r`` of every layer, as an ``[L, p]`` block. In an interleaved bucket the leaf is the
``[dp, L * p]`` matrix whose row ``r`` is that block flattened, so its global shard view is the
1-D array ``rows.ravel()`` (rank-major) and a rank's local view reshapes to ``[L, p]``.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp

__all__ = ["layer_shape", "rows_to_stack", "stack_to_rows"]


def layer_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """Shape of one layer of a leaf stacked along ``axis``."""
    return shape[:axis] + shape[axis + 1 :]


def stack_to_rows(leaf: Any, axis: int, dp: int) -> Any:
    """Full stacked leaf -> the ``[dp, L * p]`` matrix whose row ``r`` is rank ``r``'s pieces."""
    x = jnp.moveaxis(jnp.asarray(leaf), axis, 0)
    n_layers = x.shape[0]
    n = math.prod(x.shape[1:])
    p = -(-n // dp)
    x = x.reshape(n_layers, n)
    if dp * p > n:
        x = jnp.pad(x, ((0, 0), (0, dp * p - n)))
    return x.reshape(n_layers, dp, p).transpose(1, 0, 2).reshape(dp, n_layers * p)


def rows_to_stack(rows: Any, shape: tuple[int, ...], axis: int, dp: int) -> Any:
    """Inverse of :func:`stack_to_rows` (``rows`` may be the flattened matrix)."""
    n_layers = shape[axis]
    lshape = layer_shape(shape, axis)
    n = math.prod(lshape)
    p = -(-n // dp)
    x = jnp.reshape(rows, (dp, n_layers, p)).transpose(1, 0, 2).reshape(n_layers, dp * p)
    x = x[:, :n].reshape(n_layers, *lshape)
    return jnp.moveaxis(x, 0, axis)
