"""The jaxpr rewrite behind :func:`jaxdp._src.zero3.scan_gather.gather_in_scans`.

``_run`` traces a function to a closed jaxpr at the full shapes and evaluates it again, equation
by equation, with every stacked leaf held as a virtual ``_Stacked`` value (its ``[L, *shard]``
array and the stacked axis). A scan that takes such a value as ``xs`` gets a new body that
calls the caller's ``gather`` on one row per iteration (optionally under ``jax.checkpoint``);
calls (``jit``, ``closed_call``) are inlined, ``checkpoint`` regions re-wrapped, dtype casts and
a transpose that brings the stacked axis first applied per layer; any other use gathers the
whole stack (``vmap`` of ``gather``) and is recorded in the context, which the inference in
:mod:`jaxdp._src.zero3.scan_find` reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Jaxpr, Literal

#: ``checkpoint_name`` given to each gathered layer (the remat policy refuses to save it).
DEFAULT_NAME = "jaxdp_scan_gather"

#: ``{leaf index: one row of its shard array}`` -> ``{leaf index: full layer slice}``.
GatherFn = Callable[[dict[int, jax.Array]], dict[int, jax.Array]]

_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_REMATS = {"remat2", "checkpoint"}
# Unary primitives that commute with slicing the stack along axis 0 (applied per layer instead).
_PER_LAYER_UNARY = {"convert_element_type", "copy", "copy_p", "optimization_barrier"}


@dataclasses.dataclass(frozen=True)
class _Stacked:
    """A virtual full ``[.., L, ..]`` value: layer ``l`` (the slice at ``axis``) is
    ``post(gather({leaf: shard[l]})[leaf])``."""

    leaf: int
    shard: Any
    axis: int
    post: tuple[Callable[[Any], Any], ...] = ()

    def layer(self, gathered: Any) -> Any:
        for f in self.post:
            gathered = f(gathered)
        return gathered


@dataclasses.dataclass
class _Ctx:
    gather: GatherFn
    remat: bool
    policy: Any
    name: str
    prevent_cse: bool
    carry_name: str | None = None
    scanned: dict[int, set[int]] = dataclasses.field(default_factory=dict)
    whole: set[int] = dataclasses.field(default_factory=set)


def _source(eqn: Any) -> Any:
    """Keep the equation's name stack (HLO op names, profiles), as ``jax.core.eval_jaxpr``
    does; a no-op where jax's private helper is missing."""
    try:
        from jax._src import source_info_util as siu
    except ImportError:  # pragma: no cover
        return contextlib.nullcontext()
    stack = siu.current_name_stack() + eqn.source_info.name_stack
    return siu.user_context(eqn.source_info.traceback, name_stack=stack)


def _materialize(x: Any, ctx: _Ctx) -> Any:
    """Fallback: gather every layer (vmap of ``gather``) and stack them at ``x.axis``."""
    if not isinstance(x, _Stacked):
        return x
    ctx.whole.add(x.leaf)
    return jax.vmap(lambda r: x.layer(ctx.gather({x.leaf: r})[x.leaf]), out_axes=x.axis)(x.shard)


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    params = eqn.primitive.get_bind_params(eqn.params)
    with _source(eqn), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _eval(jaxpr: Jaxpr, consts: list[Any], args: list[Any], ctx: _Ctx) -> list[Any]:
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        if any(isinstance(x, _Stacked) for x in invals):
            outs = _rule(eqn, invals, ctx)
        else:
            outs = _bind(eqn, invals)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _rule(eqn: Any, invals: list[Any], ctx: _Ctx) -> list[Any]:
    """An equation with at least one stacked operand."""
    name = eqn.primitive.name
    if name == "scan":
        return _scan(eqn, invals, ctx)
    if name in _CALLS:  # inline: jit inside a traced step changes nothing but the HLO's names
        closed = eqn.params[_CALLS[name]]
        return _eval(closed.jaxpr, list(closed.consts), invals, ctx)
    if name in _REMATS:
        return _remat(eqn, invals, ctx)
    x = invals[0]
    if name in _PER_LAYER_UNARY and len(invals) == 1 and len(eqn.outvars) == 1:
        f = lambda v: _bind(eqn, [v])[0]  # noqa: E731
        return [dataclasses.replace(x, post=(*x.post, f))]
    if name == "transpose" and isinstance(x, _Stacked):
        perm = tuple(eqn.params["permutation"])
        if perm[0] == x.axis:  # the stacked axis ends up first: transpose each layer instead
            rest = [d if d < x.axis else d - 1 for d in perm[1:]]
            g = lambda v, rest=tuple(rest): jnp.transpose(v, rest)  # noqa: E731
            return [dataclasses.replace(x, axis=0, post=(*x.post, g))]
    return _bind(eqn, [_materialize(v, ctx) for v in invals])


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int]:
    """``(consts, carry)`` operand counts of a ``scan`` equation's ``params``: named
    ``num_consts`` / ``num_carry`` up to jax 0.10; from jax 0.11 a flat tree ``ft_in`` packing
    the (consts, carry, xs) groups.

    Example:
        >>> scan_counts({"num_consts": 2, "num_carry": 1})
        (2, 1)
    """
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    if "ft_in" in params:
        consts, carry, _ = params["ft_in"].unpack()
        return len(consts), len(carry)
    raise NotImplementedError(
        f"jaxdp: this jax's scan equations carry neither num_consts nor ft_in (params: "
        f"{sorted(params)}); jaxdp's ZeRO-3 scan rewrite needs updating for jax "
        f"{jax.__version__}."
    )


