"""ZeRO-3 for scanned layer stacks: detect them, and gather them one layer per scan iteration.

A parameter stacked ``[.., L, ..]`` and consumed by a ``lax.scan`` (flax ``nn.scan``,
``nnx.scan``, a raw scan over layers) would, as a plain bucket member, be gathered whole before
the loss: every layer's full params alive at once. Instead:

* :func:`find_stacks` (layout time, shapes only) finds such leaves with
  :func:`jaxdp._src.zero3.scan_gather.find_scanned_axes` on an abstract micro-batch, plus the user's
  ``scan_param_patterns`` (which win). :class:`jaxdp.BucketLayout` then stores each
  one per layer in a bucket of its own (:mod:`jaxdp._src.layout.stacked`: rank ``r`` holds piece
  ``r`` of
  every layer, locally an ``[L, p]`` block), and master weights, optimizer state and the fp32
  gradient accumulator follow that layout.
* :func:`zero3_scan_value_and_grad` is :func:`jaxdp._src.zero3.gather.zero3_value_and_grad` with the
  stacks moved into the scans (:func:`jaxdp._src.zero3.scan_gather.gather_in_scans`): each iteration
  gathers the layer of every stack that scan consumes, packed as one interleaved bucket of the
  layer's slices (a :class:`BucketLayout` over the per-layer shapes), with
  :func:`jaxdp._src.zero3.gather.make_bucket_gather`, so the transpose is the per-layer
  reduce-scatter
  with stage 2's numerics (wire dtype, ``grad_reduce_in_fp32``,
  ``reduce_scatter_with_fp32_accumulation``, deferred fp32 sums over micro-batches). The
  custom_vjp sends the reduced gradient to a zero ``acc`` input rather than to the bf16 shard,
  so each stack enters the scan as one fp32 ``[L, 2p + 1]`` array ``[shard | acc | flag]``
  whose per-layer rows the gather splits; its cotangent carries the reduced ``[L, p]``
  gradient and one non-finite flag per layer. The scan bodies are rematerialised with
  ``remat_policy`` (:func:`jaxdp._src.zero3.remat.remat_policy_for`), so the backward loop
  gathers every layer again.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ..comm.wire import Wire
from ..core.loss import UnboundAxis, unbound_axis_name
from ..layout.layout import BucketLayout, LayoutRules, path_str
from ..layout.stacked import layer_shape
from .gather import make_bucket_gather
from .remat import GATHERED, SCAN_CARRY
from .scan_gather import find_scanned_axes, gather_in_scans

__all__ = ["find_stacks", "zero3_scan_value_and_grad"]


def _abstract_microbatch(batch: Any, num_microbatches: int, dp: int) -> Any:
    def one(x: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(jnp.shape(x))
        n = shape[0] if shape else 1
        per = n // (num_microbatches * dp) if n >= num_microbatches * dp else n
        return jax.ShapeDtypeStruct((max(per, 1), *shape[1:]), jnp.result_type(x))

    return jax.tree.map(one, batch)


@contextlib.contextmanager
def _bound(axes: tuple[str, ...], dp: int) -> Iterator[None]:
    """Bind ``axes`` for a shape-only trace, as the step's ``shard_map`` binds them, so that a
    model's own collectives over the data axis (``nn.BatchNorm(axis_name="data")``) trace.
    The data axis gets ``dp`` (the expert axis, if any, 1: only shapes are traced). jax has no
    public way to bind an axis name without mapping over it; without this internal one (a jax
    that moved it) such a model fails detection as before, with jax's unbound-axis error."""
    try:
        from jax._src.core import extend_axis_env_nd
    except ImportError:  # pragma: no cover - depends on the jax version
        yield
        return
    with extend_axis_env_nd([(a, dp if i == 0 else 1) for i, a in enumerate(axes)]):
        yield


