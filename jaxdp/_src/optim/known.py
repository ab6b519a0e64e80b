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
import numpy as np

__all__ = ["known_elementwise"]

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