def _only_scanned(jaxpr: Jaxpr, v: Any) -> bool:
    """Whether every use of ``v`` in ``jaxpr`` is (through calls, casts) a scan's ``xs``."""
    if any(u is v for u in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        for k, u in enumerate(eqn.invars):
            if u is not v:
                continue
            name, p = eqn.primitive.name, eqn.params
            if name == "scan":
                nc, nk = scan_counts(p)
                body = p["jaxpr"].jaxpr
                if nc <= k < nc + nk or (k < nc and not _only_scanned(body, body.invars[k])):
                    return False
            elif name in _CALLS or name in _REMATS:
                inner = p[_CALLS[name]].jaxpr if name in _CALLS else p["jaxpr"]
                if not _only_scanned(inner, inner.invars[k]):
                    return False
            elif name in _PER_LAYER_UNARY or (name == "transpose" and p["permutation"][0] == 0):
                if len(eqn.outvars) != 1 or not _only_scanned(jaxpr, eqn.outvars[0]):
                    return False
            else:
                return False
    return True


def _remat(eqn: Any, invals: list[Any], ctx: _Ctx) -> list[Any]:
    """Re-wrap a ``checkpoint`` region, passing stacked shards through as plain arguments."""
    is_st = [isinstance(v, _Stacked) for v in invals]
    flat = [v.shard if s else v for v, s in zip(invals, is_st)]

    def inner(*flat_args: Any) -> list[Any]:
        args = [
            dataclasses.replace(v, shard=a) if s else a for v, s, a in zip(invals, is_st, flat_args)
        ]
        outs = _eval(eqn.params["jaxpr"], [], args, ctx)
        return [_materialize(o, ctx) for o in outs]

    p = eqn.params
    return list(jax.checkpoint(inner, prevent_cse=p["prevent_cse"], policy=p["policy"])(*flat))


def _scan(eqn: Any, invals: list[Any], ctx: _Ctx) -> list[Any]:
    p = eqn.params
    nc, nk = scan_counts(p)
    closed = p["jaxpr"]
    # A stacked constant reaches the body as a virtual value only if the body scans it (else
    # the body would gather the whole stack in every iteration): gather it once, here.
    consts = [
        v
        if not isinstance(v, _Stacked) or _only_scanned(closed.jaxpr, closed.jaxpr.invars[k])
        else _materialize(v, ctx)
        for k, v in enumerate(invals[:nc])
    ]
    carry = [_materialize(v, ctx) for v in invals[nc : nc + nk]]
    xs = list(invals[nc + nk :])
    st = [i for i, v in enumerate(xs) if isinstance(v, _Stacked) and v.axis == 0]
    xs = [v if i in st else _materialize(v, ctx) for i, v in enumerate(xs)]
    for i in st:
        ctx.scanned.setdefault(xs[i].leaf, set()).add(p["length"])
    scan_in = [v.shard if i in st else v for i, v in enumerate(xs)]

    def step(carry_: list[Any], xs_: list[Any]) -> tuple[list[Any], list[Any]]:
        rows = {xs[i].leaf: xs_[i] for i in st}
        full = ctx.gather(rows) if rows else {}
        if ctx.remat:
            full = {k: checkpoint_name(v, ctx.name) for k, v in full.items()}
        xs_full = [xs[i].layer(full[xs[i].leaf]) if i in st else x for i, x in enumerate(xs_)]
        outs = _eval(closed.jaxpr, list(closed.consts), [*consts, *carry_, *xs_full], ctx)
        outs = [_materialize(o, ctx) for o in outs]
        if ctx.remat and st and ctx.carry_name is not None:
            outs[:nk] = [checkpoint_name(o, ctx.carry_name) for o in outs[:nk]]
        return outs[:nk], outs[nk:]

    if ctx.remat and st:
        policy = ctx.policy or jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        step = jax.checkpoint(step, policy=policy, prevent_cse=ctx.prevent_cse)
    return scan_again(p, step, carry, scan_in)


def scan_again(
    params: Mapping[str, Any], step: Callable[..., Any], carry: list[Any], xs: list[Any]
) -> list[Any]:
    """``jax.lax.scan`` of a new body ``step`` with a ``scan`` equation's ``params`` (length,
    direction, unroll): its outputs, carries then stacked ``ys``."""
    kw = {"_split_transpose": params["_split_transpose"]} if "_split_transpose" in params else {}
    carry_out, ys = jax.lax.scan(
        step,
        carry,
        xs,
        length=params["length"],
        reverse=params["reverse"],
        unroll=params["unroll"],
        **kw,
    )
    return [*carry_out, *ys]


def _trace(fn: Callable, params: Any, stacked: Mapping[int, int], gather: GatherFn, args: Any):
    """Closed jaxpr of ``fn`` at the full shapes, traced in the caller's context (keeps the
    varying-manual-axes types a ``shard_map`` body gives its values)."""
    leaves, treedef = jax.tree.flatten(params)
    full = list(leaves)
    for i, ax in stacked.items():  # full avals from the gather (dtype; vma under shard_map)
        one = lambda r, i=i: gather({i: r})[i]  # noqa: E731
        full[i] = jax.eval_shape(jax.vmap(one, out_axes=ax), leaves[i])
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
        jax.tree.unflatten(treedef, full), *args
    )
    return closed, out_shape, leaves


def _run(fn, params, args, stacked, gather, ctx: _Ctx):
    closed, out_shape, leaves = _trace(fn, params, stacked, gather, args)
    flat_in = [
        _Stacked(i, x, stacked[i]) if i in stacked else x
        for i, x in enumerate([*leaves, *jax.tree.leaves(args)])
    ]
    outs = _eval(closed.jaxpr, list(closed.consts), flat_in, ctx)
    outs = [_materialize(o, ctx) for o in outs]
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
