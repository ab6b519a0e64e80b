"""Per-parameter shardings over the mesh axes other than the data axis (tensor parallelism).

On a multi-axis mesh each parameter keeps the sharding it was given at ``init`` over the
non-data axes (e.g. Megatron's column split ``P(None, "model")`` and row split
``P("model", None)``); the data-parallel machinery works on the *rank-local* pieces. A
:class:`ShardingPlan` records, per parameter leaf:

* ``spec``: its ``PartitionSpec`` over the non-data axes, one entry per dimension;
* ``axes``: the mesh axes it is split over, in order of appearance in ``spec``;
* ``factor``: the number of blocks (the product of those axes' sizes), ``M``;
* ``local_shape``: the shape of one block, what the :class:`BucketLayout` is built from.

A parameter split over ``axes`` is seen, in its "block form", as an ``[M, *local_shape]`` array
whose row ``m`` is the block held by the devices at mixed-radix position ``m`` over ``axes``
(first axis major): exactly the order in which ``shard_map``'s ``out_specs=P(axes)`` stacks
per-device values. At ZeRO stages >= 1 its master weights and optimizer state are kept as
``[M, dp * k]`` (row ``m``: block ``m`` flattened and zero-padded, as the interleaved layout does
for a whole parameter), sharded ``P(axes, data_axis)``: each device holds ``1 / (M * dp)``.
Unsharded parameters keep today's 1-D view sharded ``P(data_axis)``, so a 1-D mesh is unchanged.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..layout.layout import BucketLayout, path_str

__all__ = ["LeafSharding", "ShardingPlan", "spec_axes"]


def _entry_names(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def spec_axes(spec: Any) -> tuple[str, ...]:
    """Mesh axis names a ``PartitionSpec`` splits over, in order of appearance."""
    return tuple(n for e in spec for n in _entry_names(e))


@dataclasses.dataclass(frozen=True)
class LeafSharding:
    """How one parameter is split over the non-data mesh axes (module docstring)."""

    path: str
    shape: tuple[int, ...]
    spec: tuple[Any, ...]
    axes: tuple[str, ...]
    factor: int
    local_shape: tuple[int, ...]

    @property
    def pspec(self) -> P:
        """The non-data ``PartitionSpec`` of the parameter itself."""
        return P(*self.spec)

    def spec_over(self, axes: Any) -> P:
        """The parameter's spec restricted to ``axes`` (other entries become ``None``)."""
        keep = set(axes)
        out = []
        for e in self.spec:
            names = tuple(n for n in _entry_names(e) if n in keep)
            out.append(None if not names else names[0] if len(names) == 1 else names)
        return P(*out)


def _read_spec(leaf: Any) -> Any:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
        return sharding.spec
    return P()


