"""Moving data between a params pytree and a layout's buckets and shards.

:class:`LayoutViews` is the half of :class:`jaxdp.BucketLayout` that touches arrays: ``pack`` /
``unpack`` (a pytree <-> one flat array per bucket), the rank-local shard view a distributed
optimizer sees (``shard_view`` / ``shard_unview``) and the global view it is sharded from
(``to_global_view`` / ``from_global_view``). Coordinates: see :mod:`jaxdp._src.layout.layout`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .placement import Bucket, ParamSlot
from .stacked import rows_to_stack, stack_to_rows

__all__ = ["LayoutViews"]


class LayoutViews:
    """Array methods of :class:`jaxdp.BucketLayout` (which supplies these attributes)."""

    treedef: Any
    kind: str
    dp_size: int
    slots: tuple[ParamSlot, ...]
    buckets: tuple[Bucket, ...]
    stacked: tuple[tuple[int, int], ...]

    # ------------------------------------------------------------------ pack / unpack
    def check_tree(self, tree: Any, what: str) -> list[Any]:
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
        leaves = self.check_tree(tree, "pack")
        out = []
        for b in self.buckets:
            dt = jnp.dtype(dtype if dtype is not None else b.dtype)
            if self.kind == "interleaved":
                out.append(self.pack_interleaved(b, leaves, dt))
            else:
                out.append(self.pack_contiguous(b, leaves, dt))
        return tuple(out)

    def fill(self, b: Bucket, pieces: dict[int, jax.Array], dt: Any, rows: int = 0) -> jax.Array:
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

    def pack_contiguous(self, b: Bucket, leaves: list[Any], dt: Any) -> jax.Array:
        return self.fill(b, {i: jnp.ravel(leaves[i]) for i in b.slots}, dt)

    def pack_interleaved(self, b: Bucket, leaves: list[Any], dt: Any) -> jax.Array:
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
        return self.fill(b, pieces, dt, rows=dp)

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
                self.leaf_from_global(
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
    def view_leaf_buckets(self) -> tuple[int, ...]:
        """The bucket of each leaf of a params-shaped tree or of a shard view of this layout
        (megatron views: one leaf per bucket)."""
        if self.kind == "megatron":
            return tuple(range(len(self.buckets)))
        return tuple(s.bucket for s in self.slots)

    def _require_sharded(self, what: str) -> None:
        if self.kind == "contiguous":
            raise ValueError(
                f"BucketLayout.{what}: a contiguous (zero_stage=0) layout has no shards. "
                "Fix: build the layout with zero_stage >= 1 in the config."
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
            self.fill(b, {i: leaves[i] for i in b.slots}, dtype if dtype is not None else b.dtype)
            for b in self.buckets
        )

    def to_global_view(self, tree: Any, dtype: Any = None) -> Any:
        """Full params-shaped pytree -> the global shard view (shard it along axis 0)."""
        self._require_sharded("to_global_view")
        if self.kind == "megatron":
            return self.pack(tree, dtype)
        leaves = self.check_tree(tree, "to_global_view")
        out = [self.leaf_to_global(i, leaf, dtype) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def leaf_to_global(self, i: int, leaf: Any, dtype: Any = None) -> Any:
        """Leaf ``i`` (params-shaped) -> its 1-D global shard view (interleaved layouts)."""
        s, stacked = self.slots[i], dict(self.stacked)
        if dtype is not None:
            leaf = jnp.asarray(leaf).astype(dtype)
        if i in stacked:
            return stack_to_rows(leaf, stacked[i], self.dp_size).reshape(-1)
        flat = jnp.ravel(leaf)
        padded = (s.end - s.start) * self.dp_size
        return jnp.pad(flat, (0, padded - s.size)) if padded > s.size else flat

    def leaf_from_global(self, i: int, flat: Any) -> Any:
        """Inverse of :meth:`leaf_to_global`."""
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
        out = [self.leaf_from_global(i, leaf) for i, leaf in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(self.treedef, out)
