"""Which parameter leaves are layer stacks that a ``lax.scan`` slices, and along which axis.

:func:`find_scanned_axes` (:func:`find_scanned_leaves` for axis 0 only) infers them with
shape-only traces of the user's function through the rewrite of :mod:`jaxdp._src.zero3.scan_rewrite`
(the identity as gather): a leaf is stacked when its every use is as ``xs`` of a scan.
:func:`stacked_by_path` marks them by hand, by regular expressions over the leaves' key paths.
Both return leaf indices for :func:`jaxdp._src.zero3.scan_gather.gather_in_scans`, which re-exports
them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .scan_rewrite import DEFAULT_NAME, _Ctx, _run

__all__ = ["find_scanned_axes", "find_scanned_leaves", "stacked_by_path"]


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
