"""One codec per state form: whole parameters <-> what the optimizer (and the state) holds.

A ZeRO strategy (:mod:`jaxdp._src.strategy.strategy`) keeps its master weights, optimizer state
and, at
stage 3, its working params in some *view* of the parameters. A :class:`Codec` is the one
place that converts a params-shaped pytree to that view and back, names the view's
shardings, and carries optimizer-state leaves between the two forms (for checkpoints, which
store everything params-shaped). The plan (:mod:`jaxdp._src.strategy.plan`) picks one per state
form:

* :class:`ParamCodec`: the view is the params themselves (stage 0, replicated working params);
  on a tensor-parallel mesh each leaf keeps its own sharding over the other axes.
* :class:`InterleavedCodec`: each parameter flattened, zero-padded to a multiple of dp and
  sharded over the data axis (layer stacks per layer; :class:`jaxdp.BucketLayout`).
* :class:`MegatronCodec`: one packed array per bucket, sharded over the data axis.
* :class:`BlockCodec`: a parameter split over tensor-parallel axes is ``[blocks, padded
  block]``, sharded ``P(model axes, data_axis)``
  (:class:`jaxdp._src.topology.sharding.ShardingPlan`).

Beside the codecs, the :class:`StatePolicy` says each optimizer-state leaf's storage dtype
(Adam's moments at the config's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``): what the state holds
between steps and what the optax update computes with.

Each codec also says which bucket each leaf of its view and of the optimizer state over it
belongs to, and so, under an :class:`Offload` policy, in which memory it lives between steps
(:meth:`Codec.placed`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..layout.layout import BucketLayout
from ..optim.known import map_moments
from ..topology.sharding import ShardingPlan

__all__ = [
    "DEVICE",
    "HOST",
    "BlockCodec",
    "Codec",
    "InterleavedCodec",
    "MegatronCodec",
    "Offload",
    "Owners",
    "ParamCodec",
    "StatePolicy",
]

#: The memory kinds of offloaded and of device-resident state.
HOST, DEVICE = "pinned_host", "device"


@dataclasses.dataclass(frozen=True)
class Offload:
    """The state policy of the ``optimizer_cpu_offload`` setting: the master weights and the
    optimizer state of ``buckets`` (indices into ``BucketLayout.buckets``) live in pinned host
    memory between steps, the rest in device memory. Optimizer-state leaves of no parameter
    (step counts) live in host memory too.

    Example:
        >>> Offload(frozenset({0})).kind(0), Offload(frozenset({0})).kind(1)
        ('pinned_host', 'device')
    """

    buckets: frozenset[int]

    def kind(self, bucket: int | None) -> str:
        """The memory kind of a leaf of ``bucket`` (``None``: a leaf of no parameter)."""
        return HOST if bucket is None or bucket in self.buckets else DEVICE


class Owners:
    """Which parameter an optimizer-state leaf belongs to: the first (in leaf order) whose key
    path ends the leaf's and whose shape (``shapes[i]``: its view's, or its own) is the
    leaf's; ``None`` for the rest (step counts). The key paths are indexed once, so a lookup
    tries each suffix of the leaf's path instead of every parameter (a scan per leaf was
    0.4 s of ``init`` at 1,000 parameters)."""

    def __init__(self, key_paths: Any, shapes: Any):
        self.shapes = [tuple(s) for s in shapes]
        self.index: dict[tuple[Any, ...], list[int]] = {}
        for i, kp in enumerate(key_paths):
            if len(kp):  # an empty key path (the params are one array) ends no leaf's path
                self.index.setdefault(tuple(kp), []).append(i)
        if len(self.shapes) != len(key_paths):
            raise ValueError(f"Owners: {len(key_paths)} key paths, {len(self.shapes)} shapes")

    def __call__(self, path: Any, shape: tuple[int, ...]) -> int | None:
        path, shape = tuple(path), tuple(shape)
        hits = [
            i
            for n in range(1, len(path) + 1)
            for i in self.index.get(path[-n:], ())
            if self.shapes[i] == shape
        ]
        return min(hits) if hits else None


def _same_def(tree: Any, treedef: Any) -> bool:
    mine: Any = jax.tree_util.tree_structure(tree)
    return bool(mine == treedef)


class Codec:
    """Params-shaped pytree <-> one view of it (module docstring). Subclasses define
    :meth:`to_view`, :meth:`from_view`, the per-leaf conversions and specs."""

    def __init__(self, layout: BucketLayout, sharding: ShardingPlan, axis: Any = None):
        self.layout, self.sharding = layout, sharding
        # the axis (or axes, major first) a view is sharded over: the data axis, or a
        # hierarchical group's shard axes (jaxdp._src.topology.group.ReductionGroup.shard_axes)
        self.axis = sharding.data_axis if axis is None else axis
        dummy = jax.tree_util.tree_unflatten(layout.treedef, list(range(len(layout.slots))))
        self.key_paths = [tuple(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]

    # ------------------------------------------------------------------ whole trees
    def to_view(self, tree: Any, dtype: Any = None) -> Any:
        """Whole params-shaped tree (optionally cast to ``dtype``) -> the view."""
        leaves = jax.tree_util.tree_leaves(tree)
        out = [
            self.leaf_to_view(i, x if dtype is None else x.astype(dtype))
            for i, x in enumerate(leaves)
        ]
        return jax.tree_util.tree_unflatten(self.layout.treedef, out)

    def from_view(self, view: Any) -> Any:
        """Inverse of :meth:`to_view` (no cast)."""
        leaves = jax.tree_util.tree_leaves(view)
        out = [self.leaf_from_view(i, v) for i, v in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(self.layout.treedef, out)

    # ------------------------------------------------------------------ per leaf
    def leaf_to_view(self, i: int, x: Any) -> Any:
        return x

    def leaf_from_view(self, i: int, v: Any) -> Any:
        return v

    def view_shape(self, i: int) -> tuple[int, ...]:
        """Shape of leaf ``i``'s view."""
        return self.sharding.leaves[i].shape

    def view_spec(self, i: int) -> P:
        """Global ``PartitionSpec`` of leaf ``i``'s view."""
        return self.sharding.leaves[i].pspec

    def step_spec(self, i: int) -> P:
        """Spec of leaf ``i``'s view over the step's manual axes (its ``shard_map`` spec)."""
        return self.sharding.leaves[i].spec_over(self.sharding.manual_axes)

    # ------------------------------------------------------------------ specs
    def _named(self, spec: P) -> NamedSharding:
        return NamedSharding(self.sharding.mesh, spec)

    def shardings(self, abstract_view: Any) -> Any:
        """The ``NamedSharding`` of every leaf of a view (e.g. ``TrainState.master``)."""
        return jax.tree_util.tree_unflatten(
            self.layout.treedef,
            [self._named(self.view_spec(i)) for i in range(len(self.key_paths))],
        )

    def specs(self) -> Any:
        """The view's global ``PartitionSpec`` tree (or a prefix of it)."""
        return jax.tree_util.tree_unflatten(
            self.layout.treedef, [self.view_spec(i) for i in range(len(self.key_paths))]
        )

    def step_specs(self) -> Any:
        """The view's specs inside the step's ``shard_map`` (manual over the group's axes)."""
        return jax.tree_util.tree_unflatten(
            self.layout.treedef, [self.step_spec(i) for i in range(len(self.key_paths))]
        )

    def unblock(self, local_view: Any) -> Any:
        """A device's block of the view, in a ``shard_map`` manual over every mesh axis -> its
        rank-local view (what :class:`jaxdp.BucketLayout`'s shard methods take)."""
        return local_view

    def _match(self, path: Any, shape: tuple[int, ...]) -> int | None:
        """The parameter an optimizer-state leaf over the view belongs to (:class:`Owners`)."""
        return self._owners(path, shape)

    @functools.cached_property
    def _owners(self) -> Owners:
        """Every leaf's view shape and key path, indexed once (``_match`` runs per
        optimizer-state leaf)."""
        shapes = [tuple(self.view_shape(i)) for i in range(len(self.key_paths))]
        return Owners(self.key_paths, shapes)

    def opt_shardings(self, abstract_opt: Any) -> Any:
        """Optimizer-state leaves are sharded like their parameter's view; others (step
        counts) are replicated."""
        rep = self._named(P())

        def one(path: Any, x: Any) -> Any:
            i = self._match(path, x.shape)
            return rep if i is None else self._named(self.view_spec(i))

        return jax.tree_util.tree_map_with_path(one, abstract_opt)

    # ------------------------------------------------------------------ memory
    def leaf_buckets(self, view: Any) -> Any:
        """The bucket of each leaf of a view (a tree like ``view``)."""
        buckets = self.layout.view_leaf_buckets()
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(view), list(buckets))

    def opt_buckets(self, abstract_opt: Any) -> Any:
        """The bucket of each optimizer-state leaf over the view: its parameter's, or
        ``None`` for leaves of no parameter (step counts)."""
        slots = self.layout.slots

        def one(path: Any, x: Any) -> int | None:
            i = self._match(path, x.shape)
            return None if i is None else slots[i].bucket

        return jax.tree_util.tree_map_with_path(one, abstract_opt)

    @staticmethod
    def placed(shardings: Any, buckets: Any, offload: Offload) -> Any:
        """``shardings`` (a tree) with each leaf's memory kind under ``offload``
        (``buckets``: a tree like it of each leaf's bucket)."""
        leaves, treedef_ = jax.tree_util.tree_flatten(shardings)
        treedef: Any = treedef_
        kinds = [offload.kind(b) for b in treedef.flatten_up_to(buckets)]
        return jax.tree_util.tree_unflatten(
            treedef, [s.with_memory_kind(k) for s, k in zip(leaves, kinds, strict=True)]
        )

    # ------------------------------------------------------------------ optimizer state
    def opt_from_view(self, opt: Any, view: Any) -> Any:
        """Optimizer state over the view -> the same leaves in their parameters' shapes."""

        def one(path: Any, x: Any) -> Any:
            i = self._match(path, x.shape)
            return x if i is None else self.leaf_from_view(i, x)

        return jax.tree_util.tree_map_with_path(one, opt)

    def opt_to_view(self, opt: Any, abstract_view_opt: Any) -> Any:
        """Inverse of :meth:`opt_from_view`, given the (abstract) view-shaped state."""

        def one(path: Any, x: Any, v: Any) -> Any:
            i = self._match(path, v.shape)
            return x if i is None else self.leaf_to_view(i, x)

        return jax.tree_util.tree_map_with_path(one, opt, abstract_view_opt)


