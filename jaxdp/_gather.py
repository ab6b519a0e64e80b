"""The parameter side: per-bucket gathers of sharded working params, and their transpose.

Two uses, both inside ``jax.shard_map`` over the data axis, on the local shard view of the
working params (``TrainState.params`` when ``config.shards_params``):

* :func:`gather_full` (``overlap_param_gather`` at stages 1-2): one plain ``all_gather`` per
  bucket at the start of the step, *outside* the differentiated function, so the gathered params
  serve every micro-batch and XLA can overlap bucket ``k+1``'s gather with the forward of the
  layers in bucket ``k``.
* :func:`make_leaf_gather` / :func:`make_bucket_gather` (ZeRO-3): a ``custom_vjp`` gather of one
  bucket (per parameter for interleaved layouts, whole for megatron layouts) whose transpose is the
  bucket's gradient reduce-scatter in the configured precision (:func:`jaxdp._reduce._reduce_one`,
  the same numerics as stage 2). The primal is bf16 (the working dtype) but the reduced gradient
  must be fp32, so the gather takes two extra zero inputs, ``acc`` (the fp32 shard) and ``flags``
  (one per parameter of the bucket), and the step differentiates with respect to *those*: the
  cotangent of ``acc`` is this rank's reduced fp32 shard, the cotangent of ``flags`` counts
  non-finite local gradients (``check_for_nan_in_grad``), the cotangent of the shard is zero.
  :func:`zero3_value_and_grad` wraps the user's loss in ``jax.checkpoint`` with the policy of
  ``DDPConfig.remat_policy`` (:func:`remat_policy_for`), none of which saves the gathered values
  (named :data:`GATHERED`) or what layout primitives derive from them, so the backward pass
  gathers every bucket again instead of keeping the full params alive as residuals.

Hook for scanned layer stacks: :func:`sharded_gather` takes any 1-D shard whose full value is its
tiled ``all_gather`` (a bucket shard, or rank ``r``'s piece of one layer of a stacked parameter)
and a ``reduce`` for its transpose. A transform that gathers one layer per ``lax.scan`` iteration
calls it on the per-layer slice of the shard with the per-layer slices of ``acc``/``flags`` and a
``reduce`` built like :func:`make_bucket_gather`'s (``_reduce_one`` on the layer's slice), and
tags the result with :data:`GATHERED` so no policy of :func:`remat_policy_for` saves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from ._config import DDPConfig
from ._layout import Bucket, BucketLayout
from ._reduce import _reduce_one

__all__ = [
    "GATHERED",
    "SCAN_CARRY",
    "gather_full",
    "gathers_per_parameter",
    "make_bucket_gather",
    "make_leaf_gather",
    "not_gathered_policy",
    "remat_policy_for",
    "sharded_gather",
    "zero3_value_and_grad",
]

#: ``checkpoint_name`` of the gathered params at stage 3 (never saved as a residual).
GATHERED = "jaxdp_gathered_params"

#: ``checkpoint_name`` of each iteration's carry output in a scan whose layer stack is gathered
#: per layer (the next layer's input; MaxText names it ``decoder_layer_input``). Saved by
#: every policy but ``"nothing"``: jax applies the outer ``jax.checkpoint``'s policy inside the
#: scan bodies, and without it the backward pass runs the forward loop, gathers included,
#: once more to recompute the layer inputs.
SCAN_CARRY = "jaxdp_scan_carry"


def gather_full(view: Any, layout: BucketLayout, axis: str) -> Any:
    """Local shard view -> the full working params, one ``all_gather`` per bucket.

    The result is typed as identical on every rank (``to="invarying"``), like replicated params.
    """
    shards = layout.shard_unview(view)  # each bucket in its working dtype
    full = tuple(jax.lax.all_gather(x, axis, tiled=True, to="invarying") for x in shards)
    return layout.unpack(full)


def gathers_per_parameter(layout: BucketLayout) -> bool:
    """Whether ZeRO-3 gathers ``layout``'s buckets per parameter (:func:`make_leaf_gather`):
    interleaved layouts without layer stacks. Others gather whole buckets."""
    return layout.kind == "interleaved" and not layout.stacked


def _nonfinite_flags(parts: Any) -> jax.Array:
    """1.0 per array of ``parts`` that holds a non-finite value, else 0.0."""
    return jnp.stack([(~jnp.all(jnp.isfinite(p))).astype(jnp.float32) for p in parts])


def _nonfinite(ct: jax.Array, b: Bucket, layout: BucketLayout) -> jax.Array:
    """1.0 per parameter of bucket ``b`` whose slice of the local gradient ``ct`` is not finite."""
    if layout.kind == "interleaved":
        mat = ct.reshape(layout.dp_size, b.numel // layout.dp_size)
        parts = [
            mat[:, layout.slots[i].start - b.start : layout.slots[i].end - b.start] for i in b.slots
        ]
    else:
        parts = [
            ct[layout.slots[i].start - b.start : layout.slots[i].end - b.start] for i in b.slots
        ]
    return _nonfinite_flags(parts)


# Primitives that only move, cast or replicate data. Their outputs are never saved for the
# backward pass: with a "save anything" policy the unpacked params (slices and reshapes of a
# gathered bucket), their casts and transposes would otherwise be kept alive as residuals
# although the gathered bucket itself is not; refusing them makes JAX save their (cheap to
# re-derive) inputs instead, and for the params that input is the shard, so the backward pass
# gathers again. Activations are unaffected: the producer of a reshaped activation is saved.
_LAYOUT_PRIMITIVES = frozenset(
    {
        "all_gather",
        "broadcast_in_dim",
        "concatenate",
        "convert_element_type",
        "copy",
        "copy_p",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "dynamic_slice",
        "pad",
        "reduce_precision",
        "reshape",
        "slice",
        "squeeze",
        "expand_dims",
        "transpose",
    }
)


def not_gathered_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``remat_policy="everything"``: save every intermediate except the gathered params
    (named :data:`GATHERED`) and anything a layout primitive derives from them."""
    if prim.name == "name":
        return bool(params.get("name") != GATHERED)
    return prim.name not in _LAYOUT_PRIMITIVES


