"""``BucketLayout``: the static layout of a parameter pytree into buffers and buckets.

The layout is a pure function of the leaves' shapes and dtypes, the config and the data-parallel
size. It is computed once, in Python, and is hashable, so it can be a static argument of ``jit``.

Three kinds of layout (``BucketLayout.kind``):

* ``"contiguous"`` (``zero_stage == 0``): Megatron's default layout, parameters back to back in
  reverse pytree order, no padding at all. Buckets are all-reduced.
* ``"megatron"`` (``zero_stage >= 1``, ``bucket_layout="megatron"``): Megatron's distributed
  optimizer layout. Parameter starts aligned to 64 elements, bucket ends to ``lcm(dp, 128)``;
  rank ``r`` owns the contiguous slice ``[r*S, (r+1)*S)`` of every bucket, so a parameter can be
  split unevenly across ranks.
* ``"interleaved"`` (``zero_stage >= 1``, default): every parameter is padded to a multiple of
  ``dp`` and split into ``dp`` equal pieces; a bucket is a ``[dp, S]`` matrix whose row ``r`` holds
  piece ``r`` of every parameter. A tiled ``psum_scatter`` of the flattened bucket hands rank ``r``
  row ``r``, i.e. an equal shard of *every* parameter, so the sharded optimizer state keeps the
  params' tree structure (``optax.masked`` and weight-decay masks keep working).

Coordinates: in ``contiguous`` and ``megatron`` layouts, ``(start, end)`` are element offsets into
the flat buffer. In the ``interleaved`` layout a buffer is viewed as ``[dp, numel // dp]`` and
``(start, end)`` are column offsets into that view: rank ``r``'s row holds elements
``[r*k, (r+1)*k)`` of the flattened parameter, ``k = end - start``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._config import DDPConfig
from ._padding import pad_bucket_end, pad_param_start
from ._stacked import rows_to_stack, stack_to_rows

__all__ = ["BucketLayout", "Bucket", "Buffer", "ParamSlot", "path_str"]

_FLOATING = ("float16", "bfloat16", "float32", "float64")


def path_str(path: tuple[Any, ...]) -> str:
    """A pytree key path as ``"a/b/0"``, the form ``own_bucket_param_patterns`` match against.

    Example:
        >>> import jax
        >>> path_str((jax.tree_util.DictKey("dense"), jax.tree_util.DictKey("kernel")))
        'dense/kernel'
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives.

    Attributes:
        path: the parameter's pytree path, ``"a/b/c"``.
        leaf_index: position of the leaf in ``jax.tree.leaves`` order.
        shape: the parameter's shape.
        dtype: the dtype of the leaf that the layout was built from.
        buffer: index of its buffer in ``BucketLayout.buffers``.
        bucket: index of its bucket in ``BucketLayout.buckets``.
        start: start offset in buffer coordinates (see the module docstring).
        end: end offset in buffer coordinates.
    """

    path: str
    leaf_index: int
    shape: tuple[int, ...]
    dtype: str
    buffer: int
    bucket: int
    start: int
    end: int

    @property
    def size(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: the unit of a gradient collective.

    Attributes:
        index: position in ``BucketLayout.buckets`` (0 = output end of the model).
        buffer: index of the buffer that holds it.
        dtype: the working dtype of its parameters.
        grad_dtype: the dtype its gradients are reduced in.
        start: start offset in buffer coordinates.
        end: end offset (padded) in buffer coordinates.
        numel: padded number of elements (what the collective moves).
        numel_unpadded: elements before the bucket-end padding (Megatron's definition: includes
            the alignment gaps between parameters).
        numel_params: elements that belong to parameters (no padding of any kind).
        param_paths: paths of its parameters, in layout order.
        slots: indices into ``BucketLayout.slots`` in layout order.
        shard_numel: elements each rank owns after a reduce-scatter (``numel // dp``).
    """

    index: int
    buffer: int
    dtype: str
    grad_dtype: str
    start: int
    end: int
    numel: int
    numel_unpadded: int
    numel_params: int
    param_paths: tuple[str, ...]
    slots: tuple[int, ...]
    shard_numel: int

    @property
    def padding_fraction(self) -> float:
        """Fraction of ``numel`` that is padding."""
        return 1.0 - self.numel_params / self.numel if self.numel else 0.0


