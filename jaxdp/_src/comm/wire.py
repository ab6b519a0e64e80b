"""How a step's gradients travel and are summed: the wire spec every collective is given.

The plan (:mod:`jaxdp._src.strategy.plan`) decides it once from the config; below the plan
no code reads the config. A collective takes ``(x, group, wire)`` — who it reduces with, and
how — and returns ``(reduced, divisor)`` (:func:`jaxdp._src.comm.reduce.reduce_one`). The wire
dtype itself is the bucket's (:attr:`jaxdp.Bucket.grad_dtype`), so that one spec serves every
bucket of a layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Wire"]


@dataclasses.dataclass(frozen=True)
class Wire:
    """The gradient reduction's mode and dtypes.

    Attributes:
        accumulate: the dtype gradients are accumulated in over micro-batches and a reduced
            shard is finished in (``main_grads_dtype``).
        all_to_all: reduce-scatter through one ``all_to_all`` on the wire and a local sum in
            rank order (``reduce_scatter_with_fp32_accumulation`` or ``deterministic_reduction``);
            otherwise ``psum`` / ``psum_scatter``.
        ordered_metrics: per-rank metrics are summed in rank order (``deterministic_reduction``).
        average_in_collective: a low-precision wire divides by dp after the collective.
        per_token: the loss is a sum over tokens, divided by the global token count after the
            reduction (``calculate_per_token_loss``): the collectives divide by nothing.
        check_nan: count non-finite local gradients (``check_for_nan_in_grad``).

    Example:
        >>> import numpy as np
        >>> Wire(np.dtype("float32")).all_to_all
        False
    """

    accumulate: np.dtype[Any]
    all_to_all: bool = False
    ordered_metrics: bool = False
    average_in_collective: bool = False
    per_token: bool = False
    check_nan: bool = False