def gemm_policy(prim: Any, *args: Any, **params: Any) -> bool:
    """``remat_policy="gemm"``: save only the outputs of ``dot_general`` without batch
    dimensions (jax's ``dots_with_no_batch_dims_saveable``) and the layer inputs of gathered
    scans (:data:`SCAN_CARRY`). Gathered params and their layout derivatives are never dots,
    so they are recomputed (gathered again)."""
    if prim.name == "name":
        return bool(params.get("name") == SCAN_CARRY)
    return bool(jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *args, **params))


# cuDNN fused attention (jax.nn.dot_product_attention(implementation="cudnn")) as a policy sees
# it: its custom_vjp's forward rule binds these (outputs: the attention output and the softmax
# statistics the backward kernel reads). The XLA implementation is plain dot_generals.
_FUSED_ATTENTION = frozenset(
    {
        "dot_product_attention_fwd_wrapper",
        "dot_product_attention_fp8_fwd_wrapper",
        "dot_product_attention_fwd",
        "dot_product_attention_fp8_fwd",
    }
)


def dots_policy(prim: Any, *args: Any, **params: Any) -> bool:
    """``remat_policy="dots"``: save every ``dot_general`` (batched too), convolution and
    cuDNN fused-attention output (jax's ``dots_saveable`` plus fused attention), and the layer
    inputs of gathered scans (:data:`SCAN_CARRY`)."""
    if prim.name == "name":
        return bool(params.get("name") == SCAN_CARRY)
    if prim.name in _FUSED_ATTENTION:
        return True
    return bool(jax.checkpoint_policies.dots_saveable(prim, *args, **params))


_POLICIES: dict[str, Callable[..., bool]] = {
    "gemm": gemm_policy,
    "dots": dots_policy,
    "everything": not_gathered_policy,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}