class ParamCodec(Codec):
    """The view is the params themselves, each leaf sharded over the non-data axes as given
    (replicated on a 1-D mesh)."""

    def view_spec(self, i: int) -> P:
        ls = self.sharding.leaves[i]
        return ls.pspec if ls.axes else P()

    def to_view(self, tree: Any, dtype: Any = None) -> Any:
        return tree if dtype is None else jax.tree.map(lambda x: x.astype(dtype), tree)

    def from_view(self, view: Any) -> Any:
        return view

    def opt_from_view(self, opt: Any, view: Any) -> Any:
        return opt

    def opt_to_view(self, opt: Any, abstract_view_opt: Any) -> Any:
        return opt


class InterleavedCodec(Codec):
    """Each parameter flattened, zero-padded to a multiple of dp, sharded over the data axis
    (scanned layer stacks laid out per layer: :mod:`jaxdp._src.layout.stacked`)."""

    def leaf_to_view(self, i: int, x: Any) -> Any:
        return self.layout.leaf_to_global(i, x)

    def leaf_from_view(self, i: int, v: Any) -> Any:
        return self.layout.leaf_from_global(i, v)

    def view_shape(self, i: int) -> tuple[int, ...]:
        s = self.layout.slots[i]
        return ((s.end - s.start) * self.layout.dp_size,)

    def view_spec(self, i: int) -> P:
        return P(self.axis)

    def step_spec(self, i: int) -> P:
        return P(self.axis)

    def opt_shardings(self, abstract_opt: Any) -> Any:
        rep, shard = self._named(P()), self._named(P(self.axis))
        return jax.tree.map(lambda x: shard if x.ndim >= 1 else rep, abstract_opt)