def _leaf(path: str, leaf: Any, spec: Any, mesh: Any, data_axis: str) -> LeafSharding:
    shape = tuple(int(d) for d in leaf.shape)
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ValueError(
            f"DataParallel.init: param {path!r} has shape {shape} but sharding spec {spec} with "
            f"{len(entries)} entries; expected at most {len(shape)}. Fix: give it a "
            "PartitionSpec with one entry per dimension."
        )
    entries = entries + (None,) * (len(shape) - len(entries))
    local = []
    for d, e in zip(shape, entries, strict=True):
        names = _entry_names(e)
        for n in names:
            if n == data_axis:
                raise ValueError(
                    f"DataParallel.init: param {path!r} is sharded over the data axis "
                    f"{data_axis!r} (spec {spec}); expected a sharding over the other mesh axes "
                    f"only ({[a for a in mesh.axis_names if a != data_axis]}) or none: jaxdp "
                    "takes the ZeRO shard over the data axis itself. Fix: drop "
                    f"{data_axis!r} from its PartitionSpec (e.g. P(None, 'model')), or use "
                    "zero_stage >= 1 for sharded optimizer state."
                )
            if n not in mesh.axis_names:
                raise ValueError(
                    f"DataParallel.init: param {path!r} is sharded over axis {n!r} (spec "
                    f"{spec}), which the engine's mesh {dict(mesh.shape)} does not have. Fix: "
                    "place the params on the mesh given to DataParallel."
                )
        m = math.prod(int(mesh.shape[n]) for n in names)
        if d % m:
            raise ValueError(
                f"DataParallel.init: param {path!r} has a dimension of size {d} split over "
                f"{names} ({m} ways); expected a multiple of {m}. Fix: pad the parameter or "
                "change its PartitionSpec."
            )
        local.append(d // m)
    axes = spec_axes(entries)
    if len(set(axes)) != len(axes):
        raise ValueError(
            f"DataParallel.init: param {path!r} uses a mesh axis twice in its spec {spec}. Fix: "
            "name each mesh axis at most once."
        )
    return LeafSharding(
        path=path,
        shape=shape,
        spec=entries,
        axes=axes,
        factor=math.prod(int(mesh.shape[n]) for n in axes),
        local_shape=tuple(local),
    )


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The non-data shardings of every parameter leaf, and the mesh axes involved.

    Attributes:
        mesh: the engine's mesh.
        data_axis: the data-parallel axis.
        manual_axes: mesh axes the step's outer ``shard_map`` is manual over.
        leaves: one :class:`LeafSharding` per parameter leaf, in leaf order.
    """

    mesh: Any
    data_axis: str
    manual_axes: tuple[str, ...]
    leaves: tuple[LeafSharding, ...]

    @classmethod
    def from_params(
        cls,
        params: Any,
        mesh: Any,
        data_axis: str,
        param_specs: Any = None,
        *,
        expert_axis: str | None = None,
        expert_patterns: tuple[str, ...] = (),
    ) -> ShardingPlan:
        """Read each leaf's ``NamedSharding`` (or ``param_specs``, a pytree of
        ``PartitionSpec`` like ``params``); leaves without one are replicated.

        With ``expert_axis`` the step is manual over it too; leaves matching
        ``expert_patterns`` that are not split over it are split over it on dimension 0."""
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        if param_specs is None:
            specs = [_read_spec(leaf) for _, leaf in flat]
        else:
            specs = jax.tree_util.tree_leaves(
                param_specs, is_leaf=lambda x: isinstance(x, P) or x is None
            )
            specs = [P() if s is None else s for s in specs]
            if len(specs) != len(flat):
                raise ValueError(
                    f"DataParallel.init: param_specs has {len(specs)} PartitionSpec leaves; "
                    f"expected {len(flat)}, one per parameter. Fix: build it with "
                    "jax.tree.map(lambda _: P(...), params)."
                )
        paths = [path_str(kp) for kp, _ in flat]
        if expert_axis is not None:
            specs = _mark_experts(paths, specs, expert_axis, expert_patterns)
        leaves = tuple(
            _leaf(path, leaf, spec, mesh, data_axis)
            for path, (_, leaf), spec in zip(paths, flat, specs, strict=True)
        )
        manual = (data_axis,) if expert_axis is None else (data_axis, expert_axis)
        return cls(mesh=mesh, data_axis=data_axis, manual_axes=manual, leaves=leaves)

    # ------------------------------------------------------------------ queries
    @property
    def auto_axes(self) -> tuple[str, ...]:
        """Non-manual mesh axes that some parameter is split over (the nested region's axes)."""
        used = {a for leaf in self.leaves for a in leaf.axes if a not in self.manual_axes}
        return tuple(a for a in self.mesh.axis_names if a in used)

    @property
    def trivial(self) -> bool:
        """No parameter is split over a non-manual axis and the step is manual over the data
        axis only: the 1-D code path applies as is."""
        return not self.auto_axes and len(self.manual_axes) == 1

    @property
    def expert_axis(self) -> str | None:
        return self.manual_axes[1] if len(self.manual_axes) > 1 else None

    def local_params(self, params: Any) -> Any:
        """Abstract per-device blocks of ``params`` (what the layout is built from)."""
        leaves, treedef = jax.tree_util.tree_flatten(params)
        out = [
            jax.ShapeDtypeStruct(ls.local_shape, leaf.dtype)
            for ls, leaf in zip(self.leaves, leaves, strict=True)
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def buffer_keys(self) -> tuple[tuple[str, ...], ...]:
        """Per leaf, the (non-data) axes it is split over: params are grouped into buffers by
        it, so expert params and each tensor-parallel split get buffers of their own."""
        return tuple(ls.axes for ls in self.leaves)

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # ------------------------------------------------------------------ specs
    def param_specs(self) -> list[P]:
        """Per leaf, the spec of the working params (and of stage-0 master/optimizer state)."""
        return [ls.pspec for ls in self.leaves]

    def view_specs(self) -> list[P]:
        """Per leaf, the spec of its ZeRO global view (stages >= 1, interleaved layout)."""
        out = []
        for ls in self.leaves:
            out.append(
                P(self.data_axis) if not ls.axes else P(_axes_entry(ls.axes), self.data_axis)
            )
        return out

    def view_shapes(self, layout: BucketLayout) -> list[tuple[int, ...]]:
        """Per leaf, the shape of its ZeRO global view."""
        out: list[tuple[int, ...]] = []
        for ls, s in zip(self.leaves, layout.slots, strict=True):
            n = (s.end - s.start) * layout.dp_size
            out.append((n,) if not ls.axes else (ls.factor, n))
        return out

    # ------------------------------------------------------------------ block form
    def _split(self, ls: LeafSharding) -> tuple[list[int], list[int]]:
        """``ls.shape`` with every split dimension expanded into (mesh axes..., local), and
        the permutation that brings the mesh-axis dimensions to the front in ``ls.axes`` order."""
        split: list[int] = []
        block_dims: list[tuple[int, int]] = []
        local_dims: list[int] = []
        for d, e in zip(ls.shape, ls.spec, strict=True):
            names = _entry_names(e)
            for n in names:
                block_dims.append((ls.axes.index(n), len(split)))
                split.append(int(self.mesh.shape[n]))
            local_dims.append(len(split))
            split.append(d // math.prod(int(self.mesh.shape[n]) for n in names))
        return split, [i for _, i in sorted(block_dims)] + local_dims

    def to_blocks(self, x: Any, ls: LeafSharding) -> jax.Array:
        """Whole parameter -> ``[M, *local_shape]`` (row ``m``: the block of mixed-radix
        position ``m`` over ``ls.axes``)."""
        split, order = self._split(ls)
        return jnp.reshape(x, split).transpose(order).reshape(ls.factor, *ls.local_shape)

    def from_blocks(self, y: Any, ls: LeafSharding) -> jax.Array:
        """Inverse of :meth:`to_blocks`."""
        split, order = self._split(ls)
        z = jnp.reshape(y, [split[i] for i in order])
        return z.transpose([order.index(i) for i in range(len(order))]).reshape(ls.shape)

    # ------------------------------------------------------------------ global views
    def leaf_to_view(self, i: int, layout: BucketLayout, x: Any) -> jax.Array:
        """Leaf ``i`` as a whole parameter -> its ZeRO global view."""
        ls, s = self.leaves[i], layout.slots[i]
        padded = (s.end - s.start) * layout.dp_size
        if not ls.axes:
            flat = jnp.ravel(x)
            return jnp.pad(flat, (0, padded - s.size)) if padded > s.size else flat
        rows = self.to_blocks(x, ls).reshape(ls.factor, s.size)
        return jnp.pad(rows, ((0, 0), (0, padded - s.size))) if padded > s.size else rows

    def leaf_from_view(self, i: int, layout: BucketLayout, v: Any) -> jax.Array:
        """Inverse of :meth:`leaf_to_view`."""
        ls, s = self.leaves[i], layout.slots[i]
        if not ls.axes:
            return v[: s.size].reshape(ls.shape)
        return self.from_blocks(v[:, : s.size].reshape(ls.factor, *s.shape), ls)


def _mark_experts(
    paths: list[str], specs: list[Any], expert_axis: str, patterns: tuple[str, ...]
) -> list[Any]:
    """Split params matching ``patterns`` over ``expert_axis`` on dimension 0 (unless they
    already are); every pattern must match some param."""
    out = list(specs)
    for pat in patterns:
        hits = [i for i, p in enumerate(paths) if fnmatch.fnmatchcase(p, pat)]
        if not hits:
            raise ValueError(
                f"DataParallel.init: expert_param_patterns entry {pat!r} matches no parameter; "
                f"expected it to match expert params among {paths[:8]}"
                f"{'...' if len(paths) > 8 else ''}. Fix: correct the pattern (fnmatch over "
                "'a/b/c' paths, e.g. '*/experts/*') or remove it."
            )
        for i in hits:
            spec = tuple(out[i])
            if expert_axis in spec_axes(spec):
                continue
            if spec and spec[0] is not None:
                raise ValueError(
                    f"DataParallel.init: expert param {paths[i]!r} (matched by {pat!r}) has spec "
                    f"{P(*spec)} whose first dimension is already split; expected its first "
                    f"(expert) dimension free to split over {expert_axis!r}. Fix: give it the "
                    f"sharding P({expert_axis!r}, ...) yourself, or fix the pattern."
                )
            out[i] = P(expert_axis, *spec[1:])
    return out


def _axes_entry(axes: tuple[str, ...]) -> Any:
    return axes[0] if len(axes) == 1 else axes
