"""Megatron's batch arithmetic: ``global_batch = micro_batch x num_microbatches x dp``."""

from __future__ import annotations

__all__ = ["microbatches"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"microbatches: {name}={value!r} is a {type(value).__name__}; expected a positive "
            f"int. Fix: pass {name} as a whole number, e.g. {name}=8."
        )
    if value < 1:
        raise ValueError(f"microbatches: {name}={value}; expected a positive int (>= 1).")
    return value


def microbatches(global_batch: int, micro_batch: int, dp: int) -> int:
    """The number of micro-batches per step, ``global_batch / (micro_batch * dp)``.

    Each of the ``dp`` data-parallel ranks runs ``num_microbatches`` forward/backward passes
    of ``micro_batch`` examples and the gradients are reduced once per step, as in Megatron-LM.

    Args:
        global_batch: examples per optimizer step, over all ranks and micro-batches.
        micro_batch: examples per forward/backward pass on one rank.
        dp: the data-parallel world size (``jaxdp.dp_size(mesh)``).

    Returns:
        ``num_microbatches`` (the config's ``num_microbatches``).

    Raises:
        ValueError: ``global_batch`` is not a multiple of ``micro_batch * dp``; the message
            names the nearest valid global batches and micro-batch sizes.

    Example:
        >>> microbatches(256, 8, 8)
        4
        >>> microbatches(96, 8, 8)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: microbatches: global_batch=96 is not a multiple of ... micro_batch=4 or 6 ...
    """
    global_batch = _positive_int("global_batch", global_batch)
    micro_batch = _positive_int("micro_batch", micro_batch)
    dp = _positive_int("dp", dp)
    unit = micro_batch * dp
    if global_batch % unit == 0:
        return global_batch // unit
    below = global_batch // unit * unit
    above = below + unit
    gb = f"global_batch={below} or {above}" if below else f"global_batch={above}"
    msg = (
        f"microbatches: global_batch={global_batch} is not a multiple of micro_batch x dp = "
        f"{micro_batch} x {dp} = {unit}. Fix: {gb} (with micro_batch={micro_batch})"
    )
    if global_batch % dp == 0:
        per_rank = global_batch // dp
        divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        near = sorted(divisors, key=lambda m: (abs(m - micro_batch), m))[:2]
        msg += f", or micro_batch={' or '.join(str(m) for m in sorted(near))}"
        msg += f" (with global_batch={global_batch})."
    else:
        msg += f"; global_batch={global_batch} is not even divisible by dp={dp}."
    raise ValueError(msg)