class MegatronCodec(InterleavedCodec):
    """One packed array per bucket (Megatron's distributed-optimizer layout), sharded over the
    data axis; rank ``r`` owns the contiguous slice ``r`` of every bucket."""

    def to_view(self, tree: Any, dtype: Any = None) -> Any:
        return self.layout.pack(tree, dtype)

    def from_view(self, view: Any) -> Any:
        return self.layout.unpack(tuple(view))

    def shardings(self, abstract_view: Any) -> Any:
        return jax.tree.map(lambda _: self._named(P(self.axis)), abstract_view)

    def specs(self) -> Any:
        return P(self.axis)

    def step_specs(self) -> Any:
        return P(self.axis)

    def opt_from_view(self, opt: Any, view: Any) -> Any:
        view_def = jax.tree_util.tree_structure(view)
        shapes = [getattr(a, "shape", None) for a in jax.tree.leaves(view)]

        def is_view(x: Any) -> bool:
            return (
                _same_def(x, view_def)
                and [getattr(a, "shape", None) for a in jax.tree.leaves(x)] == shapes
            )

        return jax.tree.map(lambda x: self.from_view(x) if is_view(x) else x, opt, is_leaf=is_view)

    def opt_buckets(self, abstract_opt: Any) -> Any:
        # the state over the view holds view-shaped subtrees (one array per bucket)
        layout = self.layout
        dummy = jax.tree_util.tree_unflatten(
            layout.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.slots]
        )
        view = jax.eval_shape(self.to_view, dummy)
        view_def = jax.tree_util.tree_structure(view)
        shapes = [a.shape for a in jax.tree.leaves(view)]

        def is_view(x: Any) -> bool:
            return (
                _same_def(x, view_def)
                and [getattr(a, "shape", None) for a in jax.tree.leaves(x)] == shapes
            )

        def one(x: Any) -> Any:
            if is_view(x):
                return jax.tree_util.tree_unflatten(view_def, list(range(len(shapes))))
            return None

        return jax.tree.map(one, abstract_opt, is_leaf=is_view)

    def opt_to_view(self, opt: Any, abstract_view_opt: Any) -> Any:
        layout = self.layout
        dummy = jax.tree_util.tree_unflatten(
            layout.treedef, [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in layout.slots]
        )
        pdef = jax.tree_util.tree_structure(dummy)
        shapes = [s.shape for s in layout.slots]

        def is_param(x: Any) -> bool:
            return (
                _same_def(x, pdef)
                and [getattr(a, "shape", None) for a in jax.tree.leaves(x)] == shapes
            )

        return jax.tree.map(lambda x: self.to_view(x) if is_param(x) else x, opt, is_leaf=is_param)


