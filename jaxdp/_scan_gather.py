"""Gather scanned layer stacks one layer per scan iteration (the ZeRO-3 piece for ``lax.scan``).

Transformers built with ``flax.linen.scan``, ``nnx.scan`` or a raw :func:`jax.lax.scan` keep each
layer parameter stacked as one ``[L, ...]`` array that the scan slices one layer per iteration.
Under ZeRO-3 such a leaf is stored as a per-layer shard array ``[L, *shard]``; gathering it whole
before the loss would hold every layer at once. :func:`gather_in_scans` instead traces the user's
function to a jaxpr and re-evaluates it with the gather moved *into* the body of the scan that
consumes the stack, so each iteration gathers one layer. AD runs on the rewritten program, so the
transpose of the gather (for ``all_gather``: ``psum_scatter``) also happens per layer, and with
``remat_gather=True`` the backward loop gathers the layer again instead of keeping every gathered
layer alive as a residual.

The module knows nothing about buckets or meshes: the caller supplies ``gather``, which receives a
dict ``{leaf index: one row of that leaf's shard array}`` and returns ``{leaf index: the full layer
slice}``. Every stacked leaf consumed by the same scan arrives in the same call, so the caller can
pack them into one collective per layer.

Inference (:func:`find_scanned_axes`; :func:`find_scanned_leaves` for axis 0 only) reports
leaves whose every use is as ``xs`` of a scan, possibly through ``jit``, ``closed_call``,
``checkpoint``/``remat``, an outer scan's constants (a micro-batch loop), dtype casts, or a
transpose that brings the stacked axis first (``nn.scan(variable_axes={"params": 1})``). When it
cannot see the stack (layers sliced by hand, ``fori_loop`` indexing), mark leaves by path with
:func:`stacked_by_path`; a marked leaf that reaches anything but a scan (``while``, ``cond``,
``custom_jvp``/``custom_vjp`` calls, indexing, arithmetic) is gathered whole for that use (vmap
of ``gather``): correct, only without the memory saving.

Use from a ZeRO-3 engine (inside its ``shard_map`` over the data axis):

1. Once, at layout time (shapes only): ``stacked = {i: ax for i, (ax, _) in
   find_scanned_axes(loss_fn, abstract_params, abstract_batch).items()}``, updated with
   ``stacked_by_path(abstract_params, user_rules)`` (the user's marks win).
2. Store each stacked leaf as ``[L, *piece]``: layer ``l`` (``moveaxis(leaf, axis, 0)[l]``)
   flattened, padded to a multiple of ``dp`` and cut into ``dp`` pieces, rank ``r`` holding piece
   ``r`` (any per-layer layout works; the engine's gather is the only code that knows it).
3. Per micro-batch: ``loss = gather_in_scans(loss_fn, stacked, gather, remat_gather=True)``
   and differentiate ``loss(params_mixed, batch)`` with respect to ``params_mixed``: stacked
   leaves are the local ``[L, *piece]`` arrays, all other leaves whatever the engine gathers for
   them (e.g. full params from its bucketed gather).
4. ``gather(rows)`` receives ``{leaf index: rows[leaf] = this rank's piece of one layer}`` for
   all stacked leaves of one scan and returns ``{leaf index: that layer, full shape (the leaf's
   shape without the stacked axis), compute dtype}``, e.g. concatenate the pieces, one
   ``all_gather`` over the data axis, split, unpad, reshape. Its transpose (``psum_scatter`` for
   ``all_gather``; wrap it in a ``custom_vjp`` for fp32 accumulation) is the per-layer gradient
   reduce-scatter, landing in the ``[L, *piece]`` gradient of each stacked leaf.

Example (one device; the "shard" of a layer is the flattened layer, the gather a reshape):

    >>> import jax, jax.numpy as jnp
    >>> def loss(p, x):
    ...     h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
    ...     return (h @ p["head"]).sum()
    >>> p = {"head": jnp.ones((3, 2)), "layers": jnp.ones((4, 3, 3)) / 3}
    >>> x = jnp.ones((2, 3))
    >>> find_scanned_leaves(loss, p, x)  # leaf 1 ("layers") is scanned over 4 layers
    {1: 4}
    >>> stacked_by_path(p, {r"layers": 0})  # the same, marked by hand
    {1: 0}
    >>> mixed = {"head": p["head"], "layers": p["layers"].reshape(4, 9)}
    >>> gather = lambda rows: {i: r.reshape(3, 3) for i, r in rows.items()}
    >>> loss2 = gather_in_scans(loss, {1: 0}, gather)
    >>> bool(jnp.allclose(loss2(mixed, x), loss(p, x)))
    True
    >>> g = jax.grad(loss2)(mixed, x)["layers"]
    >>> bool(jnp.allclose(g, jax.grad(loss)(p, x)["layers"].reshape(4, 9)))
    True

A stack kept at axis 1 (``[3, L, 3]``) that the model moves to the front before its scan is
inferred by :func:`find_scanned_axes`, or marked by hand with its axis:

    >>> def loss_t(p, x):
    ...     return loss({**p, "layers": jnp.transpose(p["layers"], (1, 0, 2))}, x)
    >>> pt = {**p, "layers": jnp.transpose(p["layers"], (1, 0, 2))}
    >>> find_scanned_axes(loss_t, pt, x)  # leaf 1: stacked axis 1, 4 layers
    {1: (1, 4)}
    >>> stacked_by_path(pt, {r"^layers$": 1})
    {1: 1}
    >>> bool(jnp.allclose(gather_in_scans(loss_t, {1: 1}, gather)(mixed, x), loss(p, x)))
    True
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Jaxpr, Literal

__all__ = [
    "DEFAULT_NAME",
    "GatherFn",
    "find_scanned_axes",
    "find_scanned_leaves",
    "gather_in_scans",
    "per_leaf",
    "stacked_by_path",
]

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
                nc, nk = p["num_consts"], p["num_carry"]
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
    nc, nk = p["num_consts"], p["num_carry"]
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
    kw = {"_split_transpose": p["_split_transpose"]} if "_split_transpose" in p else {}
    carry_out, ys = jax.lax.scan(
        step, carry, scan_in, length=p["length"], reverse=p["reverse"], unroll=p["unroll"], **kw
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


def gather_in_scans(
    fn: Callable[..., Any],
    stacked: Mapping[int, int],
    gather: GatherFn,
    *,
    remat_gather: bool = False,
    policy: Callable[..., Any] | None = None,
    name: str = DEFAULT_NAME,
    prevent_cse: bool = False,
    carry_name: str | None = None,
) -> Callable[..., Any]:
    """``fn2(params_mixed, *args)`` computes ``fn(params_full, *args)`` gathering stacks per layer.

    Args:
        fn: ``fn(params, *args)``; any pytree output. Traced once per call of ``fn2`` (in the
            caller's context, so collectives of an enclosing ``shard_map`` are allowed).
        stacked: ``{leaf index (jax.tree.leaves order of params): stacked axis of the full leaf}``.
            ``params_mixed`` leaf ``i`` is then a shard array ``[L, *shard]`` (always layers
            first) and the full leaf is ``stack([gather({i: shard[l]})[i] for l in range(L)],
            axis)``. Other leaves are passed through unchanged.
        gather: ``{leaf: shard row} -> {leaf: full layer slice}``; called inside the scan body
            with every stacked leaf that scan consumes (one call per iteration), or under
            ``vmap`` with one leaf where a stack is used other than by a scan. May contain
            collectives of an enclosing ``shard_map``.
        remat_gather: wrap each rewritten scan body (gather + original body) in
            ``jax.checkpoint(policy=policy)`` and name every gathered layer ``name``, so the
            backward loop gathers each layer again instead of the forward saving all of them.
        policy: the checkpoint policy for ``remat_gather``. It must not save any value computed
            inside ``gather`` (a policy saves an eqn's output or recomputes it from the nearest
            saved ancestor, so "save everything but the named layer" would save the all-gather
            result that precedes it; and jax 0.10.2's ``save_anything_except_these_names``
            ignores its arguments). Default ``dots_with_no_batch_dims_saveable``: matmul
            outputs (activations) are kept, everything else, the gather included, is
            recomputed. ``nothing_saveable`` or ``save_only_these_names(...)`` also qualify.
        name: the ``checkpoint_name`` of gathered layers.
        prevent_cse: passed to ``jax.checkpoint`` (False is right inside a scan).
        carry_name: with ``remat_gather``, also name each iteration's carry output (the next
            layer's input). An enclosing ``jax.checkpoint`` decides what the scans save
            (jax applies the outermost policy to nested ``checkpoint`` bodies); one whose
            policy saves this name keeps each layer's input instead of running the forward
            loop (and its gathers) again in the backward pass to recompute it.
    """

    def fn2(params_mixed: Any, *args: Any) -> Any:
        ctx = _Ctx(gather, remat_gather, policy, name, prevent_cse, carry_name)
        return _run(fn, params_mixed, args, dict(stacked), gather, ctx)

    return fn2


def _probe(fn: Callable, params: Any, args: Any, axis: int, cand: list[int]) -> dict[int, int]:
    """One shape-only trace with the identity gather, leaves ``cand`` stacked at ``axis``."""
    leaves, treedef = jax.tree.flatten(params)
    mixed = list(leaves)
    for i in cand:  # the "shard row" of a layer is the layer itself
        shape = list(jnp.shape(leaves[i]))
        mixed[i] = jax.ShapeDtypeStruct((shape.pop(axis), *shape), jnp.result_type(leaves[i]))
    ctx = _Ctx(lambda rows: rows, False, None, DEFAULT_NAME, False)

    def probe(m: Any, *a: Any) -> Any:
        return _run(fn, m, a, dict.fromkeys(cand, axis), ctx.gather, ctx)

    jax.make_jaxpr(probe)(jax.tree.unflatten(treedef, mixed), *args)
    return {i: min(ls) for i, ls in ctx.scanned.items() if len(ls) == 1 and i not in ctx.whole}


def find_scanned_axes(
    fn: Callable[..., Any], params: Any, *args: Any, axes: Sequence[int] | None = None
) -> dict[int, tuple[int, int]]:
    """``{leaf index: (stacked axis, L)}`` for leaves of ``params`` whose every use in
    ``fn(params, *args)`` is as ``xs`` of a ``lax.scan`` (directly, or after a transpose that
    brings the stacked axis first, as ``nn.scan(variable_axes={"params": 1})`` and MaxText's
    ``param_scan_axis=1`` do). Tries ``axes`` in order (default: every axis; one shape-only
    trace per axis while unresolved leaves remain); the first axis that works wins. A leaf
    scanned by scans of different lengths is not reported. ``params``/``args`` may be
    ``ShapeDtypeStruct``; if ``fn`` uses collectives, call it where their axes are bound."""
    leaves = jax.tree.leaves(params)
    ndim = [len(jnp.shape(x)) for x in leaves]
    found: dict[int, tuple[int, int]] = {}
    for ax in range(max(ndim, default=0)) if axes is None else axes:
        cand = [i for i, n in enumerate(ndim) if n > ax and i not in found]
        if cand:
            found.update((i, (ax, n)) for i, n in _probe(fn, params, args, ax, cand).items())
    return dict(sorted(found.items()))


def find_scanned_leaves(fn: Callable[..., Any], params: Any, *args: Any) -> dict[int, int]:
    """``{leaf index: L}`` for leaves of ``params`` that ``fn(params, *args)`` uses only as ``xs``
    of ``lax.scan`` along axis 0 (:func:`find_scanned_axes` restricted to axis 0)."""
    return {i: n for i, (_, n) in find_scanned_axes(fn, params, *args, axes=(0,)).items()}


def _path_str(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def stacked_by_path(params: Any, rules: Mapping[str, int]) -> dict[int, int]:
    """Mark stacked leaves by hand: ``{regex: stacked axis}`` matched (``re.search``) against
    each leaf's ``/``-joined key path (``"params/ScanBlock_0/Dense_0/kernel"``); the first
    matching rule wins. Returns ``{leaf index: axis}`` for :func:`gather_in_scans`."""
    out: dict[int, int] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(params)[0]):
        s = _path_str(path)
        for pat, ax in rules.items():
            if re.search(pat, s):
                out[i] = ax
                break
    return out


def per_leaf(fns: Mapping[int, Callable[[jax.Array], jax.Array]]) -> GatherFn:
    """A :data:`GatherFn` from one ``shard row -> full layer`` function per leaf."""
    return lambda rows: {i: fns[i](r) for i, r in rows.items()}
