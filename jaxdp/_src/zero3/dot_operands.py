"""Stage 3 keeps what XLA's attention reads: the operands of batched ``dot_general`` s.

A ``jax.checkpoint`` policy is asked about one equation's outputs at a time, so it can keep a
dot's output but not the values the dot reads. XLA's attention
(``jax.nn.dot_product_attention(implementation="xla")``, or one written by hand) reads the
queries and keys, then the softmax probabilities and the values, through batched
``dot_general`` s (batch dims: batch and heads). With only the projections' (GEMM) outputs
saved, the backward pass rebuilds all of these from them: the head-split reshapes and casts,
the scores, and the masked softmax's probabilities over ``[batch, heads, T, T]``.
:func:`name_batched_dot_operands` evaluates a function again, equation by equation, with each
operand of a batched dot wrapped in ``checkpoint_name(x, DOT_OPERAND)`` (an identity), and the
``"gemm"`` and ``"dots"`` policies of :mod:`jaxdp._src.zero3.remat` save that name; the projections'
outputs they derive from are then no longer needed. (The softmax's own backward still
recomputes its fp32 output: ``jax.nn.softmax`` is a ``custom_jvp`` whose rule keeps a value
of its own.) Operands that layout primitives derive from the params (gathered at stage 3,
never saved) are left alone. cuDNN's fused attention has no batched dot (its output and
statistics are saved by the policies themselves), so there nothing changes.

Compiled for compile-only GPUs with XLA's attention, naming these operands cut the stage-3
step's non-GEMM traffic and its peak, for the 100.7M GPT of ``bench/bench_traffic.py``
(BENCHMARKS.md section 11) and, by more, for the 303M GPT of ``configs/gpt_300m_gpu.yaml``,
whose traffic fell below the bare step's (measured in ``bench/bench_remat.py``).

What is rewritten: the function's own equations, calls (``jit``, ``closed_call``: inlined) and
``scan`` bodies (scanned again with ``jax.lax.scan``); a batched dot inside anything else
(``cond``, ``while``, ``custom_vjp``, the user's own ``jax.checkpoint``) keeps the policy's plain
behaviour. A function with no batched dot there is called as it is.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Jaxpr, Literal

from .remat import _LAYOUT_PRIMITIVES, DOT_OPERAND
from .scan_rewrite import _CALLS, _bind, scan_again, scan_counts

__all__ = ["name_batched_dot_operands"]

# What carries "derived from the params" from an input to an output: the layout primitives
# (reshapes, casts, transposes, slices) and names (the gathered params' GATHERED).
_PASS_PARAM = _LAYOUT_PRIMITIVES | {"name"}


def _batched_dot(eqn: Any) -> bool:
    if eqn.primitive.name != "dot_general":
        return False
    (_, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    return bool(lhs_batch)


def _has_batched_dot(jaxpr: Jaxpr) -> bool:
    """Whether a batched dot sits where :func:`_eval` names operands (top level, calls, scans)."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if _batched_dot(eqn):
            return True
        if name in _CALLS and _has_batched_dot(eqn.params[_CALLS[name]].jaxpr):
            return True
        if name == "scan" and _has_batched_dot(eqn.params["jaxpr"].jaxpr):
            return True
    return False


def _eval(jaxpr: Jaxpr, consts: list[Any], args: list[Any], from_params: list[bool]) -> list[Any]:
    """``jaxpr`` evaluated with the operands of its batched dots named; ``from_params[i]``:
    argument ``i`` is a param (its layout derivatives are not named)."""
    env: dict[Any, tuple[Any, bool]] = {}
    named: dict[Any, Any] = {}  # a value two dots read is named once (saved once)

    def read(v: Any) -> tuple[Any, bool]:
        return (v.val, True) if isinstance(v, Literal) else env[v]

    # constants are not activations: like the params, never named
    env.update((v, (c, True)) for v, c in zip(jaxpr.constvars, consts, strict=True))
    env.update((v, (a, f)) for v, a, f in zip(jaxpr.invars, args, from_params, strict=True))
    for eqn in jaxpr.eqns:
        vals, flags = [], []
        for v in eqn.invars:
            x, f = read(v)
            vals.append(x)
            flags.append(f)
        name = eqn.primitive.name
        if name in _CALLS:  # inline, as jaxdp._src.zero3.scan_rewrite does
            closed = eqn.params[_CALLS[name]]
            outs = _eval(closed.jaxpr, list(closed.consts), vals, flags)
            out_flags = [False] * len(outs)
        elif name == "scan":
            outs = _scan(eqn, vals, flags)
            out_flags = [False] * len(outs)
        else:
            if _batched_dot(eqn):
                for k, (v, f) in enumerate(zip(eqn.invars, flags, strict=True)):
                    if not f:
                        if v not in named:
                            named[v] = checkpoint_name(vals[k], DOT_OPERAND)
                        vals[k] = named[v]
            outs = _bind(eqn, vals)
            out_flags = [name in _PASS_PARAM and any(flags)] * len(outs)
        env.update((v, (o, f)) for v, o, f in zip(eqn.outvars, outs, out_flags, strict=True))
    return [read(v)[0] for v in jaxpr.outvars]


def _scan(eqn: Any, vals: list[Any], flags: list[bool]) -> list[Any]:
    """A ``scan`` again, through ``jax.lax.scan``, with its body evaluated by :func:`_eval`."""
    p = eqn.params
    nc, nk = scan_counts(p)
    closed = p["jaxpr"]
    consts, carry, xs = vals[:nc], vals[nc : nc + nk], vals[nc + nk :]
    body_flags = [*flags[:nc], *([False] * nk), *flags[nc + nk :]]

    def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = _eval(closed.jaxpr, list(closed.consts), [*consts, *c, *x], body_flags)
        return outs[:nk], outs[nk:]

    return scan_again(p, step, carry, xs)


def name_batched_dot_operands(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(params, *args)`` with the operands of its batched dots named :data:`DOT_OPERAND`.

    The same values (a name is an identity); under ``jax.checkpoint`` with the ``"gemm"`` or
    ``"dots"`` policy of :func:`jaxdp._src.zero3.remat.remat_policy_for` they are saved for the
    backward
    pass. Leaves of ``params`` and what layout primitives derive from them are not named.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> def attend(w, x):
        ...     q = x @ w
        ...     return jnp.einsum("bqd,bkd->bqk", q, q).sum()
        >>> named = name_batched_dot_operands(attend)
        >>> args = (jnp.ones((4, 4)), jnp.ones((2, 3, 4)))
        >>> [e.params.get("name") for e in jax.make_jaxpr(named)(*args).jaxpr.eqns
        ...  if e.primitive.name == "name"]
        ['jaxdp_dot_operand']
        >>> bool(named(*args) == attend(*args))
        True
    """

    @functools.wraps(fn)
    def named(params: Any, *args: Any) -> Any:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(params, *args)
        if not _has_batched_dot(closed.jaxpr):
            return fn(params, *args)
        leaves, rest = jax.tree.leaves(params), jax.tree.leaves(args)
        try:
            outs = _eval(
                closed.jaxpr,
                list(closed.consts),
                [*leaves, *rest],
                [True] * len(leaves) + [False] * len(rest),
            )
        except Exception as e:  # a primitive this rewrite does not know how to bind again
            warnings.warn(
                "jaxdp: stage 3 could not name the operands of the loss's batched dots for the "
                f"remat policy ({type(e).__name__}: {e}); the backward pass recomputes them "
                "(what remat_policy='gemm' did before). Please report this with your model.",
                RuntimeWarning,
                stacklevel=2,
            )
            return fn(params, *args)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return named
