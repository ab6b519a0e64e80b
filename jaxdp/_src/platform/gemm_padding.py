"""Weights whose GEMM widths XLA:GPU pads: widths off a 128-byte grid (64 bf16 elements).

When a GEMM has few rows (the tokens of one micro-batch on one device, up to about a thousand
at width 700-ish), XLA:GPU's split-K rewrite cuts its contraction dimension ``K`` into ``S``
pieces (``S`` from 2 to 64, chosen from the GEMM's shape and the number of SMs) and pads ``K``
with zeros to a multiple of ``S`` pieces of 16 bytes; read in the programs compiled for 8
compile-only GPUs, ``S = 8`` for an 8-layer MLP of width 724 at 32 rows, so ``K`` becomes 768.
A weight ``[a, b]`` is the contraction operand of two GEMMs: over ``a`` in the forward pass
(``x @ w``) and over ``b`` in the backward (``dy @ w.T``). XLA makes a padded copy of the
weight for each and fuses the two pads into one kernel in the forward pass, so the backward's
copy stays alive from the forward to the backward: under plain ``jit`` about 2 bytes per
parameter more than the whole bf16 gradient (BENCHMARKS.md section 4).

A width that is a multiple of 64 bf16 elements (128 bytes) needs no padding for ``S <= 8``;
larger splits (``K`` in the thousands at a few rows per device) need 128 and more. Which GEMMs
are split depends on the batch, so this module only says which weights *can* be padded (from
their shapes: :func:`unaligned`); whether XLA did is read from the compiled program
(``jaxdp.aot.memory_report``).

At stages 0-2 the plan then wraps the loss in ``jax.checkpoint`` with a policy that saves
every intermediate (:func:`backward_fence`): nothing is recomputed, but the backward pass
reads the params through an optimisation barrier, so XLA can no longer build the backward's
padded copies in the forward pass. Stage 3 already rematerialises with its gathers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "GEMM_GRID_BYTES",
    "UnalignedWeight",
    "backward_fence",
    "grid",
    "padding_note",
    "unaligned",
]

#: The contraction widths XLA:GPU never pads for a split of up to 8: 8 pieces of 16 bytes.
GEMM_GRID_BYTES = 128


def grid(dtype: Any) -> int:
    """Elements of ``dtype`` in :data:`GEMM_GRID_BYTES`: 64 for bf16/fp16, 32 for fp32.

    >>> grid("bfloat16"), grid("float32")
    (64, 32)
    """
    return max(1, GEMM_GRID_BYTES // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class UnalignedWeight:
    """A weight with a GEMM width off the grid.

    Attributes:
        path: the parameter's pytree path (``"layer00/w"``).
        shape: its shape.
        dtype: the dtype its GEMMs run in (the working dtype).
        widths: its widths off the grid, e.g. ``(724,)``.
        padded_bytes: bytes of the larger of its two padded copies (``[A, b]`` for the
            forward GEMM, ``[a, B]`` for the backward one, widths rounded up to the grid).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    widths: tuple[int, ...]
    padded_bytes: int


def _splits(shape: Sequence[int]) -> list[tuple[int, int]]:
    """Every way to see ``shape`` as a matrix ``[rows, cols]``: a Dense kernel ``[in, out]``
    is ``[in, out]``; a DenseGeneral ``[d, heads, head_dim]`` is ``[d, heads * head_dim]`` in
    one GEMM and ``[d * heads, head_dim]`` in none, but which split its GEMMs use is not known
    from the shape alone."""
    return [(math.prod(shape[:s]), math.prod(shape[s:])) for s in range(1, len(shape))]


def unaligned(
    weights: Iterable[tuple[str, Sequence[int], Any]],
) -> tuple[UnalignedWeight, ...]:
    """The floating weights (2-D and more) of ``weights`` (``(path, shape, working dtype)``)
    that have no matrix view ``[rows, cols]`` with both sides on the grid (:func:`grid`).

    Example:
        >>> ws = [("w", (724, 724), "bfloat16"), ("b", (724,), "bfloat16"),
        ...       ("qkv", (768, 3, 12, 64), "bfloat16"), ("fc", (768, 3072), "bfloat16")]
        >>> [(u.path, u.widths, u.padded_bytes) for u in unaligned(ws)]
        [('w', (724,), 1112064)]
    """
    out = []
    for path, shape, dtype in weights:
        shape = tuple(int(d) for d in shape)
        dt = jnp.dtype(dtype)
        if len(shape) < 2 or not jnp.issubdtype(dt, jnp.floating):
            continue
        g = grid(dt)
        splits = _splits(shape)
        if any(r % g == 0 and c % g == 0 for r, c in splits):
            continue
        rows, cols = splits[0]  # the Dense view: [in, out]
        widths = tuple(sorted({w for w in (rows, cols) if w % g}))
        copy = max(-(-rows // g) * g * cols, rows * -(-cols // g) * g)
        out.append(UnalignedWeight(path, shape, dt.name, widths, copy * dt.itemsize))
    return tuple(out)


def padding_note(
    weights: Sequence[UnalignedWeight], num_params: int, padded: int | None = None
) -> str:
    """The report's line on ``weights`` (:func:`unaligned`) of a model of ``num_params``
    parameters; ``padded``: how many of them XLA padded in the compiled program (``None``:
    not read).

    The figure is the bytes of one padded copy of each weight per parameter: what plain
    ``jit`` keeps alive from the forward to the backward pass at most.

    Example:
        >>> ws = unaligned([(f"l{i}/w", (724, 724), "bfloat16") for i in range(8)])
        >>> note = padding_note(ws, 8 * 724 * 725, padded=8)
        >>> note.split(" (")[0], note.split("; ")[-1]
        ('widths 724 are padded by XLA: +2.1 B/param under plain jit', 'multiples of 64 avoid it')
    """
    if not weights:
        return ""
    widths = sorted({w for u in weights for w in u.widths})
    grids = sorted({grid(u.dtype) for u in weights})
    extra = sum(u.padded_bytes for u in weights) / max(num_params, 1)
    shown = ", ".join(str(w) for w in widths[:6]) + (", ..." if len(widths) > 6 else "")
    multiple = " or ".join(str(g) for g in grids)
    if padded == 0:
        return (
            f"widths {shown} are off XLA's GEMM grid, but XLA padded none of those weights in "
            f"this program (it splits the contraction of GEMMs with few rows only); at fewer "
            f"rows per device they would cost up to +{extra:.1f} B/param; multiples of "
            f"{multiple} avoid it"
        )
    which = f"{padded} of {len(weights)}" if padded is not None else f"{len(weights)}"
    return (
        f"widths {shown} are padded by XLA: +{extra:.1f} B/param under plain jit (a padded "
        f"copy of {which} weights kept from the forward to the backward pass; jaxdp builds "
        f"them in the backward instead); multiples of {multiple} avoid it"
    )


def backward_fence(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with a policy that saves every intermediate: the same
    values, nothing recomputed, but the backward pass reads ``fn``'s inputs (the params)
    through an optimisation barrier, so XLA cannot hoist work on them (the padded weight
    copies of module docstring) into the forward pass.

    Example:
        >>> import jax.numpy as jnp
        >>> f = lambda w, x: jnp.sum(jnp.tanh(x @ w))
        >>> w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
        >>> bool(jnp.array_equal(jax.grad(backward_fence(f))(w, x), jax.grad(f)(w, x)))
        True
    """
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.everything_saveable)
