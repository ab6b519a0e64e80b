"""The optimizer update bucket by bucket, with its state in host memory between steps.

With ``optimizer_cpu_offload`` set, the master weights and the optimizer state of the
offloaded buckets (:class:`jaxdp._src.forms.codec.Offload`) live in pinned host memory. The
step brings them into device memory, runs the update and writes them back. Brought in all at
once, the whole state would be on the device during the update, so the update is split by
bucket: the update function (clipping, ``optimizer.update``, the skip) is traced once to a
jaxpr, and each output leaf is given to the bucket of the inputs it reads
(:func:`split_by_bucket`). Each bucket then evaluates only the equations its outputs need,
on inputs brought in for it, and writes its outputs back. The equations are the traced ones,
run on the same values in the same dtypes: the results are bit-equal to the update of the
whole tree, only placement changes.

The first bucket's inputs (and those every bucket reads, such as Adam's step count) are brought
in once the gradient norm is computed (``start_after``: the last value of the backward pass),
and each next bucket's once the previous one is written back (data dependences through
``optimization_barrier``, which XLA keeps as a tuple). So one bucket of state is on the device
at a time, and none during the forward and backward passes: without the first dependence XLA
brings the first bucket in at the start of the program and keeps it through the activations'
peak, and computes the norm last, keeping every gradient until then. After the backward pass
the old params of a donated step are dead until the new ones are written, and at stages 1-2 XLA
places the buckets brought in in their buffers (BENCHMARKS.md section 4 has the bytes). Waiting
only for the previous bucket's update instead (so that its copies back overlap the next
bucket's copies in) kept most of the state on the device at stage 1: XLA's scheduler puts the
copies back late.

An output that reads the inputs of several buckets (a global norm inside the optimizer) makes
the split impossible: then the whole update is one group, brought in at once, which still
frees the device of the state outside the update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..forms.codec import DEVICE, HOST

__all__ = ["Split", "split_by_bucket", "to_device", "update_by_bucket"]


def _is_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def to_device(x: Any, sharding: Any) -> Any:
    """``x`` in device memory (a transfer where ``sharding`` is a host sharding)."""
    if _is_host(sharding):
        return jax.device_put(x, sharding.with_memory_kind(DEVICE))
    return x


def _sub_jaxpr(params: dict[str, Any]) -> Jaxpr | None:
    for v in params.values():
        if isinstance(v, ClosedJaxpr):
            return v.jaxpr
        if isinstance(v, Jaxpr):
            return v
    return None


def _deps(jaxpr: Jaxpr, ins: Sequence[int]) -> list[int]:
    """For each outvar of ``jaxpr``, the bitset of the inputs it reads (``ins``: the bitset of
    each invar); the equations of a sub-jaxpr with matching arity are followed inside."""
    env: dict[Any, int] = dict(zip(jaxpr.invars, ins, strict=True))
    for v in jaxpr.constvars:
        env[v] = 0

    def read(v: Any) -> int:
        return 0 if isinstance(v, Literal) else env.get(v, 0)

    for eqn in jaxpr.eqns:
        got = [read(v) for v in eqn.invars]
        sub = _sub_jaxpr(eqn.params)
        if (
            sub is not None
            and len(sub.invars) == len(eqn.invars)
            and len(sub.outvars) == len(eqn.outvars)
        ):
            outs = _deps(sub, got)
        else:
            union = 0
            for g in got:
                union |= g
            outs = [union] * len(eqn.outvars)
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def _needed(jaxpr: Jaxpr, outs: Sequence[int]) -> tuple[list[Any], set[int]]:
    """The equations that outputs ``outs`` need, in order, and the invars (by index) they read."""
    live = {jaxpr.outvars[i] for i in outs if not isinstance(jaxpr.outvars[i], Literal)}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars):
            eqns.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    index = {v: i for i, v in enumerate(jaxpr.invars)}
    return eqns[::-1], {index[v] for v in live if v in index}


class Split:
    """How an update's jaxpr splits into groups (module docstring).

    Attributes:
        groups: ``(bucket or None, output indices, input indices)`` in the order they run; the
            group of bucket ``None`` (outputs that read no bucket's inputs, e.g. step counts)
            runs first.
        shared: the inputs every group may read (brought in before the first group).
        whole: the update could not be split (one group holds every output).
    """

    def __init__(
        self, groups: list[tuple[int | None, list[int], set[int]]], shared: set[int], whole: bool
    ):
        self.groups, self.shared, self.whole = groups, shared, whole


def split_by_bucket(jaxpr: Jaxpr, in_buckets: Sequence[int | None]) -> Split:
    """Group the outputs of ``jaxpr`` by the bucket of the inputs they read.

    ``in_buckets``: the bucket of each invar (``None``: a value of no bucket, such as the norm
    or a step count, or one whose bucket is not known: an optimizer-state leaf). An output
    reading known inputs of one bucket belongs to it, and so do the unknown inputs it reads;
    an output reading known inputs of two buckets makes the split fail (``whole``).
    """
    n = len(jaxpr.invars)
    deps = _deps(jaxpr, [1 << i for i in range(n)])
    out_bucket: list[int | None] = []
    owner: dict[int, set[int]] = {}
    for d in deps:
        reads = [i for i in range(n) if d >> i & 1]
        known = {in_buckets[i] for i in reads if in_buckets[i] is not None}
        if len(known) > 1:
            return _whole(jaxpr)
        b = next(iter(known)) if known else None
        out_bucket.append(b)
        if b is not None:
            for i in reads:
                if in_buckets[i] is None:
                    owner.setdefault(i, set()).add(b)
    bucket_of = [in_buckets[i] for i in range(n)]
    for i, bs in owner.items():
        bucket_of[i] = next(iter(bs)) if len(bs) == 1 else None
    order = sorted({b for b in out_bucket if b is not None})
    groups: list[tuple[int | None, list[int], set[int]]] = []
    shared: set[int] = set()
    for b in [None, *order]:
        outs = [o for o, ob in enumerate(out_bucket) if ob == b]
        if not outs:
            continue
        _, needs = _needed(jaxpr, outs)
        if b is not None and any(bucket_of[i] not in (None, b) for i in needs):
            return _whole(jaxpr)  # an equation that bundles several buckets' values
        shared |= {i for i in needs if bucket_of[i] is None}
        groups.append((b, outs, {i for i in needs if bucket_of[i] is not None}))
    return Split(groups, shared, whole=False)


def _whole(jaxpr: Jaxpr) -> Split:
    outs = list(range(len(jaxpr.outvars)))
    _, reads = _needed(jaxpr, outs)
    return Split([(None, outs, reads)], set(), whole=True)


def _eval(jaxpr: Jaxpr, consts: Sequence[Any], args: dict[int, Any], outs: list[int]) -> list[Any]:
    """Evaluate only the equations of ``jaxpr`` that outputs ``outs`` need (``args``: the
    values of the invars they read, by index)."""
    eqns, _ = _needed(jaxpr, outs)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update({jaxpr.invars[i]: x for i, x in args.items()})

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            got = eqn.primitive.bind(*[read(v) for v in eqn.invars], **params)
        if not eqn.primitive.multiple_results:
            got = [got]
        for v, x in zip(eqn.outvars, got, strict=True):
            env[v] = x
    return [read(jaxpr.outvars[o]) for o in outs]


def _brought_in(
    flat: list[Any], shardings: list[Any], index: list[int], written: list[Any]
) -> dict[int, Any]:
    """``flat[i]`` for each ``i`` of ``index`` in device memory; those in host memory (where
    ``shardings[i]`` is a host sharding) brought in once ``written`` is computed."""
    host = [i for i in index if _is_host(shardings[i])]
    got = [flat[i] for i in host]
    if host and written:
        got = list(jax.lax.optimization_barrier((got, written))[0])
    out = {i: flat[i] for i in index}
    out.update({i: to_device(x, shardings[i]) for i, x in zip(host, got, strict=True)})
    return out


def update_by_bucket(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    in_buckets: tuple[Any, ...],
    in_shardings: tuple[Any, ...],
    out_shardings: Any,
    *,
    start_after: Any = None,
) -> tuple[Any, Any]:
    """``fn(*args)``, evaluated bucket by bucket (module docstring).

    Args:
        fn: the update, a function of pytrees returning a pytree.
        args: its arguments.
        in_buckets: like ``args``: each leaf's bucket, or ``None``.
        in_shardings: like ``args``: each leaf's sharding (a host sharding is brought in), or
            ``None`` (on the device already).
        out_shardings: like ``fn``'s result: the sharding each output leaf is written to.
        start_after: values (a pytree) computed before the first offloaded bucket is brought
            in, e.g. the gradient norm; ``None``: no such order.

    Returns:
        ``(placed, on_device)``: the outputs in their shardings' memory, and the same values
        as computed on the device (for what the step computes from them next).
    """
    flat, treedef_ = jax.tree_util.tree_flatten(args)
    treedef: Any = treedef_
    buckets = treedef.flatten_up_to(in_buckets)
    shardings = treedef.flatten_up_to(in_shardings)

    out_tree: list[Any] = []

    def flat_fn(*xs: Any) -> Any:
        leaves, td = jax.tree_util.tree_flatten(fn(*jax.tree_util.tree_unflatten(treedef, xs)))
        out_tree.append(td)
        return leaves

    # traced on device-memory shapes (an offloaded leaf's own type is in host memory)
    shapes = [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in flat]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*shapes)
    jaxpr, consts = closed.jaxpr, closed.consts
    split = split_by_bucket(jaxpr, buckets)
    out_def: Any = out_tree[0]
    out_sh = out_def.flatten_up_to(out_shardings)
    on_device: list[Any] = [None] * len(out_shape)
    placed: list[Any] = [None] * len(out_shape)
    # what the next offloaded inputs wait for: start_after, then the previous offloaded
    # group's outputs, written back
    written: list[Any] = list(jax.tree_util.tree_leaves(start_after))
    values = _brought_in(flat, shardings, sorted(split.shared), written)
    for _, outs, reads in split.groups:
        mine = sorted(reads)
        host = any(_is_host(shardings[i]) for i in mine)
        args_g = {**values, **_brought_in(flat, shardings, mine, written)}
        res = _eval(jaxpr, consts, {i: args_g[i] for i in _needed(jaxpr, outs)[1]}, outs)
        for o, y in zip(outs, res, strict=True):
            on_device[o] = y
            placed[o] = jax.device_put(y, out_sh[o]) if _is_host(out_sh[o]) else y
        if host:
            written = [placed[o] for o in outs if _is_host(out_sh[o])]
    return (
        jax.tree_util.tree_unflatten(out_tree[0], placed),
        jax.tree_util.tree_unflatten(out_tree[0], on_device),
    )
