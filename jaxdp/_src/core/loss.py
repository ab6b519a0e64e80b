"""The loss contract: how the engine calls ``loss_fn`` and reads what it returns.

``loss_fn(params, microbatch)`` is called once per micro-batch on each rank. When
:meth:`jaxdp.DataParallel.init` got a ``model_state`` it is also passed
``model_state=<this rank's current state>``; when it got an ``rng``,
``rng=<this micro-batch's key>`` (:class:`LossCall` records which). It may return

* a scalar loss (the mean over the micro-batch);
* ``(loss, aux)``: ``aux`` is averaged over micro-batches and ranks into ``metrics["aux"]``;
* ``(loss_sum, num_tokens)`` with ``calculate_per_token_loss``;
* a :class:`LossOutput`, which names the parts and is the only way to return an updated
  ``model_state``.

Everything is checked while the step is traced (before XLA compiles anything), with errors
that name the output, its shape and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "LossCall",
    "LossOutput",
    "check_init_inputs",
    "loss_parts",
    "plain_loss",
    "unbound_axis",
    "UnboundAxis",
    "unbound_axis_name",
    "warn_per_example_aux",
]


class LossOutput(NamedTuple):
    """What a ``loss_fn`` may return, by name (a NamedTuple; every part but ``loss`` optional).

    Attributes:
        loss: the scalar loss of the micro-batch: its mean, or with
            ``calculate_per_token_loss`` the *sum* of the per-token losses.
        aux: any pytree of metrics; ``metrics["aux"]`` is its mean over micro-batches and
            ranks (elementwise, in fp32). Per-example values (leading dimension = the
            micro-batch's) are legal but mixed across ranks by that mean, and warned about.
        model_state: the updated non-trainable state (BatchNorm statistics...). Required when
            ``DataParallel.init`` got a ``model_state``; must have its structure and shapes.
        num_tokens: the micro-batch's token count (``calculate_per_token_loss`` only).

    Example:
        >>> import jax.numpy as jnp
        >>> out = LossOutput(jnp.float32(0.5), aux={"acc": jnp.float32(1.0)})
        >>> out.model_state is None, float(out.loss)
        (True, 0.5)
    """

    loss: Any
    aux: Any = None
    model_state: Any = None
    num_tokens: Any = None


@dataclasses.dataclass(frozen=True)
class LossCall:
    """Which keywords the engine passes ``loss_fn`` (decided once, in ``init``).

    A micro-batch handed to :func:`loss_parts` is the user's micro-batch when neither is set,
    and ``(microbatch, model_state, key)`` otherwise (the unused parts ``None``).
    """

    model_state: bool = False
    rng: bool = False

    @property
    def extended(self) -> bool:
        return self.model_state or self.rng

    def bind(self, mb: Any, model_state: Any, key: Any) -> Any:
        """What the kernels pass as the micro-batch (see the class docstring)."""
        return (mb, model_state, key) if self.extended else mb

    def split(self, mb: Any) -> tuple[Any, dict[str, Any]]:
        """``(user micro-batch, keyword arguments)`` of a bound micro-batch."""
        if not self.extended:
            return mb, {}
        batch, model_state, key = mb
        kw: dict[str, Any] = {}
        if self.model_state:
            # A fresh tree, made in the caller's trace: flax nnx refuses to update Variables
            # made in an outer one (the step's scan or shard_map, outside value_and_grad).
            kw["model_state"] = jax.tree.map(lambda x: x, model_state)
        if self.rng:
            kw["rng"] = key
        return batch, kw


def loss_parts(
    loss_fn: Callable[..., Any],
    per_token: bool,
    params: Any,
    mb: Any,
    call: LossCall = LossCall(),
) -> tuple[jax.Array, tuple[Any, Any, Any]]:
    """``loss_fn``'s output as ``(loss, (num_tokens, aux, model_state))``, validated.

    ``per_token``: the engine's ``calculate_per_token_loss``. ``num_tokens`` is the
    micro-batch's token count with it (and a
    zero otherwise); ``aux`` the aux pytree or ``None``; ``model_state`` the updated state
    (``None`` unless ``call.model_state``).
    """
    batch, kw = call.split(mb)
    out = loss_fn(params, batch, **kw)
    if isinstance(out, LossOutput):
        loss, aux, new_state, ntok = out
        if per_token and ntok is None:
            raise ValueError(
                "DataParallel: with calculate_per_token_loss=True, loss_fn returned a "
                "LossOutput without num_tokens. Fix: LossOutput(loss=loss_sum, "
                "num_tokens=jnp.sum(mask), ...)."
            )
        if not per_token and ntok is not None:
            raise ValueError(
                "DataParallel: loss_fn returned LossOutput(num_tokens=...) but "
                "calculate_per_token_loss is False, so the loss is taken as a mean and the "
                "count would be ignored. Fix: calculate_per_token_loss=True in the config and "
                "return the loss sum, or drop num_tokens."
            )
    elif per_token:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(
                "DataParallel: with calculate_per_token_loss=True, loss_fn must return "
                f"(loss_sum, num_tokens) or a LossOutput; got {type(out).__name__}."
            )
        (loss, ntok), aux, new_state = out, None, None
    elif isinstance(out, tuple):
        if len(out) != 2:
            raise ValueError(
                "DataParallel: loss_fn must return loss or (loss, aux); got a tuple of "
                f"{len(out)}. Fix: return one of those, or name the parts with "
                "jaxdp.LossOutput(loss, aux=..., model_state=..., num_tokens=...)."
            )
        (loss, aux), ntok, new_state = out, None, None
    else:
        loss, aux, ntok, new_state = out, None, None, None
    if per_token:
        fix = (
            "return (loss_sum, num_tokens) for the micro-batch, both scalars: the sum of the "
            "per-token losses (e.g. jnp.sum(token_loss * mask)) and the token count "
            "(e.g. jnp.sum(mask))"
        )
        _check_scalar("loss_sum", loss, batch, fix, floating=True)
        _check_scalar("num_tokens", ntok, batch, fix, floating=False)
        tokens = jnp.asarray(ntok, jnp.float32)
    else:
        what = "loss" if aux is None else "loss (the first of (loss, aux))"
        fix = "return the mean over the micro-batch, e.g. jnp.mean(per_example_loss)"
        _check_scalar(what, loss, batch, fix, floating=True)
        tokens = jnp.zeros((), jnp.float32)
    state = _check_model_state(new_state, kw.get("model_state"), call)
    return loss, (tokens, aux, state)


def _check_model_state(new: Any, old: Any, call: LossCall) -> Any:
    """The updated model_state, checked against the one ``loss_fn`` was given (dtypes kept)."""
    if not call.model_state:
        if new is not None:
            raise ValueError(
                "DataParallel: loss_fn returned LossOutput(model_state=...) but init got no "
                "model_state, so there is nowhere to keep it. Fix: "
                "dp.init(params, model_state=initial_state) (e.g. variables['batch_stats'])."
            )
        return None
    if new is None:
        raise ValueError(
            "DataParallel: init got a model_state, so loss_fn must return the updated one: "
            "return jaxdp.LossOutput(loss, model_state=new_state) (with linen: "
            "model.apply({'params': p, **model_state}, x, mutable=list(model_state)) returns "
            "(y, new_state); a model that leaves it unchanged returns the model_state it got)."
        )
    want, got = jax.tree.structure(old), jax.tree.structure(new)
    if not want == got:  # type: ignore[operator]
        raise ValueError(
            "DataParallel: loss_fn returned a model_state whose tree structure differs from "
            f"the one it was given: {got} vs {want}. Fix: return every collection it was "
            "given (e.g. mutable=list(model_state) in linen's apply)."
        )
    out = []
    paths = jax.tree_util.tree_flatten_with_path(old)[0]
    for (kp, o), n in zip(paths, jax.tree.leaves(new), strict=True):
        if tuple(jnp.shape(n)) != tuple(o.shape):
            raise ValueError(
                f"DataParallel: loss_fn returned model_state leaf {jax.tree_util.keystr(kp)} "
                f"with shape {tuple(jnp.shape(n))}; it was given shape {tuple(o.shape)}. Fix: "
                "keep the state's shapes (per-example values belong in aux)."
            )
        out.append(jnp.asarray(n).astype(o.dtype))
    return jax.tree.unflatten(want, out)


def warn_per_example_aux(aux: Any, mb: Any) -> None:
    """Warn once per trace when an aux leaf leads with the micro-batch's size: per-example
    values, which the elementwise mean over ranks (and micro-batches) silently mixes."""
    leaves = jax.tree.leaves(mb)
    if not leaves or not getattr(leaves[0], "ndim", 0):
        return
    n = leaves[0].shape[0]
    if n <= 1:
        return
    paths = [
        jax.tree_util.keystr(kp) or "<aux>"
        for kp, a in jax.tree_util.tree_flatten_with_path(aux)[0]
        if len(a.shape) and a.shape[0] == n
    ]
    if paths:
        warnings.warn(
            f"DataParallel: aux leaves {', '.join(paths)} lead with the micro-batch size {n}; "
            "metrics['aux'] is the elementwise mean over ranks and micro-batches, which mixes "
            "different examples' values. Fix: reduce them in loss_fn (e.g. jnp.mean(acc)), or "
            "keep them if an elementwise mean is what you want.",
            UserWarning,
            stacklevel=2,
        )


def _check_scalar(what: str, x: Any, mb: Any, fix: str, *, floating: bool) -> None:
    """Raise if ``loss_fn``'s output ``x`` is not a scalar (a floating one if ``floating``).

    Runs while the step is traced, before XLA compiles anything (once per compilation, nothing
    per step), on the shapes ``loss_fn`` really sees: JAX's "Gradient only defined for
    scalar-output functions" and "grad requires real-valued outputs" become the output's name,
    shape and dtype and the fix.
    """
    if isinstance(x, (bool, int, float)):
        shape, dtype = (), np.result_type(type(x))
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        shape, dtype = tuple(x.shape), x.dtype
    else:
        raise TypeError(
            f"DataParallel: loss_fn returned a {type(x).__name__} as its {what} for one "
            f"micro-batch; expected a scalar array. Fix: {fix}."
        )
    not_float = floating and not jnp.issubdtype(dtype, jnp.floating)
    if shape == () and not not_float:
        return
    leaves = jax.tree.leaves(mb)
    size = leaves[0].shape[0] if leaves and leaves[0].ndim else "?"
    expected = "a floating-point scalar (gradients need a real float output)"
    if not not_float:
        expected = "a scalar"
    cast = ", in floating point (e.g. .astype(jnp.float32))" if not_float else ""
    raise ValueError(
        f"DataParallel: loss_fn returned a {what} of shape {shape} and dtype "
        f"{getattr(dtype, 'name', dtype)} for one micro-batch of {size} examples (on each "
        f"device); expected {expected}. Fix: {fix}{cast}."
    )


def check_init_inputs(model_state: Any, rng: Any) -> tuple[Any, Any, LossCall]:
    """``DataParallel.init``'s ``model_state`` and ``rng``, checked and converted (raw
    ``uint32`` keys become typed keys), and the :class:`LossCall` they imply."""
    if rng is not None:
        dt = getattr(rng, "dtype", None)
        typed = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        if not typed and dt is not None and np.dtype(dt) == np.uint32 and np.shape(rng) == (2,):
            rng = jax.random.wrap_key_data(rng)  # a legacy jax.random.PRNGKey(seed)
            typed = True
        if not typed or np.shape(rng) != ():
            raise TypeError(
                f"DataParallel.init: rng is a {type(rng).__name__} of shape "
                f"{getattr(rng, 'shape', '?')} and dtype {dt}; expected one typed PRNG key "
                "(shape ()). Fix: rng=jax.random.key(seed)."
            )
    if model_state is not None:
        bad = [
            (jax.tree_util.keystr(kp), type(x).__name__)
            for kp, x in jax.tree_util.tree_flatten_with_path(model_state)[0]
            if not (hasattr(x, "shape") and hasattr(x, "dtype"))
            and not isinstance(x, (int, float, bool, np.generic))
        ]
        if bad:
            raise TypeError(
                f"DataParallel.init: model_state leaf {bad[0][0]} is a {bad[0][1]}; expected a "
                "pytree of arrays (e.g. linen's variables['batch_stats'], or the state of "
                "nnx.split(model, nnx.Param, ...)). Fix: pass only the array collections."
            )
        keys = [
            jax.tree_util.keystr(kp)
            for kp, x in jax.tree_util.tree_flatten_with_path(model_state)[0]
            if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)
        ]
        if keys:
            raise TypeError(
                f"DataParallel.init: model_state leaf {keys[0]} is a PRNG key; the model state "
                "is averaged or broadcast over the ranks every step, which keys are not. Fix: "
                "pass rng=jax.random.key(seed) to init and use the key loss_fn gets (nnx: "
                "build Dropout without rngs and call it with rngs=rng, or split nnx.RngState "
                "out of the state: nnx.split(model, nnx.Param, nnx.RngState, ...))."
            )
        model_state = jax.tree.map(jnp.asarray, model_state)
    return model_state, rng, LossCall(model_state is not None, rng is not None)


def plain_loss(
    loss_fn: Callable[..., Any], call: LossCall, model_state: Any
) -> Callable[[Any, Any], Any]:
    """``loss_fn`` as ``f(params, batch)`` (zeros for the model state, a fixed key), for
    tracing it where only shapes matter (finding scanned layer stacks)."""
    if not call.extended:
        return loss_fn
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), model_state)

    def f(params: Any, batch: Any) -> Any:
        state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract)
        key = jax.random.key(0) if call.rng else None
        return loss_fn(params, batch, **call.split(call.bind(batch, state, key))[1])

    return f


# jax's NameError for a collective over an axis name nothing binds ("Found an unbound axis name:
# batch. To fix this, ..." from psum and friends, "unbound axis name: batch" from all_gather).
_UNBOUND = re.compile(r"unbound axis name: (\S+?)\.?(?:\s|$)")


def unbound_axis(
    loss_fn: Callable[..., Any],
    call: LossCall,
    params: Any,
    batch: Any,
    model_state: Any,
    rng: Any,
    axes: dict[str, int],
    num_microbatches: int,
) -> str | None:
    """The axis name a collective in ``loss_fn`` uses that the step does not bind, or ``None``.

    A shape-only trace of ``loss_fn`` on one micro-batch per rank under ``jax.vmap`` over
    ``axes`` (``{name: size}``, the names the step's ``shard_map`` binds). Inside the step a
    collective over another name (flax's ImageNet ResNet has ``nn.BatchNorm(axis_name="batch")``)
    fails as a bare ``AssertionError`` from jax's varying-axes check, which names nothing; this
    trace turns it into jax's ``NameError``, which names the axis. Any other failure of the
    trace is not this one, and gives ``None`` (the step's own error is then the one to show).
    ``params``, ``batch`` (global), ``model_state`` and ``rng`` may be ``ShapeDtypeStruct``.
    """
    sizes = tuple(axes.values())
    per = math.prod(sizes) * num_microbatches

    def abstract(x: Any) -> Any:
        shape = tuple(jnp.shape(x))
        dt = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
        if not jax.dtypes.issubdtype(dt, jax.dtypes.prng_key):
            dt = jax.dtypes.canonicalize_dtype(dt)
        return jax.ShapeDtypeStruct((*sizes, shape[0] // per, *shape[1:]), dt)

    def one(p: Any, mb: Any, ms: Any, key: Any) -> Any:
        b, kw = call.split(call.bind(mb, ms, key))
        return loss_fn(p, b, **kw)

    def ranks(p: Any, b: Any, ms: Any, key: Any) -> Any:
        f = lambda mb: one(p, mb, ms, key)  # noqa: E731
        for name in reversed(tuple(axes)):
            f = jax.vmap(f, axis_name=name)
        return f(b)

    try:
        jax.eval_shape(ranks, params, jax.tree.map(abstract, batch), model_state, rng)
    except NameError as e:
        return unbound_axis_name(e)
    except Exception:  # not an unbound axis: the step reports its own error
        return None
    return None


def unbound_axis_name(err: BaseException) -> str | None:
    """The axis name in jax's ``NameError`` for a collective over an unbound axis, or ``None``."""
    m = _UNBOUND.search(str(err)) if isinstance(err, NameError) else None
    return m.group(1) if m else None


class UnboundAxis(Exception):
    """``loss_fn`` runs a collective over the axis ``name`` where the step binds only ``bound``
    (raised below the plan; the plan and the engine turn it into the user's ``ValueError``)."""

    def __init__(self, name: str, bound: tuple[str, ...]):
        super().__init__(f"loss_fn uses the unbound axis {name!r}; bound: {bound}")
        self.name, self.bound = name, bound
