"""The bf16 ring simulator: what a bf16 NCCL ring reduce-scatter computes, in numpy.

An NCCL ring reduce-scatter over ``dp`` ranks with a bf16 buffer adds one rank's chunk per hop
and rounds the running sum back to bf16 after every hop; jaxdp's fp32 paths
(``grad_reduce_in_fp32``, ``reduce_scatter_with_fp32_accumulation``) exist to remove that
error. These functions give a test the baseline and the ideal to compare an engine with.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["bf16_ring_reduce_scatter", "bf16_rounding_report", "round_to_bf16"]

BF16 = ml_dtypes.bfloat16


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """Correctly rounded float64 -> bfloat16 (to nearest, ties to even), with no double
    rounding through float32.

    Example:
        >>> float(round_to_bf16(np.float64(1.0 + 2.0**-8 + 2.0**-30)))
        1.0078125
    """
    x64 = np.asarray(x, np.float64)
    mag = np.abs(x64)
    safe = np.where(mag > 0, mag, 1.0)
    ulp = np.exp2(np.floor(np.log2(safe)) - 7)  # bf16 has 8 significant bits
    k = np.floor(safe / ulp)
    rem = safe / ulp - k
    up = (rem > 0.5) | ((rem == 0.5) & (k % 2 == 1))
    out = np.where(mag > 0, (k + up) * ulp, 0.0) * np.sign(x64)
    return out.astype(np.float32).astype(BF16)


def bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The bf16 unit in the last place at each value of ``x`` (float64)."""
    mag = np.abs(np.asarray(x, np.float64))
    return np.exp2(np.floor(np.log2(np.where(mag > 0, mag, 1.0))) - 7)


def bf16_ring_reduce_scatter(per_rank: np.ndarray, *, mean: bool = True) -> np.ndarray:
    """Simulate a bf16 ring reduce-scatter of ``per_rank`` (``[dp, n]``, ``n`` a multiple of
    ``dp``): chunk ``c`` is summed in ring order (ranks ``c+1, c+2, ..., c``), rounding to bf16
    after every addition, as :func:`jaxdp.ring_reduce_scatter` does on devices. Returns the
    ``n`` reduced values (chunk ``c`` is rank ``c``'s shard). With ``mean`` each rank's values
    are first scaled by ``1/dp`` in bf16 (Megatron's pre-division).

    Example:
        >>> x = np.array([[1.0, 2.0**-9], [2.0**-9, 1.0]])
        >>> bf16_ring_reduce_scatter(x, mean=False).astype(float).tolist()
        [1.0, 1.0]
    """
    x = np.asarray(per_rank).astype(BF16)
    dp, n = x.shape
    if n % dp:
        raise ValueError(f"bf16_ring_reduce_scatter: n={n} is not a multiple of dp={dp}.")
    if mean:
        x = (x.astype(np.float32) * np.float32(BF16(1.0 / dp))).astype(BF16)
    chunks = x.reshape(dp, dp, n // dp)  # [rank, chunk, ...]
    out = np.empty((dp, n // dp), BF16)
    for c in range(dp):
        acc = chunks[(c + 1) % dp, c]
        for t in range(2, dp + 1):
            acc = (acc.astype(np.float32) + chunks[(c + t) % dp, c].astype(np.float32)).astype(BF16)
        out[c] = acc
    return out.reshape(n)


def bf16_rounding_report(got: np.ndarray, per_example: np.ndarray) -> tuple[float, float]:
    """``(fraction of elements equal to the correctly rounded bf16 mean, max error in bf16
    ulps)`` of ``got`` against the float64 mean of ``per_example`` (``[examples, ...]``).

    Example:
        >>> x = np.array([[1.0, 3.0], [2.0, 5.0]])
        >>> bf16_rounding_report(np.array([1.5, 4.0]), x)
        (1.0, 0.0)
    """
    mean = np.asarray(per_example).astype(np.float64).mean(0)
    want = round_to_bf16(mean).astype(np.float64)
    got64 = np.asarray(got, np.float64)
    exact = float(np.mean(got64 == want))
    ulps = float(np.max(np.abs(got64 - mean) / bf16_ulp(mean)))
    return exact, ulps