class BlockCodec(Codec):
    """Params split over tensor-parallel axes: ``[blocks, padded block]`` sharded
    ``P(model axes, data_axis)``; unsplit params as :class:`InterleavedCodec`."""

    def __init__(self, layout: BucketLayout, sharding: ShardingPlan, axis: Any = None):
        super().__init__(layout, sharding, axis)
        # The plan computes these for every leaf at once: ask it once, not per leaf.
        self._shapes = sharding.view_shapes(layout)
        self._specs = sharding.view_specs()

    def leaf_to_view(self, i: int, x: Any) -> Any:
        return self.sharding.leaf_to_view(i, self.layout, x)

    def leaf_from_view(self, i: int, v: Any) -> Any:
        return self.sharding.leaf_from_view(i, self.layout, v)

    def view_shape(self, i: int) -> tuple[int, ...]:
        return self._shapes[i]

    def view_spec(self, i: int) -> P:
        return self._specs[i]

    def step_spec(self, i: int) -> P:
        return P(None, self.axis) if self.sharding.leaves[i].axes else P(self.axis)

    def unblock(self, local_view: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(local_view)
        rows = [x[0] if ls.axes else x for x, ls in zip(leaves, self.sharding.leaves, strict=True)]
        return jax.tree_util.tree_unflatten(self.layout.treedef, rows)


@dataclasses.dataclass(frozen=True)
class StatePolicy:
    """The storage dtype of each optimizer-state leaf (Adam's moments; the rest as optax
    keeps them), and the dtype the update computes them in.

    The plan builds one from the config's ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` once it has
    checked that the optimizer's state has the moments
    (:data:`jaxdp._src.optim.known.MOMENT_STATES`). The state holds them at :meth:`store`'s
    dtypes between steps, sharded like any other optimizer-state leaf; the update reads them
    through :meth:`load`, which widens them to ``compute`` (the master weights' dtype), so
    that optax's arithmetic is the float32 arithmetic of an unnarrowed state, and the new
    moments are rounded to nearest by :meth:`store` (Megatron's precision-aware optimizer
    does the same; no stochastic rounding).

    Attributes:
        exp_avg: storage dtype of the first moments (``None``: as optax keeps them).
        exp_avg_sq: the same for the second moments.
        compute: the dtype :meth:`load` widens them to.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> policy = StatePolicy(exp_avg="bfloat16", exp_avg_sq="bfloat16")
        >>> state = policy.store(optax.adam(1e-3).init({"w": jnp.zeros(2)}))
        >>> state[0].mu["w"].dtype, policy.load(state)[0].nu["w"].dtype
        (dtype(bfloat16), dtype('float32'))
    """

    exp_avg: str | None = None
    exp_avg_sq: str | None = None
    compute: str = "float32"

    @property
    def narrows(self) -> bool:
        """Whether any moment is stored narrower than optax keeps it (else a no-op)."""
        return self.exp_avg is not None or self.exp_avg_sq is not None

    def _dtypes(self) -> dict[str, Any]:
        pairs = (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq))
        return {role: jax.numpy.dtype(d) for role, d in pairs if d is not None}

    def store(self, opt_state: Any) -> Any:
        """``opt_state`` with its moments at their storage dtypes (rounded to nearest)."""
        return map_moments(opt_state, self._dtypes()) if self.narrows else opt_state

    def load(self, opt_state: Any) -> Any:
        """The stored ``opt_state`` with its narrowed moments widened to ``compute``."""
        if not self.narrows:
            return opt_state
        return map_moments(opt_state, {role: self.compute for role in self._dtypes()})