def remat_policy_for(config: DDPConfig) -> Callable[..., bool]:
    """The ``jax.checkpoint`` policy of stage 3 for ``config.remat_policy``.

    The one place that maps the field to a policy: :func:`zero3_value_and_grad` and
    :func:`jaxdp._zero3_scan.zero3_scan_value_and_grad` (outer loss and scan bodies) use it.
    Every policy refuses the gathered params (named :data:`GATHERED`) and what layout
    primitives derive from them, so the backward pass gathers them again.

    Example:
        >>> from jaxdp import DDPConfig
        >>> remat_policy_for(DDPConfig(zero_stage=3)) is gemm_policy
        True
    """
    return _POLICIES[config.remat_policy]


def sharded_gather(
    axis: str,
    reduce: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``gather(shard, acc, flags) -> all_gather(shard)`` whose transpose is ``reduce``.

    The building block of ZeRO-3 (call inside ``shard_map`` over ``axis``). ``shard`` is a 1-D
    array whose full value is its tiled ``all_gather`` (a bucket shard of the interleaved or
    megatron layout, or a per-layer slice of one); ``acc`` and ``flags`` are zeros the caller
    differentiates with respect to. In the backward pass ``reduce(ct)`` receives the local
    gradient of the full value and returns ``(reduced_shard, nonfinite_flags)``, which become the
    cotangents of ``acc`` and ``flags`` (so they must match their shapes and dtypes); the
    cotangent of ``shard`` is zero. Nothing but shapes is saved for the backward pass.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxdp import make_mesh
        >>> mesh = make_mesh()
        >>> def red(ct):  # the local gradient of the full value -> (shard, flags)
        ...     flags = jax.lax.pcast(jnp.zeros((1,)), "data", to="varying")
        ...     return jax.lax.psum_scatter(ct, "data", tiled=True), flags
        >>> gather = sharded_gather("data", red)
        >>> def body(shard, acc, flags):
        ...     return jax.grad(lambda a: jnp.sum(gather(shard, a, flags) ** 2))(acc)
        >>> n = jax.device_count()
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        >>> f(jnp.ones(2 * n), jnp.zeros(2 * n), jnp.zeros(n)).tolist() == [2.0 * n] * (2 * n)
        True
    """

    @jax.custom_vjp
    def gather(shard: jax.Array, acc: jax.Array, flags: jax.Array) -> jax.Array:
        del acc, flags
        return jax.lax.all_gather(shard, axis, tiled=True)

    def fwd(shard: jax.Array, acc: jax.Array, flags: jax.Array) -> tuple[jax.Array, None]:
        return gather(shard, acc, flags), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        red, bad = reduce(ct)
        # the shard's shape and dtype follow from the full value's (a tiled gather)
        n = ct.shape[0] // jax.lax.axis_size(axis)
        zero = jax.lax.pcast(jnp.zeros((n,), ct.dtype), axis, to="varying")
        return zero, red, bad

    gather.defvjp(fwd, bwd)
    return gather


def make_bucket_gather(
    b: Bucket,
    layout: BucketLayout,
    config: DDPConfig,
    *,
    num_microbatches: int,
    deferred: bool,
    divisors: list[int],
) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """The ZeRO-3 gather of bucket ``b``: :func:`sharded_gather` with stage 2's reduction.

    Forward: ``all_gather(shard)`` (tiled, wire dtype = the working dtype). Backward: the local
    gradient of the full bucket is cast to ``config.main_grads_dtype`` and reduce-scattered as
    stage 2 does (``deferred``: unscaled fp32 sums for a micro-batch accumulator, whose divisor
    is appended to ``divisors`` at trace time; else the final mean). Cotangents: zero for
    ``shard``, the reduced shard (``main_grads_dtype[b.shard_numel]``) for ``acc``, non-finite
    flags for ``flags`` (``float32[len(b.slots)]``).
    """
    axis = config.data_axis
    acc_dt = jnp.dtype(config.main_grads_dtype)

    def reduce(ct: jax.Array) -> tuple[jax.Array, jax.Array]:
        red, div = _reduce_one(ct.astype(acc_dt), b, layout, config, num_microbatches, deferred)
        divisors.append(div)  # a static int, the same at every trace
        if config.check_for_nan_in_grad:
            bad = _nonfinite(ct, b, layout)
        else:
            bad = jax.lax.pcast(jnp.zeros((len(b.slots),), jnp.float32), axis, to="varying")
        return red.astype(acc_dt), bad

    return sharded_gather(axis, reduce)


def make_leaf_gather(
    b: Bucket,
    layout: BucketLayout,
    config: DDPConfig,
    *,
    num_microbatches: int,
    deferred: bool,
    divisors: list[int],
) -> Callable[[tuple[jax.Array, ...], jax.Array, jax.Array], list[jax.Array]]:
    """The ZeRO-3 gather of an interleaved bucket ``b``, one ``all_gather`` per parameter.

    ``gather(pieces, acc, flags) -> leaves``: ``pieces`` are this rank's pieces of ``b``'s
    parameters (the leaves of the interleaved shard view, in ``b.slots`` order), ``leaves`` the
    full parameters, in the working dtype.

    Why per parameter: an interleaved bucket's gathered ``[dp, numel // dp]`` matrix holds every
    parameter in strided columns, so splitting it into leaves copies the whole bucket, and XLA
    keeps the gathered bucket alive next to those copies (it fuses some slices into their
    consumers). In the backward pass, packing the leaves' gradients into the bucket is a second
    copy that waits for every leaf. Gathering and reduce-scattering each parameter's piece on
    its own yields every leaf (and takes every gradient) as its own buffer, which dies after its
    last use. XLA's combiners merge the per-parameter collectives again into groups smaller than
    one bucket (:func:`jaxdp.combine_thresholds`), so the number of collectives stays about one
    per bucket. Compiled for 8 H100s (``bench/bench_memory_gpu.py``, a 4.2M-parameter MLP in
    5 buckets), this took stage 3 from 1.13x / 1.28x of its memory formula (G = 1 / 4) to
    0.89x / 1.10x.

    Backward: each leaf's gradient is cast to ``config.main_grads_dtype`` and reduce-scattered
    as :func:`make_bucket_gather` reduces a bucket (the same :func:`jaxdp._reduce._reduce_one`
    numerics, applied to the leaf's columns). The gradients are packed and reduced per bucket
    instead with ``reduce_scatter_with_fp32_accumulation`` or ``deterministic_reduction`` (one
    ``all_to_all``: XLA:GPU has no all-to-all combiner) and with an fp32 wire
    (``grad_reduce_in_fp32``), where per-parameter reduce-scatters saved no memory in the same
    compile (1.47x either way) and XLA left the first one without overlap. Cotangents: zero for
    ``pieces``, the reduced bucket shard for ``acc``, the non-finite flags for ``flags``.
    """
    axis = config.data_axis
    acc_dt = jnp.dtype(config.main_grads_dtype)
    if not gathers_per_parameter(layout):
        raise ValueError(
            f"make_leaf_gather: layout kind {layout.kind!r}"
            f"{' with stacked params' if layout.stacked else ''}; expected an interleaved "
            "layout without stacks (use make_bucket_gather or jaxdp._zero3_scan)."
        )
    slots = list(b.slots)
    reduce_per_leaf = not (
        config.reduce_scatter_with_fp32_accumulation
        or config.deterministic_reduction
        or jnp.dtype(b.grad_dtype).itemsize >= 4
    )

    @jax.custom_vjp
    def gather(pieces: tuple[jax.Array, ...], acc: jax.Array, flags: jax.Array) -> list[jax.Array]:
        del acc, flags
        return [
            layout._leaf_from_global(i, jax.lax.all_gather(x, axis, tiled=True))
            for i, x in zip(slots, pieces, strict=True)
        ]

    def fwd(pieces: Any, acc: jax.Array, flags: jax.Array) -> tuple[list[jax.Array], Any]:
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in pieces]
        return gather(pieces, acc, flags), shapes

    def bwd(shapes: Any, cts: list[jax.Array]) -> tuple[Any, jax.Array, jax.Array]:
        if reduce_per_leaf:
            parts, div = {}, 1
            for i, ct in zip(slots, cts, strict=True):
                flat = layout._leaf_to_global(i, ct, acc_dt)
                parts[i], div = _reduce_one(flat, b, layout, config, num_microbatches, deferred)
            red = layout._fill(b, parts, parts[slots[0]].dtype)
        else:
            leaves: list[Any] = [None] * len(layout.slots)
            for i, ct in zip(slots, cts, strict=True):
                leaves[i] = ct
            flat = layout._pack_interleaved(b, leaves, acc_dt)
            red, div = _reduce_one(flat, b, layout, config, num_microbatches, deferred)
        divisors.append(div)  # a static int, the same at every trace
        if config.check_for_nan_in_grad:
            bad = _nonfinite_flags(cts)
        else:
            bad = jax.lax.pcast(jnp.zeros((len(slots),), jnp.float32), axis, to="varying")
        zeros = tuple(
            jax.lax.pcast(jnp.zeros(s.shape, s.dtype), axis, to="varying") for s in shapes
        )
        return zeros, red.astype(acc_dt), bad

    gather.defvjp(fwd, bwd)
    return gather


def zero3_value_and_grad(
    parts: Callable[[Any, Any], Any],
    layout: BucketLayout,
    config: DDPConfig,
    *,
    num_microbatches: int,
) -> tuple[Callable[..., Any], list[int]]:
    """Value-and-grad of ``parts(params, mb)`` for params held as local bucket shards.

    Returns ``(vg, divisors)``: ``vg(accs, flags, view, mb) -> ((loss, aux), (d_accs,
    d_flags))`` where ``view`` is this rank's shard view of the working params
    (:meth:`BucketLayout.shard_view`, working dtype), ``accs`` and
    ``flags`` zeros per bucket (``main_grads_dtype[shard_numel]``, ``float32[len(slots)]``);
    ``d_accs`` are the reduced gradient shards and ``d_flags`` the non-finite flags. With
    ``num_microbatches > 1`` the reductions are deferred (unscaled sums, as at stage 2):
    :func:`jaxdp._reduce.finish_deferred` with ``divisors[-len(layout.buckets):]`` ends them.
    Interleaved layouts use :func:`make_leaf_gather` (collectives per parameter, combined by
    XLA), megatron layouts :func:`make_bucket_gather` (one collective per bucket).
    """
    divisors: list[int] = []
    # Interleaved layouts gather (and reduce-scatter) per parameter: see make_leaf_gather.
    per_leaf = gathers_per_parameter(layout)
    make = make_leaf_gather if per_leaf else make_bucket_gather
    gathers: list[Callable[..., Any]] = [
        make(
            b,
            layout,
            config,
            num_microbatches=num_microbatches,
            deferred=num_microbatches > 1,
            divisors=divisors,
        )
        for b in layout.buckets
    ]

    def loss(accs: Any, flags: Any, view: Any, mb: Any) -> Any:
        if per_leaf:  # the shard view's leaves are this rank's pieces of each parameter
            pieces = jax.tree_util.tree_leaves(view)
            leaves: list[Any] = [None] * len(layout.slots)
            for k in reversed(range(len(gathers))):  # forward order, as below
                b = layout.buckets[k]
                mine = tuple(pieces[i].astype(b.dtype) for i in b.slots)
                for i, leaf in zip(b.slots, gathers[k](mine, accs[k], flags[k]), strict=True):
                    leaves[i] = checkpoint_name(leaf, GATHERED)
            return parts(jax.tree_util.tree_unflatten(layout.treedef, leaves), mb)
        # The bucket shards are assembled from the shard view in here, not by the caller: a
        # concatenation is not saved for the backward pass (by any remat policy), so the
        # backward pass assembles them again instead of keeping a copy alive between the two.
        shards = layout.shard_unview(view)
        # Gather in forward order (bucket 0 holds the output end of the model, so the last
        # bucket's layers run first): the program order XLA's scheduler starts from.
        full = [None] * len(gathers)
        for i in reversed(range(len(gathers))):
            full[i] = checkpoint_name(gathers[i](shards[i], accs[i], flags[i]), GATHERED)
        return parts(layout.unpack(tuple(full)), mb)

    vg = jax.value_and_grad(
        jax.checkpoint(loss, policy=remat_policy_for(config)), argnums=(0, 1), has_aux=True
    )
    return vg, divisors