@dataclasses.dataclass(frozen=True)
class Buffer:
    """All parameters of one ``(dtype, grad_dtype)`` pair.

    Attributes:
        index: position in ``BucketLayout.buffers``.
        dtype: working dtype of its parameters.
        grad_dtype: dtype of its gradient buffer.
        numel: padded elements.
        numel_unpadded: sum of its buckets' ``numel_unpadded``.
        buckets: indices into ``BucketLayout.buckets``.
        shard_axes: mesh axes (other than the data axis) its parameters are split over; its
            element counts are per block, i.e. per model-parallel rank (``()`` = replicated).
    """

    index: int
    dtype: str
    grad_dtype: str
    numel: int
    numel_unpadded: int
    buckets: tuple[int, ...]
    shard_axes: tuple[str, ...] = ()


def _leaf_info(path: str, leaf: Any) -> tuple[tuple[int, ...], str]:
    shape = getattr(leaf, "shape", None)
    dtype = getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"BucketLayout.from_params: params leaf {path!r} is a {type(leaf).__name__}; expected "
            "an array or jax.ShapeDtypeStruct with .shape and .dtype. Fix: pass the model's "
            "parameter pytree (e.g. flax variables['params']), or wrap scalars with jnp.asarray."
        )
    name = np.dtype(dtype).name
    if name not in _FLOATING:
        raise TypeError(
            f"BucketLayout.from_params: params leaf {path!r} has dtype {name}; expected a floating "
            f"dtype {_FLOATING}. Fix: keep non-trainable integer state out of the params tree."
        )
    return tuple(int(d) for d in shape), name


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Static layout of a parameter pytree into buffers and buckets (Megatron's rules).

    Build it with :meth:`from_params`. Parameters are grouped into buffers by
    ``(dtype, grad_dtype)``, laid out in reverse pytree order (bucket 0 holds the last
    parameters, whose gradients are ready first in the backward pass), and a bucket closes once
    its element count reaches ``bucket_size``, counted after the parameter that crosses it.
    Parameters matching ``DDPConfig.own_bucket_param_patterns`` get a bucket of their own.

    Attributes:
        treedef: tree structure of the params.
        kind: ``"contiguous"``, ``"megatron"`` or ``"interleaved"`` (module docstring).
        dp_size: number of data-parallel ranks.
        bucket_size: resolved bucket size in elements (``None`` = one bucket per buffer).
        slots: one :class:`ParamSlot` per leaf, in leaf order.
        buffers: the :class:`Buffer` objects.
        buckets: the :class:`Bucket` objects, buffer by buffer.
        stacked: ``((leaf index, stacked axis), ...)`` of scanned layer stacks laid out per
            layer (:mod:`jaxdp._stacked`; ZeRO-3 gathers them one layer per scan iteration).
            Each gets a bucket of its own; empty unless given to :meth:`from_params`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
        >>> layout = BucketLayout.from_params(params, DDPConfig(), dp_size=2)
        >>> [(s.path, s.start, s.end) for s in layout.slots]
        [('b', 12, 15), ('w', 0, 12)]
        >>> flat = layout.pack(params)
        >>> jax.tree.map(lambda a, b: bool((a == b).all()), layout.unpack(flat), params)
        {'b': True, 'w': True}
    """

    treedef: Any
    kind: str
    dp_size: int
    bucket_size: int | None
    high_nccl_busbw: bool
    slots: tuple[ParamSlot, ...]
    buffers: tuple[Buffer, ...]
    buckets: tuple[Bucket, ...]
    stacked: tuple[tuple[int, int], ...] = ()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_params(
        cls,
        params: Any,
        config: DDPConfig,
        dp_size: int,
        stacked: Any = None,
        *,
        shard_axes: tuple[tuple[str, ...], ...] | None = None,
    ) -> BucketLayout:
        """Lay out ``params`` (arrays or ``jax.ShapeDtypeStruct`` leaves) for ``dp_size`` ranks.

        Args:
            params: the parameter pytree.
            config: a :class:`DDPConfig`; uses ``zero_stage``, ``bucket_size``,
                ``overlap_grad_reduce``, ``grad_reduce_in_fp32``, ``param_dtype``,
                ``pad_buckets_for_high_nccl_busbw``, ``own_bucket_param_patterns`` and
                ``bucket_layout``.
            dp_size: number of data-parallel ranks (>= 1).
            stacked: optional ``{leaf index: stacked axis}`` of layer stacks to lay out per
                layer (interleaved layouts only; each gets a bucket of its own).
            shard_axes: per leaf, the non-data mesh axes it is split over (tensor
                parallelism); ``params`` then holds the per-rank blocks and leaves with
                different ``shard_axes`` go into different buffers. ``None``: all replicated.
        """
        if not isinstance(config, DDPConfig):
            raise TypeError(
                f"BucketLayout.from_params: config is a {type(config).__name__}; expected a "
                "jaxdp.DDPConfig. Fix: pass config=DDPConfig(...)."
            )
        if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
            raise ValueError(
                f"BucketLayout.from_params: dp_size={dp_size!r}; expected an int >= 1 (the size "
                "of the data-parallel mesh axis). Fix: pass mesh.shape[config.data_axis]."
            )
        dp_size = int(dp_size)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not leaves:
            raise ValueError(
                "BucketLayout.from_params: params has no array leaves; expected a pytree of "
                "parameters. Fix: pass the model's parameters (e.g. variables['params'])."
            )
        if config.zero_stage == 0:
            kind = "contiguous"
        else:
            kind = config.bucket_layout
        bucket_size = config.resolve_bucket_size(dp_size)
        stacked = dict(stacked or {})
        if stacked and kind != "interleaved":
            raise ValueError(
                f"BucketLayout.from_params: per-layer stacks need the interleaved layout; got "
                f"bucket_layout={kind!r}. Fix: bucket_layout='interleaved' or scan_layers=False."
            )

        if shard_axes is None:
            shard_axes = ((),) * len(leaves)
        if len(shard_axes) != len(leaves):
            raise ValueError(
                f"BucketLayout.from_params: shard_axes has {len(shard_axes)} entries; expected "
                f"{len(leaves)}, one per parameter leaf."
            )
        infos = []  # (leaf_index, path, shape, leaf dtype, working dtype, grad dtype, own)
        for i, (kp, leaf) in enumerate(leaves):
            path = path_str(kp)
            shape, dtype = _leaf_info(path, leaf)
            work = config.param_dtype or dtype
            grad = "float32" if config.grad_reduce_in_fp32 else work
            own_bucket = config.owns_bucket(path)
            if i in stacked:
                ax = stacked[i]
                if not 0 <= ax < len(shape):
                    raise ValueError(
                        f"BucketLayout.from_params: stacked axis {ax} of {path!r} is out of "
                        f"range for its shape {shape}."
                    )
                own_bucket = True
            infos.append((i, path, shape, dtype, work, grad, own_bucket))

        groups: dict[tuple[str, str, tuple[str, ...]], list[Any]] = {}
        for info in infos:
            groups.setdefault((info[4], info[5], tuple(shard_axes[info[0]])), []).append(info)

        slots: list[ParamSlot | None] = [None] * len(infos)
        buffers: list[Buffer] = []
        buckets: list[Bucket] = []
        for (work, grad, axes), members in groups.items():
            bidx = len(buffers)
            first_bucket = len(buckets)
            placed, spans = _place(
                [(_place_shape(m[2], stacked.get(m[0]), dp_size), m[6]) for m in reversed(members)],
                kind,
                dp_size,
                bucket_size,
                config.pad_buckets_for_high_nccl_busbw,
            )
            ordered = list(reversed(members))
            per_bucket: dict[int, list[int]] = {}
            for m, (b, s, e) in zip(ordered, placed):
                slots[m[0]] = ParamSlot(m[1], m[0], m[2], m[3], bidx, first_bucket + b, s, e)
                per_bucket.setdefault(b, []).append(m[0])
            scale = dp_size if kind == "interleaved" else 1
            for b, (bs, be, unpadded_end) in enumerate(spans):
                ids = tuple(per_bucket.get(b, ()))
                buckets.append(
                    Bucket(
                        index=first_bucket + b,
                        buffer=bidx,
                        dtype=work,
                        grad_dtype=grad,
                        start=bs,
                        end=be,
                        numel=(be - bs) * scale,
                        numel_unpadded=(unpadded_end - bs) * scale,
                        numel_params=sum(math.prod(infos[i][2]) for i in ids),
                        param_paths=tuple(infos[i][1] for i in ids),
                        slots=ids,
                        shard_numel=(be - bs) * scale // dp_size,
                    )
                )
            own = tuple(range(first_bucket, len(buckets)))
            buffers.append(
                Buffer(
                    index=bidx,
                    dtype=work,
                    grad_dtype=grad,
                    numel=sum(buckets[i].numel for i in own),
                    numel_unpadded=sum(buckets[i].numel_unpadded for i in own),
                    buckets=own,
                    shard_axes=axes,
                )
            )
        return cls(
            treedef=treedef,
            kind=kind,
            dp_size=dp_size,
            bucket_size=bucket_size,
            high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            slots=tuple(s for s in slots if s is not None),
            buffers=tuple(buffers),
            buckets=tuple(buckets),
            stacked=tuple(sorted(stacked.items())),
        )

    # ------------------------------------------------------------------ queries
    @property
    def num_params(self) -> int:
        """Total number of parameter elements."""
        return sum(s.size for s in self.slots)

    def param_range(self, path: str) -> tuple[int, int]:
        """``(start, end)`` of the parameter at ``path`` in its buffer's coordinates."""
        for s in self.slots:
            if s.path == path:
                return s.start, s.end
        raise KeyError(
            f"BucketLayout.param_range: no parameter at path {path!r}; known paths: "
            f"{[s.path for s in self.slots]}"
        )

    # ------------------------------------------------------------------ pack / unpack
    def _check_tree(self, tree: Any, what: str) -> list[Any]:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"BucketLayout.{what}: the tree structure {treedef} differs from the layout's "
                f"{self.treedef}. Fix: pass a pytree with the same structure as the params the "
                "layout was built from."
            )
        for s, leaf in zip(self.slots, leaves):
            if tuple(jnp.shape(leaf)) != s.shape:
                raise ValueError(
                    f"BucketLayout.{what}: leaf {s.path!r} has shape {tuple(jnp.shape(leaf))}; "
                    f"expected {s.shape}."
                )
        return leaves

    def pack(self, tree: Any, dtype: Any = None) -> tuple[jax.Array, ...]:
        """Flatten a params-shaped pytree into one 1-D array per bucket (padding is zero).

        Args:
            tree: pytree with the params' structure and shapes (e.g. gradients).
            dtype: dtype of the buckets; ``None`` = each bucket's working ``dtype``.
        """
        leaves = self._check_tree(tree, "pack")
        out = []
        for b in self.buckets:
            dt = jnp.dtype(dtype if dtype is not None else b.dtype)
            if self.kind == "interleaved":
                out.append(self._pack_interleaved(b, leaves, dt))
            else:
                out.append(self._pack_contiguous(b, leaves, dt))
        return tuple(out)

    def _fill(self, b: Bucket, pieces: dict[int, jax.Array], dt: Any, rows: int = 0) -> jax.Array:
        """Concatenate ``b``'s per-slot pieces along the last axis with zero gaps and end padding.

        ``pieces[i]`` spans columns ``[start, end)`` of slot ``i``; with ``rows`` the pieces are
        ``[rows, end - start]`` matrices (interleaved buckets) and the result is flattened.
        """
        lead = (rows,) if rows else ()
        out, cursor = [], b.start
        for i in b.slots:
            s = self.slots[i]
            if s.start > cursor:
                out.append(jnp.zeros((*lead, s.start - cursor), dt))
            out.append(pieces[i].astype(dt))
            cursor = s.end
        if b.end > cursor:
            out.append(jnp.zeros((*lead, b.end - cursor), dt))
        full = out[0] if len(out) == 1 else jnp.concatenate(out, axis=-1)
        return full.reshape(-1)

    def _pack_contiguous(self, b: Bucket, leaves: list[Any], dt: Any) -> jax.Array:
        return self._fill(b, {i: jnp.ravel(leaves[i]) for i in b.slots}, dt)

    def _pack_interleaved(self, b: Bucket, leaves: list[Any], dt: Any) -> jax.Array:
        dp, pieces, stacked = self.dp_size, {}, dict(self.stacked)
        for i in b.slots:
            s = self.slots[i]
            k = s.end - s.start
            if i in stacked:
                pieces[i] = stack_to_rows(leaves[i], stacked[i], dp)
                continue
            flat = jnp.ravel(leaves[i])
            if dp * k > s.size:
                flat = jnp.pad(flat, (0, dp * k - s.size))
            pieces[i] = flat.reshape(dp, k)
        return self._fill(b, pieces, dt, rows=dp)

    def unpack(self, flat: Any) -> Any:
        """Inverse of :meth:`pack`: one 1-D array per bucket back to the params pytree.

        Leaves keep the buckets' dtype.
        """
        if not isinstance(flat, (tuple, list)) or len(flat) != len(self.buckets):
            got = len(flat) if isinstance(flat, (tuple, list)) else type(flat).__name__
            raise ValueError(
                f"BucketLayout.unpack: got {got} bucket arrays; expected a sequence of "
                f"{len(self.buckets)} (one per bucket, as returned by pack)."
            )
        leaves: list[Any] = [None] * len(self.slots)
        for b, arr in zip(self.buckets, flat):
            for i, leaf in zip(b.slots, self.unpack_bucket(b, arr), strict=True):
                leaves[i] = leaf
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def unpack_bucket(self, b: Bucket, arr: Any) -> list[Any]:
        """One bucket's 1-D array -> the leaves of its parameters (in ``b.slots`` order)."""
        if tuple(jnp.shape(arr)) != (b.numel,):
            raise ValueError(
                f"BucketLayout.unpack: bucket {b.index} has shape {tuple(jnp.shape(arr))}; "
                f"expected ({b.numel},)."
            )
        if self.kind == "interleaved":
            mat = jnp.reshape(arr, (self.dp_size, b.numel // self.dp_size))
            return [
                self._leaf_from_global(
                    i, mat[:, self.slots[i].start - b.start : self.slots[i].end - b.start].ravel()
                )
                for i in b.slots
            ]
        return [
            arr[self.slots[i].start - b.start : self.slots[i].end - b.start].reshape(
                self.slots[i].shape
            )
            for i in b.slots
        ]

    # ------------------------------------------------------------------ shards
    # A "shard view" is what a distributed optimizer sees. Locally (inside shard_map) it is
    # rank r's shard of every bucket; globally it is the concatenation over ranks, sharded
    # along axis 0 of every leaf. "interleaved": a pytree like the params whose leaves are 1-D
    # (globally: the flattened parameter zero-padded to a multiple of dp; locally: piece r).
    # "megatron": a tuple with one 1-D array per bucket (globally: the packed bucket).
    def _require_sharded(self, what: str) -> None:
        if self.kind == "contiguous":
            raise ValueError(
                f"BucketLayout.{what}: a contiguous (zero_stage=0) layout has no shards. "
                "Fix: build the layout with DDPConfig(zero_stage >= 1)."
            )

    def shard_view(self, shards: Any) -> Any:
        """Rank-local bucket shards (``numel // dp`` each) -> the optimizer's local view."""
        self._require_sharded("shard_view")
        shards = tuple(shards)
        if self.kind == "megatron":
            return shards
        leaves: list[Any] = [None] * len(self.slots)
        for b, x in zip(self.buckets, shards, strict=True):
            for i in b.slots:
                s = self.slots[i]
                leaves[i] = x[s.start - b.start : s.end - b.start]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def shard_unview(self, view: Any, dtype: Any = None) -> tuple[jax.Array, ...]:
        """Inverse of :meth:`shard_view`: local view -> one shard per bucket (padding is zero)."""
        self._require_sharded("shard_unview")
        if self.kind == "megatron":
            return tuple(
                v.astype(dtype if dtype is not None else b.dtype)
                for v, b in zip(view, self.buckets, strict=True)
            )
        leaves = jax.tree_util.tree_leaves(view)
        return tuple(
            self._fill(b, {i: leaves[i] for i in b.slots}, dtype if dtype is not None else b.dtype)
            for b in self.buckets
        )

    def to_global_view(self, tree: Any, dtype: Any = None) -> Any:
        """Full params-shaped pytree -> the global shard view (shard it along axis 0)."""
        self._require_sharded("to_global_view")
        if self.kind == "megatron":
            return self.pack(tree, dtype)
        leaves = self._check_tree(tree, "to_global_view")
        out = [self._leaf_to_global(i, leaf, dtype) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def _leaf_to_global(self, i: int, leaf: Any, dtype: Any = None) -> Any:
        """Leaf ``i`` (params-shaped) -> its 1-D global shard view (interleaved layouts)."""
        s, stacked = self.slots[i], dict(self.stacked)
        if dtype is not None:
            leaf = jnp.asarray(leaf).astype(dtype)
        if i in stacked:
            return stack_to_rows(leaf, stacked[i], self.dp_size).reshape(-1)
        flat = jnp.ravel(leaf)
        padded = (s.end - s.start) * self.dp_size
        return jnp.pad(flat, (0, padded - s.size)) if padded > s.size else flat

    def _leaf_from_global(self, i: int, flat: Any) -> Any:
        """Inverse of :meth:`_leaf_to_global`."""
        s, stacked = self.slots[i], dict(self.stacked)
        if i in stacked:
            return rows_to_stack(flat, s.shape, stacked[i], self.dp_size)
        return flat[: s.size].reshape(s.shape)

    def from_global_view(self, view: Any) -> Any:
        """Inverse of :meth:`to_global_view`: global shard view -> params-shaped pytree."""
        self._require_sharded("from_global_view")
        if self.kind == "megatron":
            return self.unpack(tuple(view))
        leaves = jax.tree_util.tree_leaves(view)
        out = [self._leaf_from_global(i, leaf) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    # ------------------------------------------------------------------ report
    def summary(self) -> str:
        """A table of buckets: index, buffer, dtypes, params, numel, padding %, MiB."""
        head = ("bucket", "buffer", "dtype", "grad", "params", "numel", "unpadded", "pad %", "MiB")
        rows = [head]
        for b in self.buckets:
            mib = b.numel * jnp.dtype(b.grad_dtype).itemsize / 2**20
            rows.append(
                (
                    str(b.index),
                    str(b.buffer),
                    b.dtype,
                    b.grad_dtype,
                    str(len(b.slots)),
                    f"{b.numel:,}",
                    f"{b.numel_unpadded:,}",
                    f"{100 * b.padding_fraction:.2f}",
                    f"{mib:.2f}",
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = [
            f"BucketLayout(kind={self.kind}, dp={self.dp_size}, bucket_size={self.bucket_size}, "
            f"params={len(self.slots)}, elements={self.num_params:,})"
        ]
        for j, r in enumerate(rows):
            lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths)))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _place_shape(shape: tuple[int, ...], axis: int | None, dp: int) -> tuple[int, ...]:
    """The shape :func:`_place` sizes a leaf by: a stack needs ``L * ceil(n / dp)`` columns."""
    if axis is None:
        return shape
    n = math.prod(shape) // shape[axis] if shape[axis] else 0
    return (shape[axis] * -(-n // dp) * dp,)


def _place(
    params: list[tuple[tuple[int, ...], bool]],
    kind: str,
    dp: int,
    bucket_size: int | None,
    busbw: bool,
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Place ``(shape, own_bucket)`` entries (already in layout order) into buckets.

    Returns ``(bucket, start, end)`` per entry and ``(start, end, unpadded_end)`` per bucket, in
    buffer coordinates. Follows Megatron's ``_compute_per_buffer_param_layout`` (distributed
    optimizer) and ``_compute_default_per_buffer_param_layout`` (no padding).
    """
    # Element counts are multiplied by `scale` to compare against bucket_size: interleaved
    # coordinates are columns of a [dp, S] matrix.
    scale = dp if kind == "interleaved" else 1

    def align_start(x: int) -> int:
        return pad_param_start(x) if kind == "megatron" else x

    def pad_end(x: int) -> int:
        if kind == "megatron":
            return pad_bucket_end(x, dp, busbw)
        if kind == "interleaved":
            return pad_bucket_end(x * dp, dp, busbw) // dp
        return x

    placed: list[tuple[int, int, int]] = []
    spans: list[tuple[int, int, int]] = []
    bucket_start = 0
    cursor = 0
    n_in_bucket = 0
    end = 0

    def close(unpadded_end: int) -> int:
        padded = pad_end(unpadded_end)
        spans.append((bucket_start, padded, unpadded_end))
        return padded

    for shape, own in params:
        numel = math.prod(shape)
        width = -(-numel // dp) if kind == "interleaved" else numel
        start = align_start(cursor)
        if own and n_in_bucket:
            # Megatron closes the open bucket at the shared param's *aligned* start, so the
            # alignment gap counts as unpadded (a documented quirk we reproduce).
            bucket_start = close(start)
            n_in_bucket = 0
            start = bucket_start
        end = start + width
        placed.append((len(spans), start, end))
        n_in_bucket += 1
        full = bucket_size is not None and (end - bucket_start) * scale >= bucket_size
        if full or own:
            bucket_start = close(end)
            n_in_bucket = 0
            cursor = bucket_start
        else:
            cursor = end
    if n_in_bucket:
        close(end)
    return placed, spans
