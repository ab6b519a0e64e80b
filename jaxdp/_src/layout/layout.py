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
import fnmatch
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..config.config import DDPConfig
from .placement import Bucket, Buffer, ParamSlot, leaf_info, place, place_shape
from .views import LayoutViews

__all__ = ["BucketLayout", "Bucket", "Buffer", "LayoutRules", "ParamSlot", "path_str", "rules_of"]


def path_str(path: tuple[Any, ...]) -> str:
    """A pytree key path as ``"a/b/0"``, the form ``own_bucket_param_patterns`` match against.

    Example:
        >>> import jax
        >>> path_str((jax.tree_util.DictKey("dense"), jax.tree_util.DictKey("kernel")))
        'dense/kernel'
    """
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


@dataclasses.dataclass(frozen=True)
class LayoutRules:
    """The config's answers to the layout's questions, decided once (by
    :meth:`BucketLayout.from_params` for a config, or the plan).

    Attributes:
        kind: ``"contiguous"`` (stage 0), ``"interleaved"`` or ``"megatron"``.
        bucket_size: elements per bucket, resolved for the dp size (``None``: one per buffer).
        param_dtype: the working dtype of the params (``None``: their own).
        grad_reduce_in_fp32: gradients are reduced (and bucketed) in fp32.
        high_nccl_busbw: Megatron's bucket-end padding for high NCCL bus bandwidth.
        own_bucket_param_patterns: ``fnmatch`` patterns of params that get a bucket each.
        num_buckets: cut each buffer into this many buckets of about equal size instead of
            closing them at ``bucket_size`` (:func:`jaxdp._src.layout.placement.place`);
            ``None``: by ``bucket_size``.
    """

    kind: str
    bucket_size: int | None
    param_dtype: str | None = None
    grad_reduce_in_fp32: bool = False
    high_nccl_busbw: bool = False
    own_bucket_param_patterns: tuple[str, ...] = ()
    num_buckets: int | None = None

    def owns_bucket(self, path: str) -> bool:
        """Whether the parameter at ``path`` matches ``own_bucket_param_patterns``."""
        return any(fnmatch.fnmatchcase(path, p) for p in self.own_bucket_param_patterns)

    def replace(self, **changes: Any) -> LayoutRules:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)


def rules_of(config: DDPConfig, dp_size: int) -> LayoutRules:
    """The layout questions of ``config`` answered for ``dp_size`` ranks (the one place that
    maps the config's fields to :class:`LayoutRules`).

    Example:
        >>> from jaxdp import DDPConfig
        >>> rules_of(DDPConfig(), 8).kind, rules_of(DDPConfig(zero_stage=1), 8).kind
        ('contiguous', 'interleaved')
    """
    return LayoutRules(
        kind="contiguous" if config.zero_stage == 0 else config.bucket_layout,
        bucket_size=config.resolve_bucket_size(dp_size),
        param_dtype=config.param_dtype,
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
        own_bucket_param_patterns=tuple(config.own_bucket_param_patterns),
        # Megatron: without overlap every buffer is one bucket, whatever sizes them
        num_buckets=config.num_buckets if config.overlap_grad_reduce else None,
    )


@dataclasses.dataclass(frozen=True)
class BucketLayout(LayoutViews):
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
        bucket_size: resolved bucket size in elements (``None`` = one bucket per buffer). With
            ``num_buckets``: the size its largest buffer's buckets were cut to (that buffer's
            elements over ``num_buckets``, rounded up), what the XLA combine thresholds are
            sized by (:func:`jaxdp.combine_thresholds`'s ``bucket_numel``).
        slots: one :class:`ParamSlot` per leaf, in leaf order.
        buffers: the :class:`Buffer` objects.
        buckets: the :class:`Bucket` objects, buffer by buffer.
        stacked: ``((leaf index, stacked axis), ...)`` of scanned layer stacks laid out per
            layer (:mod:`jaxdp._src.layout.stacked`; ZeRO-3 gathers them one layer per scan
            iteration).
            Each gets a bucket of its own; empty unless given to :meth:`from_params`.
        num_buckets: ``DDPConfig.num_buckets`` when it cut the buffers (else ``None``).

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
    num_buckets: int | None = None

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
                ``pad_buckets_for_high_nccl_busbw``, ``own_bucket_param_patterns``,
                ``bucket_layout`` and ``num_buckets``.
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
        return cls.build(params, rules_of(config, dp_size), dp_size, stacked, shard_axes=shard_axes)

    @classmethod
    def build(
        cls,
        params: Any,
        rules: LayoutRules,
        dp_size: int,
        stacked: Any = None,
        *,
        shard_axes: tuple[tuple[str, ...], ...] | None = None,
    ) -> BucketLayout:
        """:meth:`from_params` with the config's layout questions already answered
        (:class:`LayoutRules`): how the plan and ZeRO-3's per-layer layouts build one."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not leaves:
            raise ValueError(
                "BucketLayout.from_params: params has no array leaves; expected a pytree of "
                "parameters. Fix: pass the model's parameters (e.g. variables['params'])."
            )
        kind, bucket_size = rules.kind, rules.bucket_size
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
            shape, dtype = leaf_info(path, leaf)
            work = rules.param_dtype or dtype
            grad = "float32" if rules.grad_reduce_in_fp32 else work
            own_bucket = rules.owns_bucket(path)
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
            placed, spans = place(
                [(place_shape(m[2], stacked.get(m[0]), dp_size), m[6]) for m in reversed(members)],
                kind,
                dp_size,
                bucket_size,
                rules.high_nccl_busbw,
                rules.num_buckets,
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
        if rules.num_buckets is not None:  # the size the largest buffer's buckets were cut to
            largest = max(b.numel_unpadded for b in buffers)
            bucket_size = -(-largest // rules.num_buckets)
        return cls(
            treedef=treedef,
            kind=kind,
            dp_size=dp_size,
            bucket_size=bucket_size,
            high_nccl_busbw=rules.high_nccl_busbw,
            slots=tuple(s for s in slots if s is not None),
            buffers=tuple(buffers),
            buckets=tuple(buckets),
            stacked=tuple(sorted(stacked.items())),
            num_buckets=rules.num_buckets,
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
            + (f"num_buckets={self.num_buckets}, " if self.num_buckets is not None else "")
            + f"params={len(self.slots)}, elements={self.num_params:,})"
        ]
        for j, r in enumerate(rows):
            lines.append("  ".join(v.rjust(w) for v, w in zip(r, widths)))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines)
