"""Recognise optax optimizers that are known to give the same result on sharded parameters.

:func:`jaxdp._src.optim.check.check_optimizer` proves an optimizer safe for the distributed
optimizer by tracing ``init`` and one step twice (whole and sharded probe tensors), which costs
what tracing the optimizer costs: 0.3 s at 100 parameters and 3.3 s at 1,000 on a 2-core CPU,
a fifth of a plain ``jit`` step's whole compile. The optimizers most people use are built from a
handful of optax transformations that are elementwise, or use whole-tensor norms that the
zero padding leaves unchanged, and whose settings are plain numbers. :func:`known_elementwise`
recognises them from the optax functions they are made of and their closed-over settings, with
no tracing; anything it does not recognise (a callable mask, a user's own transformation,
factored Adafactor, a wrapper it does not list) is probed as before.

The recognition walks the closures of ``init`` and ``update``: every function must be one of
:data:`_KNOWN` (optax's own, by module and qualified name) and every closed-over value a plain
setting (number, string, dtype, ``None``), a function or transformation that is itself known,
a tuple of them, a mask given as a pytree with the params' structure, or a learning-rate
schedule (called with the step count only, it never sees a parameter).

>>> import optax
>>> known_elementwise(optax.adamw(1e-3), None)
True
>>> import jax
>>> known_elementwise(optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)), None)
False
"""

from __future__ import annotations

import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from optax._src import transform as _transform

__all__ = ["MOMENT_STATES", "known_elementwise", "map_moments", "moment_roles", "state_names"]

# Factories whose functions (``<factory>.<locals>.init_fn`` / ``update_fn`` / helpers) treat
# every element alike, or reduce whole tensors to norms (clipping, LAMB's trust ratio), keyed by
# their module. Plumbing (chain, the extra-args wrapper, masks) is listed with them.
_KNOWN: dict[str, frozenset[str]] = {
    "optax._src.base": frozenset({"with_extra_args_support", "init_empty_state", "identity"}),
    "optax.transforms._combining": frozenset({"chain"}),
    "optax.transforms._masking": frozenset({"masked"}),
    "optax.transforms._adding": frozenset({"add_decayed_weights"}),
    "optax.transforms._accumulation": frozenset({"trace"}),
    "optax.transforms._clipping": frozenset({"clip", "clip_by_global_norm"}),
    "optax._src.transform": frozenset(
        {
            "scale",
            "scale_by_adam",
            "scale_by_amsgrad",
            "scale_by_belief",
            "scale_by_lion",
            "scale_by_rms",
            "scale_by_stddev",
            "scale_by_trust_ratio",
            "scale_by_schedule",
            "scale_by_learning_rate",
        }
    ),
}
# Schedules, functions of the step count alone: any function in these closure slots, and
# optax's own schedules wherever they appear (not ``optax.schedules._inject``, whose
# ``inject_hyperparams`` wraps a whole optimizer).
_SCHEDULE_SLOTS = frozenset({"learning_rate", "step_size_fn"})
_SCHEDULE_MODULES = frozenset({"optax.schedules._schedule", "optax.schedules._join"})


def _known_function(fn: types.FunctionType) -> bool:
    module = fn.__module__ or ""
    if module in _SCHEDULE_MODULES:
        return True
    factory = fn.__qualname__.split(".<locals>.", 1)[0]
    return factory in _KNOWN.get(module, frozenset())


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, np.dtype, np.generic)):
        return True
    if isinstance(value, type):  # a dtype given as np.float32
        return issubclass(value, np.generic)
    if not hasattr(value, "dtype"):
        return False
    # a dtype given as jnp.float32 (no shape), or a scalar array
    return getattr(value, "shape", ()) == ()


class _Walk:
    def __init__(self, treedef: Any) -> None:
        self.treedef = treedef
        self.seen: set[int] = set()

    def value(self, name: str, value: Any) -> bool:
        if name == "mask" and not callable(value):  # a pytree of bools, built from the params
            return self.treedef is not None and jax.tree.structure(value) == self.treedef
        if _plain(value):
            return True
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return all(self.value(name, v) for v in value)
        if hasattr(value, "init") and hasattr(value, "update"):  # a GradientTransformation
            return self.function(value.init) and self.function(value.update)
        if isinstance(value, types.FunctionType):
            return name in _SCHEDULE_SLOTS or self.function(value)
        return False

    def function(self, fn: Any) -> bool:
        if not isinstance(fn, types.FunctionType) or not _known_function(fn):
            return False
        if id(fn) in self.seen:
            return True
        self.seen.add(id(fn))
        cells = fn.__closure__ or ()
        for name, cell in zip(fn.__code__.co_freevars, cells, strict=True):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: a helper defined later in the factory
                continue
            if not self.value(name, value):
                return False
        return True


