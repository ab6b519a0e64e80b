"""Stage 3's rematerialisation: which intermediates the backward pass keeps.

ZeRO-3 wraps the user's loss in ``jax.checkpoint`` so the gathered params are not kept alive
between the forward and backward pass (they are gathered again). ``remat_policy``
picks what else is saved; :func:`remat_policy_for` is the one place that maps the field to a
policy, and every policy refuses the gathered params (named :data:`GATHERED`) and what layout
primitives derive from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax

__all__ = [
    "DOT_OPERAND",
    "GATHERED",
    "SCAN_CARRY",
    "dots_policy",
    "gemm_policy",
    "not_gathered_policy",
    "remat_policy_for",
]

#: ``checkpoint_name`` of the gathered params at stage 3 (never saved as a residual).
GATHERED = "jaxdp_gathered_params"
#: ``checkpoint_name`` of each iteration's carry output in a scan whose layer stack is gathered
#: per layer (the next layer's input; MaxText names it ``decoder_layer_input``). Saved by
#: every policy but ``"nothing"``: jax applies the outer ``jax.checkpoint``'s policy inside the
#: scan bodies, and without it the backward pass runs the forward loop, gathers included,
#: once more to recompute the layer inputs.
SCAN_CARRY = "jaxdp_scan_carry"
#: ``checkpoint_name`` of each operand of a batched ``dot_general`` that is not a param (XLA's
#: attention: queries, keys, softmax probabilities, values), given by
#: :func:`jaxdp._src.zero3.dot_operands.name_batched_dot_operands`. Saved by ``"gemm"`` and
# ``"dots"``.
DOT_OPERAND = "jaxdp_dot_operand"

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


def gemm_policy(prim: Any, *args: Any, **params: Any) -> bool:
    """``remat_policy="gemm"``: save the outputs of ``dot_general`` without batch dimensions
    (jax's ``dots_with_no_batch_dims_saveable``: dense layers and projections) and of batched
    ``dot_general`` no larger than their larger operand (XLA's attention's context, probabilities
    x values; not its scores, queries x keys, which grow with the square of the sequence), of
    cuDNN fused attention (its output and softmax statistics), the operands of batched dots
    where stage 3 named them (:data:`DOT_OPERAND`: XLA's attention's queries, keys, softmax
    probabilities and values, instead of rebuilding them from the projections' outputs) and the
    layer inputs of gathered scans (:data:`SCAN_CARRY`). Norms and activations are recomputed.
    Gathered params and their layout derivatives are never among these, so they are recomputed
    (gathered again).

    Example (attention's context, probabilities [b, q, k] x values [b, k, d], is saved; its
    scores, queries [b, q, d] x keys [b, k, d], are not):
        >>> import jax, jax.numpy as jnp
        >>> def spec(*shape):
        ...     return jax.ShapeDtypeStruct(shape, jnp.bfloat16)
        >>> def saves(lhs, rhs, contract):
        ...     dims = (contract, ((0,), (0,)))
        ...     return gemm_policy(jax.lax.dot_general_p, lhs, rhs, dimension_numbers=dims)
        >>> saves(spec(8, 1024, 1024), spec(8, 1024, 64), ((2,), (1,)))
        True
        >>> saves(spec(8, 1024, 64), spec(8, 1024, 64), ((2,), (2,)))
        False
    """
    return _saves(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, prim, args, params
    ) or _no_larger_batched_dot(prim, args, params)


def _no_larger_batched_dot(prim: Any, args: Any, params: Any) -> bool:
    """A batched ``dot_general`` whose output has no more elements than its larger operand:
    saving it costs no more than an operand (attention's context), where a product that grows
    past both (attention's scores, queries x keys) is left to the recompute."""
    if prim.name != "dot_general" or len(args) != 2:
        return False
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if not lb:
        return False
    lhs, rhs = (tuple(a.shape) for a in args)
    out = math.prod(lhs[d] for d in lb)
    out *= math.prod(n for i, n in enumerate(lhs) if i not in lc and i not in lb)
    out *= math.prod(n for i, n in enumerate(rhs) if i not in rc and i not in rb)
    return out <= max(math.prod(lhs), math.prod(rhs))


def dots_policy(prim: Any, *args: Any, **params: Any) -> bool:
    """``remat_policy="dots"``: what ``"gemm"`` saves, plus batched ``dot_general`` outputs
    (XLA's attention scores and context) and convolutions (jax's ``dots_saveable`` plus fused
    attention, the operands of batched dots, :data:`DOT_OPERAND`, and the layer inputs of
    gathered scans, :data:`SCAN_CARRY`)."""
    return _saves(jax.checkpoint_policies.dots_saveable, prim, args, params)


def _saves(dots: Callable[..., bool], prim: Any, args: Any, params: Any) -> bool:
    """``"gemm"`` and ``"dots"``: the scan carries, the operands of batched dots
    (:data:`DOT_OPERAND`), cuDNN fused attention, and what ``dots`` (a jax policy for
    ``dot_general``) saves."""
    if prim.name == "name":
        return params.get("name") in (SCAN_CARRY, DOT_OPERAND)
    if prim.name in _FUSED_ATTENTION:
        return True
    return bool(dots(prim, *args, **params))


_POLICIES: dict[str, Callable[..., bool]] = {
    "gemm": gemm_policy,
    "dots": dots_policy,
    "everything": not_gathered_policy,
    "nothing": jax.checkpoint_policies.nothing_saveable,
}


def remat_policy_for(name: str) -> Callable[..., bool]:
    """The ``jax.checkpoint`` policy of stage 3 named ``name`` (``remat_policy``).

    The one place that maps the field to a policy: the plan hands the policy to
    :func:`jaxdp._src.zero3.gather.zero3_value_and_grad` and
    :func:`jaxdp._src.zero3.scan.zero3_scan_value_and_grad` (outer loss and scan bodies).
    Every policy refuses the gathered params (named :data:`GATHERED`) and what layout
    primitives derive from them, so the backward pass gathers them again.

    Example:
        >>> remat_policy_for("gemm") is gemm_policy
        True
    """
    return _POLICIES[name]
