"""Gradient-accumulation fusion: weight gradients that stay fp32 from the GEMM to the accumulator.

The obstacle is JAX's dtype rule for cotangents: a bf16 primal gets a bf16 cotangent, so with bf16
working params every micro-batch's weight gradient is rounded to bf16 before the engine adds it to
its fp32 accumulator. Megatron's ``wgrad_gemm_accum_fp32`` avoids that rounding by writing the
weight-gradient GEMM straight into the fp32 ``main_grad``. jaxdp gets the same numerics in three
steps, all inside the engine's per-device body (:func:`jaxdp._src.strategy.local.local_gradients`):

1. **Discovery.** One abstract forward trace (``jax.eval_shape``) of the loss under a discovery
   scope: every :mod:`jaxdp.nn` layer that can fuse reports its kernel, by module path (flax linen:
   ``scope.path``, which survives ``nn.scan``) or by the identity of the array it was handed
   (flax nnx). The engine maps these to leaves of the params pytree.
2. **fp32 primals for those kernels only.** The engine differentiates w.r.t. a params tree in which
   exactly the discovered kernels are upcast to fp32 (exact: every bf16 value is an fp32 value);
   all other leaves keep their working dtype, so layers that are not jaxdp's compute and
   differentiate exactly as before. Because the primal is fp32, its cotangent may be fp32.
3. **A matmul whose transpose keeps fp32.** Under the fused scope a jaxdp layer multiplies with
   :func:`fused_matmul`, a ``custom_vjp`` whose forward casts the fp32 kernel to the compute dtype
   (the forward is bit-for-bit the unfused one) and whose backward returns
   ``dot(x, dy, preferred_element_type=float32)`` from bf16 operands, unrounded. AD sums it over
   ``lax.scan`` iterations and repeated uses in fp32, and the engine's ``layout.pack(..., fp32)``
   adds it into the accumulator with no cast in between; XLA can fuse that add into the GEMM.

Outside the engine (``model.apply`` in an eval loop) or with ``gradient_accumulation_fusion=False``
no scope is active and the layers are flax's own code path. Layers that cannot fuse (a custom
``dot_general``, ``DenseGeneral`` with ``batch_dims``) keep the unfused path and lose nothing.
Pipeline-parallel deferral of the embedding weight gradient (Megatron's
``defer_embedding_wgrad_compute``) is out of scope.

Limits, all of which fall back to correct but unfused (or differently promoted) behaviour:

* a fused kernel that ``loss_fn`` also reads outside its jaxdp layer (e.g. a tied output
  projection written as ``x @ params["head"]["kernel"].T``) is fp32 there too: cast it to the
  working dtype at that use;
* linen kernels are matched by module path relative to the ``apply`` root, suffix-matched against
  the params tree; two models applied in one ``loss_fn`` whose jaxdp and non-jaxdp layers share
  a relative path would both be marked;
* nnx layers are matched by array identity, so ``nnx.scan``/``nnx.vmap``-ed ``Linear`` layers
  (which see slices) keep the unfused path; linen ``nn.scan`` fuses.
* linen ``nn.scan`` stacks are upcast once per step, ahead of the micro-batch loop, and the
  step carries that fp32 copy (:class:`Lift`): their layers cast a slice back to bf16 inside
  the model's loop, where XLA cannot cancel the pair. Compiled for compile-only GPUs, a
  scanned GPT at ``G = 4`` peaked higher fused than unfused and moved more gradient volumes
  (as ``bench/bench_traffic.py`` counts them, a loop's in-place update of a stack charged for
  the whole stack).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ..layout.layout import path_str

__all__ = ["Lift", "fused_matmul", "fused_value_and_grad", "fusion_dtype"]


@dataclasses.dataclass
class _Scope:
    discover: bool
    # discovery: what the layers reported (linen: module path -> the kernel's shape as the layer
    # saw it, a slice of the leaf inside nn.scan)
    paths: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    ids: set[int] = dataclasses.field(default_factory=set)
    # fused trace: kernel -> working dtype to compute in
    by_path: dict[str, Any] = dataclasses.field(default_factory=dict)
    by_id: dict[int, Any] = dataclasses.field(default_factory=dict)


SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("jaxdp_fusion", default=None)


@contextlib.contextmanager
def _scope(scope: _Scope) -> Iterator[_Scope]:
    token = SCOPE.set(scope)
    try:
        yield scope
    finally:
        SCOPE.reset(token)


def _match(leaf_path: str, paths: set[str] | dict[str, Any]) -> str | None:
    # Module paths are relative to the ``apply`` root, the leaf path to the params tree the
    # engine holds (which may wrap it, e.g. ``{"params": ...}``): exact first, then suffix.
    if leaf_path in paths:
        return leaf_path
    for p in sorted(paths):
        if leaf_path == p or leaf_path.endswith("/" + p):
            return p
    return None


def fusion_dtype(kernel: Any, path: tuple[str, ...] | None = None) -> Any:
    """The working dtype to compute in if this kernel's weight gradient is fused, else ``None``.

    Called by :mod:`jaxdp.nn` layers. ``path`` is the linen module path (``scope.path``); nnx
    layers pass ``None`` and are recognised by the identity of the array they were handed.
    Outside :func:`fused_value_and_grad` this is always ``None``.

    Example:
        >>> import jax.numpy as jnp
        >>> fusion_dtype(jnp.zeros((2, 2)), ("dense",)) is None
        True
    """
    scope = SCOPE.get()
    if scope is None:
        return None
    key = None if path is None else "/".join((*path, "kernel"))
    if scope.discover:
        if key is not None:
            scope.paths[key] = tuple(kernel.shape)
        else:
            scope.ids.add(id(kernel))
        return None
    if jnp.dtype(kernel.dtype) != jnp.float32:  # e.g. the loss_fn cast the params itself
        return None
    if key is not None and key in scope.by_path:
        return scope.by_path[key]
    return scope.by_id.get(id(kernel))


@dataclasses.dataclass(frozen=True)
class Lift:
    """Upcasts the fused kernels of a params tree to fp32 (exact), in two parts.

    ``within`` lifts the kernels a layer reads whole. Call it where the gradient is taken (in
    each micro-batch's own body): there the upcast and the layer's cast back to its working
    dtype meet in one computation, and XLA drops both (``convert(convert(w, f32), bf16)`` is
    ``w``). Lifted once ahead of a loop over micro-batches instead, the loop carried an fp32
    copy of every kernel and cast it back to bf16 each micro-batch.

    ``ahead`` lifts the kernels a layer reads a slice of (an ``nn.scan`` stack). Their casts
    back sit inside the model's own loop, where XLA cannot cancel them, so lifting them per
    micro-batch would only repeat the upcast: lift them once, ahead of the micro-batch loop.
    ``lift(p)`` is both."""

    ahead: Callable[[Any], Any]
    within: Callable[[Any], Any]

    def __call__(self, params: Any) -> Any:
        return self.within(self.ahead(params))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x: jax.Array, kernel: jax.Array, precision: Any) -> jax.Array:
    w = kernel.astype(x.dtype)
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)


def _matmul_fwd(x, kernel, precision):
    return _matmul(x, kernel, precision), (x, kernel)


def _matmul_bwd(precision, res, dy):
    x, kernel = res
    w = kernel.astype(x.dtype)
    dx = lax.dot_general(dy, w, (((dy.ndim - 1,), (1,)), ((), ())), precision=precision)
    x2 = x.reshape(-1, x.shape[-1])
    dy2 = dy.reshape(-1, dy.shape[-1])
    # The fused weight gradient: bf16 operands, fp32 result, never rounded.
    dw = lax.dot_general(
        x2, dy2, (((0,), (0,)), ((), ())), precision=precision, preferred_element_type=kernel.dtype
    )
    return dx.astype(x.dtype), dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def fused_matmul(x: jax.Array, kernel: jax.Array, precision: Any = None) -> jax.Array:
    """``x @ kernel`` computed in ``x.dtype``, whose kernel cotangent keeps ``kernel.dtype``.

    ``x`` (``[..., K]``) must already be in the compute dtype; ``kernel`` (``[K, N]``) is the fp32
    primal. The forward equals ``x @ kernel.astype(x.dtype)``; the backward returns
    ``dot(x, dy, preferred_element_type=kernel.dtype)`` for the kernel, with no rounding to
    ``x.dtype``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> x = jnp.ones((3, 2), jnp.bfloat16)
        >>> g = jax.grad(lambda w: fused_matmul(x, w).astype(jnp.float32).sum())
        >>> g(jnp.ones((2, 4), jnp.float32)).dtype
        dtype('float32')
    """
    if x.ndim < 1 or kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
        raise ValueError(
            f"fused_matmul: x has shape {x.shape} and kernel {kernel.shape}; expected x [..., K] "
            "and kernel [K, N]. Fix: reshape the kernel to 2-D (contracted dims first)."
        )
    return _matmul(x, kernel, precision)


def _leaf_dtype(x: Any) -> Any:
    return jnp.dtype(x.dtype)


def fused_value_and_grad(
    fun: Callable[..., Any], params: Any, example: Any, *, has_aux: bool = False
) -> tuple[Any, Callable[..., Any]]:
    """``jax.value_and_grad(fun)`` with jaxdp layers' weight gradients fused in fp32.

    Runs the discovery trace of ``fun(params, example)`` and returns ``(diff_params, vg)``:
    ``diff_params`` is ``params`` with the kernels of fusing :mod:`jaxdp.nn` layers upcast to
    fp32 (other leaves unchanged) and ``vg(diff_params, batch)`` is the value-and-grad function
    to call with it. Gradients of the fused kernels are fp32, the others keep their dtype.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jaxdp import nn
        >>> layer = nn.Dense(3, dtype=jnp.bfloat16)
        >>> p = jax.tree.map(lambda a: a.astype(jnp.bfloat16),
        ...                  layer.init(jax.random.key(0), jnp.ones((1, 4)))["params"])
        >>> def loss(p, x):
        ...     return layer.apply({"params": p}, x).astype(jnp.float32).sum()
        >>> diff, vg = fused_value_and_grad(loss, p, jnp.ones((2, 4)))
        >>> _, g = vg(diff, jnp.ones((2, 4)))
        >>> str(g["kernel"].dtype), str(g["bias"].dtype)
        ('float32', 'bfloat16')
    """
    lift, scoped = fused_function(fun, params, example)
    return lift(params), jax.value_and_grad(scoped, has_aux=has_aux)


def fused_function(fun: Callable[..., Any], params: Any, example: Any) -> tuple[Lift, Any]:
    """``(lift, scoped)``: ``lift(params)`` is :func:`fused_value_and_grad`'s ``diff_params``
    (the fused kernels upcast to fp32; :class:`Lift` says where to call its parts) and
    ``scoped`` the function it differentiates, ``scoped(lift(params), batch) == fun(params,
    batch)`` with the fused kernels computing in their working dtype. Evaluate ``fun`` on lifted
    params only through ``scoped``: outside it a fused layer sees an fp32 kernel and computes in
    fp32 (which, in an ``nn.scan`` body, changes the carry's dtype)."""
    kps, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves = [v for _, v in kps]
    paths = [path_str(k) for k, _ in kps]

    found = _Scope(discover=True)
    index_of: dict[int, int] = {}

    def probe(p: Any, batch: Any) -> Any:
        for i, leaf in enumerate(jax.tree_util.tree_leaves(p)):
            index_of[id(leaf)] = i
        with _scope(found):
            return fun(p, batch)

    jax.eval_shape(probe, params, example)
    keys = [_match(path, found.paths) for path in paths]  # the layer path each leaf matched
    reported = {index_of.get(j) for j in found.ids}
    marked = {
        i
        for i, leaf in enumerate(leaves)
        if jnp.issubdtype(_leaf_dtype(leaf), jnp.floating)
        and _leaf_dtype(leaf).itemsize <= 4
        and getattr(leaf, "ndim", 0) >= 2
        and (keys[i] is not None or i in reported)
    }
    work = {i: _leaf_dtype(leaves[i]) for i in marked}

    # kernels a layer saw a slice of (nn.scan stacks): lifted ahead of the micro-batch loop
    sliced = {
        i
        for i in marked
        if (key := keys[i]) is not None and found.paths[key] != tuple(leaves[i].shape)
    }

    def lifting(which: set[int]) -> Callable[[Any], Any]:
        def lift(p: Any) -> Any:
            flat = jax.tree_util.tree_leaves(p)
            return jax.tree_util.tree_unflatten(
                treedef, [x.astype(jnp.float32) if i in which else x for i, x in enumerate(flat)]
            )

        return lift

    by_path = {key: work[i] for i in marked if (key := keys[i]) is not None}

    def wrapped(p: Any, batch: Any) -> Any:
        scope = _Scope(discover=False, by_path=by_path)
        flat = jax.tree_util.tree_leaves(p)
        scope.by_id = {id(flat[i]): work[i] for i in marked}
        with _scope(scope):
            return fun(p, batch)

    return Lift(ahead=lifting(sliced), within=lifting(marked - sliced)), wrapped
