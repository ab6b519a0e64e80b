"""Megatron's padding rules for distributed-optimizer buffers, as small pure functions.

Megatron (``megatron/core/optimizer/param_layout.py``) aligns every parameter start to 64 elements
and every bucket end to ``lcm(dp, 128)`` (or ``lcm(dp, 128, 2**16)`` for high NCCL bus bandwidth),
so that each bucket splits into ``dp`` equal, well-aligned shards.
"""

from __future__ import annotations

import math

__all__ = [
    "PARAM_START_ALIGN",
    "pad_to_divisor",
    "pad_param_start",
    "bucket_end_divisor",
    "pad_bucket_end",
]

#: Every parameter start is rounded up to a multiple of this many elements (distributed optimizer).
PARAM_START_ALIGN = 64
_BUCKET_ALIGN = 128
_BUSBW_ALIGN = 2**16


def pad_to_divisor(n: int, divisor: int) -> int:
    """Round ``n`` up to a multiple of ``divisor``.

    Example:
        >>> pad_to_divisor(65, 64), pad_to_divisor(128, 64), pad_to_divisor(0, 64)
        (128, 128, 0)
    """
    if divisor <= 0:
        raise ValueError(f"pad_to_divisor: divisor must be positive, got {divisor}")
    return -(-n // divisor) * divisor


def pad_param_start(start: int) -> int:
    """Round a parameter's start offset up to a multiple of 64 elements.

    Example:
        >>> [pad_param_start(i) for i in (0, 1, 63, 64, 65)]
        [0, 64, 64, 64, 128]
    """
    return pad_to_divisor(start, PARAM_START_ALIGN)


def bucket_end_divisor(dp_size: int, high_nccl_busbw: bool = False) -> int:
    """``lcm(dp, 128)``, or ``lcm(dp, 128, 2**16)`` with ``high_nccl_busbw``.

    Example:
        >>> bucket_end_divisor(8), bucket_end_divisor(3), bucket_end_divisor(4, True)
        (128, 384, 65536)
    """
    if high_nccl_busbw:
        return math.lcm(dp_size, _BUCKET_ALIGN, _BUSBW_ALIGN)
    return math.lcm(dp_size, _BUCKET_ALIGN)


def pad_bucket_end(end: int, dp_size: int, high_nccl_busbw: bool = False) -> int:
    """Round a bucket's end offset up so that the bucket splits into ``dp_size`` aligned shards.

    Example:
        >>> pad_bucket_end(1, 4), pad_bucket_end(1, 4, True), pad_bucket_end(128, 2)
        (128, 65536, 128)
    """
    return pad_to_divisor(end, bucket_end_divisor(dp_size, high_nccl_busbw))
