"""``DataParallel.init``'s state built from small programs, one per kind of leaf.

``init`` has to turn every parameter into its working copy and its master view (flattened,
padded, sharded over the data axis at stages 1-3) and build the optimizer state on top.
Compiled as one program, that program grows with the parameter count and XLA's cost grows
faster: at 1,000 leaves (the 128 x 128 MLP of ``bench/bench_compile.py``, stage 1) it took
several times as long to compile as plain ``jax.jit(optimizer.init)``, on XLA:CPU and for
compile-only GPUs (BENCHMARKS.md section 7). Most leaves of a deep model repeat a handful of
shapes, so here each kind of leaf (:func:`_leaf_key`) gets one small jitted conversion, called
once per leaf, and the optimizer state one ``jax.jit(optimizer.init)``, which cut ``init``'s
time on both. The values are the one-program path's: the same conversions, per leaf.

Used only where it is cheaper (:func:`per_leaf_plan`): concrete arrays on one process, codecs
whose views are leaf by leaf (not the megatron buckets or tensor-parallel blocks), and at
least :data:`MIN_LEAVES` parameters and :data:`LEAVES_PER_KIND` leaves per kind of leaf on
average (each kind costs a compile of its own, about 50 ms on a GPU). Elsewhere ``init``
compiles its one program as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ..core.state import TrainState
from ..forms.codec import Codec, InterleavedCodec, ParamCodec

__all__ = ["LEAVES_PER_KIND", "MIN_LEAVES", "build_state", "per_leaf_plan"]

#: The per-leaf path needs at least this many leaves per kind of leaf on average...
LEAVES_PER_KIND = 8
#: ... and at least this many parameters: below, one program compiles about as fast (100
#: leaves: 0.30-0.35 s either way on XLA:CPU) and its fewer compiles win (16 leaves: 0.2-0.3 s
#: against 0.3-0.6 s).
MIN_LEAVES = 64


#: Codecs whose view is built leaf by leaf (the megatron codec packs buckets, the tensor-
#: parallel blocks need the plan's per-leaf shapes).
_LEAF_WISE = (ParamCodec, InterleavedCodec)


def _leaf_key(codec: Codec, i: int, x: Any, dtype: Any, sharding: Any) -> tuple[Any, ...]:
    """What leaf ``i``'s conversion depends on; leaves with equal keys share one program."""
    base = (tuple(np.shape(x)), np.dtype(x.dtype).str, np.dtype(dtype).str, sharding)
    if type(codec) is ParamCodec:
        return ("param", *base)
    layout = codec.layout
    s = layout.slots[i]
    return ("interleaved", *base, s.end - s.start, layout.dp_size, dict(layout.stacked).get(i))


class LeafPlan:
    """Per leaf, the key of its working-params conversion and of its master conversion
    (``master`` is empty where the strategy keeps no master weights), and one jitted
    ``leaf -> codec view`` per key."""

    def __init__(self, work: list[tuple[Any, ...]], master: list[tuple[Any, ...]]):
        self.work, self.master = work, master
        self.jitted: dict[tuple[Any, ...], Callable[[Any], Any]] = {}

    def add(self, key: tuple[Any, ...], codec: Codec, i: int, dtype: Any, sharding: Any) -> None:
        """Leaf ``i``'s conversion as the program of ``key``, unless ``key`` has one."""
        if key not in self.jitted:

            def convert(x: Any) -> Any:
                return codec.leaf_to_view(i, jax.numpy.asarray(x).astype(dtype))

            self.jitted[key] = jax.jit(convert, out_shardings=sharding)


def per_leaf_plan(strategy: Any, params: Any, shardings: TrainState) -> LeafPlan | None:
    """The per-leaf plan for ``params``, or ``None`` where one program is the better choice
    (module docstring)."""
    if jax.process_count() > 1:
        return None
    leaves = jax.tree_util.tree_leaves(params)
    if len(leaves) < MIN_LEAVES or not all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
        return None  # tracers (init under jax.eval_shape), Python scalars: one program
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return None
    codecs = [strategy.params_codec] + ([strategy.master_codec] if strategy.has_master else [])
    if any(type(c) not in _LEAF_WISE for c in codecs):
        return None
    work_sh = jax.tree_util.tree_leaves(shardings.params)
    work = [
        _leaf_key(strategy.params_codec, i, x, d, s)
        for i, (x, d, s) in enumerate(zip(leaves, strategy.work_dtypes, work_sh, strict=True))
    ]
    master: list[tuple[Any, ...]] = []
    if strategy.has_master:
        master_sh = jax.tree_util.tree_leaves(shardings.master)
        master = [
            _leaf_key(strategy.master_codec, i, x, strategy.master_dtype, s)
            for i, (x, s) in enumerate(zip(leaves, master_sh, strict=True))
        ]
    if len(set(work + master)) * LEAVES_PER_KIND > len(work + master):
        return None
    plan = LeafPlan(work, master)
    for i, k in enumerate(work):
        plan.add(k, strategy.params_codec, i, strategy.work_dtypes[i], work_sh[i])
    for i, k in enumerate(master):
        plan.add(k, strategy.master_codec, i, strategy.master_dtype, master_sh[i])
    return plan


def build_state(
    strategy: Any, plan: LeafPlan, params: Any, shardings: TrainState, model_state: Any, rng: Any
) -> TrainState:
    """The state ``strategy.init_state`` builds (plus ``model_state`` and ``rng``), built with
    ``plan``'s per-leaf programs and one ``jax.jit(optimizer.init)``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    jitted = plan.jitted
    work = jax.tree_util.tree_unflatten(
        treedef, [jitted[k](x) for k, x in zip(plan.work, leaves, strict=True)]
    )
    master = None
    if plan.master:
        master = jax.tree_util.tree_unflatten(
            treedef, [jitted[k](x) for k, x in zip(plan.master, leaves, strict=True)]
        )
    target = work if master is None else master
    opt_state = jax.jit(strategy.init_opt, out_shardings=shardings.opt_state)(target)
    if model_state is not None or rng is not None:
        extras = jax.jit(
            lambda ms, k: (ms, k), out_shardings=(shardings.model_state, shardings.rng)
        )
        model_state, rng = extras(model_state, rng)
    step = jax.device_put(np.zeros((), np.int32), shardings.step)
    return TrainState(step, work, master, opt_state, model_state, rng)
