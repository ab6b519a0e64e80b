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

The jaxpr rewrite itself lives in :mod:`jaxdp._src.zero3.scan_rewrite` and the inference below in
:mod:`jaxdp._src.zero3.scan_find`; this module re-exports the latter's functions.

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

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .scan_find import find_scanned_axes, find_scanned_leaves, stacked_by_path
from .scan_rewrite import DEFAULT_NAME, GatherFn, _Ctx, _run

__all__ = [
    "DEFAULT_NAME",
    "GatherFn",
    "find_scanned_axes",
    "find_scanned_leaves",
    "gather_in_scans",
    "per_leaf",
    "stacked_by_path",
]


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


def per_leaf(fns: Mapping[int, Callable[[jax.Array], jax.Array]]) -> GatherFn:
    """A :data:`GatherFn` from one ``shard row -> full layer`` function per leaf."""
    return lambda rows: {i: fns[i](r) for i, r in rows.items()}