def find_stacks(
    loss_fn: Callable[..., Any],
    params: Any,
    example_batch: Any,
    dp: int,
    previous: dict[int, int] | None = None,
    *,
    num_microbatches: int = 1,
    param_dtype: str | None = None,
    patterns: tuple[tuple[str, int], ...] = (),
    axes: tuple[str, ...] = (),
) -> dict[int, int]:
    """``{leaf index: stacked axis}`` of the layer stacks to gather per layer (the plan calls
    it where stacks are gathered per layer: :func:`jaxdp._src.strategy.plan.finds_stacks`).

    Detection (``scan_layers``) needs ``example_batch`` (a global batch, arrays or
    ``ShapeDtypeStruct``, cut into ``num_microbatches`` per rank; params traced in
    ``param_dtype``); without one the stacks of ``previous`` (an earlier ``init``) are kept.
    ``patterns`` (``scan_param_patterns``) are applied last and win; one that matches no leaf
    raises. ``axes``: the axes the step binds (the data axis first, then the expert axis), bound
    while tracing so that a model's own collectives over them trace.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    found: dict[int, int] = dict(previous or {})
    if example_batch is not None:
        work = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                jnp.shape(x), jnp.dtype(param_dtype or jnp.result_type(x))
            ),
            params,
        )
        mb = _abstract_microbatch(example_batch, num_microbatches, dp)
        try:
            with _bound(axes, dp):
                scanned = find_scanned_axes(loss_fn, work, mb)
        except NameError as e:  # a model collective over another axis (UnboundAxis)
            name = unbound_axis_name(e)
            if not axes or name is None or name in axes:
                raise
            raise UnboundAxis(name, axes) from e
        found = {i: ax for i, (ax, _) in scanned.items()}
    paths = [path_str(kp) for kp, _ in flat]
    for pat, _ in patterns:
        if not any(re.search(pat, p) for p in paths):
            raise ValueError(
                f"scan_param_patterns: the pattern {pat!r} matches no parameter; "
                f"paths are {paths}. Fix: correct the regex (matched with re.search)."
            )
    for i, p in enumerate(paths):  # the first matching rule wins, over detection
        rule = next(((pat, ax) for pat, ax in patterns if re.search(pat, p)), None)
        if rule is not None:
            ndim = len(jnp.shape(flat[i][1]))
            if rule[1] >= ndim:
                raise ValueError(
                    f"scan_param_patterns: {rule[0]!r} marks axis {rule[1]} of {p!r}, "
                    f"whose shape is {tuple(jnp.shape(flat[i][1]))}. Fix: give its stacked axis."
                )
            found[i] = rule[1]
    return dict(sorted(found.items()))


def zero3_scan_value_and_grad(
    parts: Callable[[Any, Any], Any],
    layout: BucketLayout,
    wire: Wire,
    *,
    axis: str,
    policy: Callable[..., bool] | None,
    rules: LayoutRules,
    num_microbatches: int,
    place: Callable[..., Any] | None = None,
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """:func:`jaxdp._src.zero3.gather.zero3_value_and_grad` for a layout with per-layer stacks.

    ``policy``: the checkpoint policy of the loss and of the scan bodies; ``None``: neither is
    checkpointed (one shard, where every gather is an identity).

    ``rules``: the layout's (:class:`jaxdp.BucketLayout` is built from them; each layer's
    slices are laid out by them, one bucket per buffer). Stacks keep one accumulator per
    bucket.

    Same protocol: ``vg(accs, flags, shards, mb) -> ((loss, aux), (d_accs, d_flags))`` with one
    entry per bucket (``accs``/``flags`` of stack buckets are ignored; each shard is left to be
    divided by :func:`jaxdp._src.zero3.gather.zero3_divisors`), and the undifferentiated loss
    (for shapes). Takes
    the bucket shards (:meth:`BucketLayout.shard_unview` of the view), not the view. Runs on
    whole params only (the plan gives it no ``place``: stacks are not detected on
    tensor-parallel meshes).
    """
    del place
    g, deferred, dp = num_microbatches, num_microbatches > 1, layout.dp_size
    acc_dt = wire.accumulate
    stacked = dict(layout.stacked)
    stack_of = {layout.slots[i].bucket: i for i in stacked}
    plain = [b for b in layout.buckets if b.index not in stack_of]
    gathers = {
        b.index: make_bucket_gather(
            b,
            layout,
            wire,
            axis=axis,
            num_microbatches=g,
            deferred=deferred,
        )
        for b in plain
    }
    info = {}  # leaf -> (L, p, float dtype of its [L, 2p + 1] input)
    for i, ax in stacked.items():
        s = layout.slots[i]
        n_layers = s.shape[ax]
        mdt = jnp.result_type(jnp.float32, acc_dt, layout.buckets[s.bucket].dtype)
        info[i] = (n_layers, (s.end - s.start) // max(n_layers, 1), mdt)
    one_layer = rules.replace(
        bucket_size=None, num_buckets=None, high_nccl_busbw=False, own_bucket_param_patterns=()
    )
    layer_layouts: dict[tuple[int, ...], BucketLayout] = {}

    def gather(rows: dict[int, jax.Array]) -> dict[int, jax.Array]:
        keys = tuple(sorted(rows))
        if keys not in layer_layouts:
            shapes = tuple(
                jax.ShapeDtypeStruct(
                    layer_shape(layout.slots[i].shape, stacked[i]), layout.slots[i].dtype
                )
                for i in keys
            )
            layer_layouts[keys] = BucketLayout.build(shapes, one_layer, dp)
        ll = layer_layouts[keys]
        shard, acc, flag = {}, {}, {}
        for j, i in enumerate(keys):
            p = info[i][1]
            shard[j], acc[j], flag[j] = rows[i][:p], rows[i][p : 2 * p], rows[i][2 * p]
        full = []
        for b in ll.buckets:
            gb = make_bucket_gather(b, ll, wire, axis=axis, num_microbatches=g, deferred=deferred)
            flags = jnp.stack([flag[j].astype(jnp.float32) for j in b.slots])
            full.append(gb(ll.fill(b, shard, b.dtype), ll.fill(b, acc, acc_dt), flags))
        leaves = jax.tree.leaves(ll.unpack(tuple(full)))
        return {i: leaves[j] for j, i in enumerate(keys)}

    def unpack_plain(full: dict[int, jax.Array]) -> list[Any]:
        leaves: list[Any] = [None] * len(layout.slots)
        for bi, arr in full.items():
            b = layout.buckets[bi]
            mat = arr.reshape(dp, b.numel // dp)
            for i in b.slots:
                s = layout.slots[i]
                cols = mat[:, s.start - b.start : s.end - b.start]
                leaves[i] = layout.leaf_from_global(i, cols.reshape(-1))
        return leaves

    scanned = gather_in_scans(
        parts,
        stacked,
        gather,
        remat_gather=policy is not None,
        policy=policy,
        name=GATHERED,
        carry_name=SCAN_CARRY,
    )

    def loss(accs: Any, flags: Any, mixed: Any, shards: Any, mb: Any) -> Any:
        full = {}
        for k in reversed(range(len(plain))):  # forward order, as zero3_value_and_grad
            gb = gathers[plain[k].index]
            full[plain[k].index] = checkpoint_name(gb(shards[k], accs[k], flags[k]), GATHERED)
        leaves = unpack_plain(full)
        for i in stacked:
            leaves[i] = mixed[i]
        return scanned(jax.tree_util.tree_unflatten(layout.treedef, leaves), mb)

    body = loss if policy is None else jax.checkpoint(loss, policy=policy)
    inner = jax.value_and_grad(body, argnums=(0, 1, 2), has_aux=True)

    def vg(accs: Any, flags: Any, shards: Any, mb: Any) -> Any:
        mixed = {}
        for i in stacked:
            s = layout.slots[i]
            b = layout.buckets[s.bucket]
            n_layers, p, mdt = info[i]
            sh = shards[b.index][s.start - b.start : s.end - b.start]
            z = jax.lax.pcast(jnp.zeros((n_layers, p + 1), mdt), axis, to="varying")
            mixed[i] = jnp.concatenate([sh.reshape(n_layers, p).astype(mdt), z], axis=1)
        pick = [b.index for b in plain]
        out, (d_accs, d_flags, d_mixed) = inner(
            tuple(accs[k] for k in pick),
            tuple(flags[k] for k in pick),
            mixed,
            tuple(shards[k] for k in pick),
            mb,
        )
        red: list[Any] = [None] * len(layout.buckets)
        bad: list[Any] = [None] * len(layout.buckets)
        for k, bi in enumerate(pick):
            red[bi], bad[bi] = d_accs[k], d_flags[k]
        for i in stacked:
            b = layout.buckets[layout.slots[i].bucket]
            _, p, _ = info[i]
            dm = d_mixed[i]
            red[b.index] = layout.fill(b, {i: dm[:, p : 2 * p].astype(acc_dt).reshape(-1)}, acc_dt)
            bad[b.index] = jnp.max(dm[:, 2 * p]).astype(jnp.float32)[None]
        return out, (tuple(red), tuple(bad))

    def forward(accs: Any, flags: Any, shards: Any, mb: Any) -> Any:  # for shapes only
        del accs, flags
        full = tuple(jax.lax.all_gather(x, axis, tiled=True) for x in shards)
        return parts(layout.unpack(full), mb)

    return vg, forward
