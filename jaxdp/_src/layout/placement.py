"""Where each parameter goes: the records of a layout and Megatron's placement rule.

:class:`ParamSlot`, :class:`Bucket` and :class:`Buffer` describe a :class:`jaxdp.BucketLayout`
(coordinates: see :mod:`jaxdp._src.layout.layout`); :func:`place` puts parameters, already in layout
order, into buckets by Megatron's rules (start alignment, bucket closing, end padding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from .padding import pad_bucket_end, pad_param_start

__all__ = ["Bucket", "Buffer", "ParamSlot", "leaf_info", "place", "place_shape"]

_FLOATING = ("float16", "bfloat16", "float32", "float64")


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives.

    Attributes:
        path: the parameter's pytree path, ``"a/b/c"``.
        leaf_index: position of the leaf in ``jax.tree.leaves`` order.
        shape: the parameter's shape.
        dtype: the dtype of the leaf that the layout was built from.
        buffer: index of its buffer in ``BucketLayout.buffers``.
        bucket: index of its bucket in ``BucketLayout.buckets``.
        start: start offset in buffer coordinates (see the module docstring).
        end: end offset in buffer coordinates.
    """

    path: str
    leaf_index: int
    shape: tuple[int, ...]
    dtype: str
    buffer: int
    bucket: int
    start: int
    end: int

    @property
    def size(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: the unit of a gradient collective.

    Attributes:
        index: position in ``BucketLayout.buckets`` (0 = output end of the model).
        buffer: index of the buffer that holds it.
        dtype: the working dtype of its parameters.
        grad_dtype: the dtype its gradients are reduced in.
        start: start offset in buffer coordinates.
        end: end offset (padded) in buffer coordinates.
        numel: padded number of elements (what the collective moves).
        numel_unpadded: elements before the bucket-end padding (Megatron's definition: includes
            the alignment gaps between parameters).
        numel_params: elements that belong to parameters (no padding of any kind).
        param_paths: paths of its parameters, in layout order.
        slots: indices into ``BucketLayout.slots`` in layout order.
        shard_numel: elements each rank owns after a reduce-scatter (``numel // dp``).
    """

    index: int
    buffer: int
    dtype: str
    grad_dtype: str
    start: int
    end: int
    numel: int
    numel_unpadded: int
    numel_params: int
    param_paths: tuple[str, ...]
    slots: tuple[int, ...]
    shard_numel: int

    @property
    def padding_fraction(self) -> float:
        """Fraction of ``numel`` that is padding."""
        return 1.0 - self.numel_params / self.numel if self.numel else 0.0


@dataclasses.dataclass(frozen=True)
class Buffer:
    """All parameters of one ``(dtype, grad_dtype)`` pair.

    Attributes:
        index: position in ``BucketLayout.buffers``.
        dtype: working dtype of its parameters.
        grad_dtype: dtype of its gradient buffer.
        numel: padded elements.
        numel_unpadded: sum of its buckets' ``numel_unpadded``.
        buckets: indices into ``BucketLayout.buckets``.
        shard_axes: mesh axes (other than the data axis) its parameters are split over; its
            element counts are per block, i.e. per model-parallel rank (``()`` = replicated).
    """

    index: int
    dtype: str
    grad_dtype: str
    numel: int
    numel_unpadded: int
    buckets: tuple[int, ...]
    shard_axes: tuple[str, ...] = ()


def leaf_info(path: str, leaf: Any) -> tuple[tuple[int, ...], str]:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"BucketLayout.from_params: params leaf {path!r} is a {type(leaf).__name__}; expected "
            "an array or jax.ShapeDtypeStruct with .shape and .dtype. Fix: pass the model's "
            "parameter pytree (e.g. flax variables['params']), or wrap scalars with jnp.asarray."
        )
    name = np.dtype(dtype).name
    if name not in _FLOATING:
        raise TypeError(
            f"BucketLayout.from_params: params leaf {path!r} has dtype {name}; expected a floating "
            f"dtype {_FLOATING}. Fix: keep non-trainable integer state out of the params tree."
        )
    return tuple(int(d) for d in shape), name


def place_shape(shape: tuple[int, ...], axis: int | None, dp: int) -> tuple[int, ...]:
    """The shape :func:`place` sizes a leaf by: a stack needs ``L * ceil(n / dp)`` columns."""
    if axis is None:
        return shape
    n = math.prod(shape) // shape[axis] if shape[axis] else 0
    return (shape[axis] * -(-n // dp) * dp,)


def place(
    params: list[tuple[tuple[int, ...], bool]],
    kind: str,
    dp: int,
    bucket_size: int | None,
    busbw: bool,
    num_buckets: int | None = None,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Place ``(shape, own_bucket)`` entries (already in layout order) into buckets.

    Returns ``(bucket, start, end)`` per entry and ``(start, end, unpadded_end)`` per bucket, in
    buffer coordinates. Follows Megatron's ``_compute_per_buffer_param_layout`` (distributed
    optimizer) and ``_compute_default_per_buffer_param_layout`` (no padding).

    ``num_buckets=k`` (instead of ``bucket_size``) cuts the buffer into ``k`` buckets of about
    equal size: with ``T`` the buffer's elements over ``k``, a bucket closes after the
    parameter that reaches the next multiple of ``T`` (counted from the buffer's start), so
    each bucket differs from ``T`` by less than its largest parameter, and there are exactly
    ``k`` buckets when no parameter is larger than ``T`` (fewer otherwise; a parameter of
    its own bucket adds one).
    """
    # Element counts are multiplied by `scale` to compare against bucket_size: interleaved
    # coordinates are columns of a [dp, S] matrix.
    scale = dp if kind == "interleaved" else 1

    def align_start(x: int) -> int:
        return pad_param_start(x) if kind == "megatron" else x

    def pad_end(x: int) -> int:
        if kind == "megatron":
            return pad_bucket_end(x, dp, busbw)
        if kind == "interleaved":
            return pad_bucket_end(x * dp, dp, busbw) // dp
        return x

    if num_buckets is not None:
        total = (
            sum(
                -(-math.prod(p[0]) // dp) if kind == "interleaved" else math.prod(p[0])
                for p in params
            )
            * scale
        )
        k = int(num_buckets)

        def target(x: int) -> int:  # how many of the k - 1 inner cut points x has reached
            return min(k * x * scale // max(total, 1), k - 1)

    placed: list[tuple[int, int, int]] = []
    spans: list[tuple[int, int, int]] = []
    bucket_start = 0
    cursor = 0
    n_in_bucket = 0
    end = 0

    def close(unpadded_end: int) -> int:
        padded = pad_end(unpadded_end)
        spans.append((bucket_start, padded, unpadded_end))
        return padded

    for shape, own in params:
        numel = math.prod(shape)
        width = -(-numel // dp) if kind == "interleaved" else numel
        start = align_start(cursor)
        if own and n_in_bucket:
            # Megatron closes the open bucket at the shared param's *aligned* start, so the
            # alignment gap counts as unpadded (a documented quirk we reproduce).
            bucket_start = close(start)
            n_in_bucket = 0
            start = bucket_start
        end = start + width
        placed.append((len(spans), start, end))
        n_in_bucket += 1
        if num_buckets is not None:
            full = target(end) > target(bucket_start)
        else:
            full = bucket_size is not None and (end - bucket_start) * scale >= bucket_size
        if full or own:
            bucket_start = close(end)
            n_in_bucket = 0
            cursor = bucket_start
        else:
            cursor = end
    if n_in_bucket:
        close(end)
    return placed, spans
