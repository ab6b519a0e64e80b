"""Evaluate a jaxpr on the host with NumPy: small programs run many times, with no XLA compile.

The optimizer probe (:mod:`jaxdp._src.optim.check`) runs a few optimizer steps on tiny tensors for
every parameter. Op by op through jax, every distinct operation compiles an XLA executable the
first time it is seen in a process (about 1 s for a 10-parameter AdamW) and every call pays
jax's dispatch (about 3 s at 1,000 parameters). Tracing the step once and evaluating its jaxpr
with NumPy costs neither.

Common elementwise, shape and reduction primitives, ``dot_general`` and ``select_n`` run in
NumPy, and the call-like ones (``jit``, ``custom_jvp_call``, ``cond``, ``while``, ...) are
walked into; every other primitive (random numbers, ``cumsum``, ``sort``, ...), and any that
NumPy refuses, is bound through jax as usual, so the evaluator covers whatever
jax does, only slower there. Each result is cast to the dtype the jaxpr gives it, so NumPy's
type promotion never leaks.

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> jaxpr = jax.make_jaxpr(lambda x: jnp.sqrt(x * 2.0).sum())(np.ones(3, np.float32))
    >>> evaluate(jaxpr, [np.full(3, 2.0, np.float32)])
    [array(6., dtype=float32)]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

__all__ = ["evaluate"]


def _div(x: Any, y: Any) -> Any:
    if np.issubdtype(np.result_type(x, y), np.integer):  # lax.div rounds towards zero
        q = np.abs(x) // np.abs(y)
        return np.where((x < 0) != (y < 0), -q, q)
    return np.true_divide(x, y)


def _logical(fn: Callable[..., Any], bitwise: Callable[..., Any]) -> Callable[..., Any]:
    def op(*xs: Any) -> Any:
        return fn(*xs) if np.asarray(xs[0]).dtype == np.bool_ else bitwise(*xs)

    return op


_ELEMENTWISE: dict[str, Callable[..., Any]] = {
    "neg": np.negative,
    "sign": np.sign,
    "abs": np.abs,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: np.reciprocal(np.sqrt(x)),
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "expm1": np.expm1,
    "tanh": np.tanh,
    "logistic": lambda x: np.reciprocal(1 + np.exp(-x)),
    "sin": np.sin,
    "cos": np.cos,
    "floor": np.floor,
    "ceil": np.ceil,
    "is_finite": np.isfinite,
    "square": np.square,
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "div": _div,
    "rem": np.fmod,  # sign of the dividend, as lax.rem
    "pow": np.power,
    "max": np.maximum,
    "min": np.minimum,
    "atan2": np.arctan2,
    "eq": np.equal,
    "ne": np.not_equal,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "and": _logical(np.logical_and, np.bitwise_and),
    "or": _logical(np.logical_or, np.bitwise_or),
    "xor": _logical(np.logical_xor, np.bitwise_xor),
    "not": _logical(np.logical_not, np.invert),
    "copy": np.copy,
    "copy_p": np.copy,
    "optimization_barrier": lambda *xs: xs,
}
_REDUCTIONS: dict[str, Callable[..., Any]] = {
    "reduce_sum": np.sum,
    "reduce_max": np.max,
    "reduce_min": np.min,
    "reduce_prod": np.prod,
    "reduce_and": np.all,
    "reduce_or": np.any,
}
_CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")


def _broadcast_in_dim(x: Any, shape: Sequence[int], broadcast_dimensions: Sequence[int]) -> Any:
    kept = [1] * len(shape)
    for i, d in enumerate(broadcast_dimensions):
        kept[d] = np.shape(x)[i]
    return np.broadcast_to(np.reshape(x, kept), tuple(shape))


def _dot_general(x: Any, y: Any, dimension_numbers: Any) -> Any:
    (xc, yc), (xb, yb) = dimension_numbers
    letters = iter("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    xs = [next(letters) for _ in range(np.ndim(x))]
    ys = [next(letters) for _ in range(np.ndim(y))]
    for i, j in zip([*xc, *xb], [*yc, *yb], strict=True):
        ys[j] = xs[i]
    batch = [xs[i] for i in xb]
    free_x = [c for i, c in enumerate(xs) if i not in xc and i not in xb]
    free_y = [c for j, c in enumerate(ys) if j not in yc and j not in yb]
    out = "".join(batch + free_x + free_y)
    return np.einsum(f"{''.join(xs)},{''.join(ys)}->{out}", x, y)


def _shape_op(name: str, params: dict[str, Any], x: Any) -> Any:
    if name == "broadcast_in_dim":
        return _broadcast_in_dim(x, params["shape"], params["broadcast_dimensions"])
    if name == "reshape":
        return np.reshape(x, tuple(params["new_sizes"]))
    if name == "squeeze":
        return np.squeeze(x, axis=tuple(params["dimensions"]))
    if name == "transpose":
        return np.transpose(x, tuple(params["permutation"]))
    if name == "convert_element_type":
        return x  # the cast to the result's dtype below is the whole operation
    return _REDUCTIONS[name](x, axis=tuple(params["axes"]))


_SHAPE_OPS = frozenset(("broadcast_in_dim", "reshape", "squeeze", "transpose"))
_SHAPE_OPS |= {"convert_element_type", *_REDUCTIONS}


_OTHER = frozenset(("integer_pow", "select_n", "dot_general"))


def _dtype(v: Any) -> Any:
    return v.aval.dtype


def _host(x: Any) -> bool:
    return isinstance(x, (np.ndarray, np.generic))


def _to_host(x: Any) -> Any:
    # Results of primitives bound through jax come back as jax arrays; keep extended dtypes
    # (PRNG keys) as they are, since NumPy cannot hold them.
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return np.asarray(x)
    return x


def _inner(params: dict[str, Any]) -> tuple[Any, Sequence[Any]]:
    j = params.get("jaxpr", params.get("call_jaxpr"))
    if isinstance(j, ClosedJaxpr):
        return j.jaxpr, j.consts
    return j, ()


def _on_host(eqn: Any, ins: Sequence[Any]) -> list[Any] | None:
    """``eqn`` evaluated with NumPy, its results cast to the jaxpr's dtypes; ``None`` when it
    is not in the table, an input is not a NumPy array, or NumPy refuses the operands (an
    integer to a negative power, say): then jax evaluates it."""
    name, params = eqn.primitive.name, eqn.params
    known = name in _ELEMENTWISE or name in _SHAPE_OPS or name in _OTHER
    if not known or not all(_host(x) for x in ins):
        return None
    try:
        if name == "integer_pow":
            res = np.power(ins[0], params["y"])
        elif name == "dot_general":
            res = _dot_general(ins[0], ins[1], params["dimension_numbers"])
        elif name == "select_n":
            res = np.choose(np.asarray(ins[0], dtype=np.int32), ins[1:])
        elif name in _SHAPE_OPS:
            res = _shape_op(name, params, ins[0])
        else:
            res = _ELEMENTWISE[name](*ins)
        many = isinstance(res, tuple)
        return [
            np.asarray(r, dtype=_dtype(v))
            for r, v in zip(res if many else (res,), eqn.outvars, strict=True)
        ]
    except (ValueError, TypeError, IndexError):
        return None


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        if isinstance(v, Literal):
            return np.asarray(v.val, dtype=_dtype(v))
        return env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = _to_host(x)
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        ins = [read(v) for v in eqn.invars]
        outs: Sequence[Any]
        if name in _CALLS and ("jaxpr" in params or "call_jaxpr" in params):
            outs = _eval(*_inner(params), ins)
        elif name == "cond":
            branches = params["branches"]
            k = min(max(int(ins[0]), 0), len(branches) - 1)
            outs = _eval(branches[k].jaxpr, branches[k].consts, ins[1:])
        elif name == "while":
            cc, bc = params["cond_nconsts"], params["body_nconsts"]
            cj, bj = params["cond_jaxpr"], params["body_jaxpr"]
            c_consts, b_consts, carry = ins[:cc], ins[cc : cc + bc], ins[cc + bc :]
            while bool(_eval(cj.jaxpr, cj.consts, [*c_consts, *carry])[0]):
                carry = _eval(bj.jaxpr, bj.consts, [*b_consts, *carry])
            outs = carry
        else:
            host = _on_host(eqn, ins)
            if host is None:  # not in NumPy's table (or NumPy refused): jax runs it
                res = eqn.primitive.bind(*ins, **params)
                host = [_to_host(r) for r in (res if eqn.primitive.multiple_results else [res])]
            outs = host
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def evaluate(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """The outputs of ``closed`` (from :func:`jax.make_jaxpr`) on ``args`` (NumPy arrays, one
    per input of the flattened jaxpr), as NumPy arrays."""
    with np.errstate(all="ignore"):  # XLA does not warn about inf or nan either
        return _eval(closed.jaxpr, closed.consts, [_to_host(a) for a in args])