def known_elementwise(optimizer: Any, treedef: Any) -> bool:
    """Whether ``optimizer`` is made only of optax transformations known to give the same
    result on zero-padded, flattened parameters, with plain settings (module docstring).

    ``treedef``: the params' tree structure, which a mask given as a pytree must have (``None``
    accepts no pytree mask). ``False`` means "not known", not "unsafe": the caller probes it.
    """
    walk = _Walk(treedef)
    return walk.function(getattr(optimizer, "init", None)) and walk.function(
        getattr(optimizer, "update", None)
    )


# ------------------------------------------------------------------ Adam's moments
#: The optax states whose leaves are Adam's moments, by state class: field -> role, in
#: Megatron's names (``exp_avg`` the first moment, ``exp_avg_sq`` the second). Keyed by the
#: state class rather than by the transformation, so that what wraps a transformation (chain,
#: masked, inject_hyperparams, MultiSteps...) is seen through. Every optax transformation that
#: returns one of these states keeps its moments in them; casting them is safe for the update
#: because :func:`map_moments` is applied both ways around it (stored narrow, computed wide).
MOMENT_STATES: dict[type, dict[str, str]] = {
    # adam, adamw, nadam, nadamw, lamb, radam, adamax, yogi
    _transform.ScaleByAdamState: {"mu": "exp_avg", "nu": "exp_avg_sq"},
    # amsgrad: its running maximum of nu is a second moment too
    _transform.ScaleByAmsgradState: {"mu": "exp_avg", "nu": "exp_avg_sq", "nu_max": "exp_avg_sq"},
    # adabelief: nu is the second moment of (g - mu)
    _transform.ScaleByBeliefState: {"mu": "exp_avg", "nu": "exp_avg_sq"},
    # lion: one moment
    _transform.ScaleByLionState: {"mu": "exp_avg"},
}


def _is_moment_state(x: Any) -> bool:
    return type(x) in MOMENT_STATES


def _floating(x: Any) -> bool:
    return bool(jnp.issubdtype(x.dtype, jnp.floating))


def moment_roles(opt_state: Any) -> set[str]:
    """The roles (``"exp_avg"``, ``"exp_avg_sq"``) of the moments an (abstract) optax state
    holds (:data:`MOMENT_STATES`).

    >>> import jax, jax.numpy as jnp, optax
    >>> p = {"w": jnp.zeros(3)}
    >>> sorted(moment_roles(jax.eval_shape(optax.adamw(1e-3).init, p)))
    ['exp_avg', 'exp_avg_sq']
    >>> sorted(moment_roles(jax.eval_shape(optax.lion(1e-3).init, p)))
    ['exp_avg']
    >>> moment_roles(jax.eval_shape(optax.sgd(1e-3, momentum=0.9).init, p))
    set()
    """
    found: set[str] = set()

    def visit(x: Any) -> Any:
        for name, role in MOMENT_STATES.get(type(x), {}).items():
            if any(_floating(v) for v in jax.tree.leaves(getattr(x, name))):
                found.add(role)
        return x

    jax.tree.map(visit, opt_state, is_leaf=_is_moment_state)
    return found


def map_moments(opt_state: Any, dtypes: dict[str, Any]) -> Any:
    """``opt_state`` with every floating moment leaf of role ``r`` cast to ``dtypes[r]`` (roles
    not in ``dtypes``, and every other leaf, unchanged). Works on arrays and tracers.

    >>> import jax.numpy as jnp, optax
    >>> s = map_moments(optax.adam(1e-3).init({"w": jnp.zeros(3)}), {"exp_avg_sq": jnp.bfloat16})
    >>> s[0].mu["w"].dtype, s[0].nu["w"].dtype
    (dtype('float32'), dtype(bfloat16))
    """

    def cast(x: Any, dtype: Any) -> Any:
        return x.astype(dtype) if _floating(x) and x.dtype != dtype else x

    def visit(x: Any) -> Any:
        fields = MOMENT_STATES.get(type(x))
        if fields is None:
            return x
        changes = {
            name: jax.tree.map(lambda v, d=dtypes[role]: cast(v, d), getattr(x, name))
            for name, role in fields.items()
            if role in dtypes
        }
        return x._replace(**changes)

    return jax.tree.map(visit, opt_state, is_leaf=_is_moment_state)


def state_names(opt_state: Any) -> list[str]:
    """The class names of the NamedTuple states in ``opt_state``, in order, for messages.

    >>> import jax.numpy as jnp, optax
    >>> state_names(optax.sgd(0.1, momentum=0.9).init({"w": jnp.zeros(2)}))
    ['TraceState', 'EmptyState']
    """
    names: list[str] = []

    def named(x: Any) -> bool:
        return isinstance(x, tuple) and hasattr(x, "_fields")

    def visit(x: Any) -> Any:
        if named(x):
            if type(x).__name__ not in names:
                names.append(type(x).__name__)
            for v in x:
                jax.tree.map(visit, v, is_leaf=named)
        return x

    jax.tree.map(visit, opt_state, is_leaf=named)
    return names
