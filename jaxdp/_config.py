"""``DDPConfig``: the validated, frozen configuration of jaxdp's gradient machinery.

Field names follow Megatron-LM's ``DistributedDataParallelConfig`` where one exists, so a Megatron
user can carry settings over. Every value is checked in ``__post_init__`` and a bad one raises a
``ValueError`` or ``TypeError`` that names the field, shows what was given, says what is allowed
and how to fix it, before anything is traced or compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import math
import os
import re
from collections.abc import Callable
from typing import Any, Final, Literal

import numpy as np
import yaml

__all__ = ["DDPConfig", "AUTO_BUCKET_SIZE", "REMAT_POLICIES", "default_bucket_size"]

#: Value of ``DDPConfig.bucket_size`` that means "Megatron's default, resolved once dp is known".
AUTO_BUCKET_SIZE: Final = "auto"

_LAYOUTS = ("interleaved", "megatron")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: Values of ``DDPConfig.remat_policy`` (the policies themselves: ``jaxdp._gather``).
REMAT_POLICIES: Final = ("gemm", "dots", "everything", "nothing")


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: ``max(40_000_000, 1_000_000 * dp_size)``.

    Example:
        >>> default_bucket_size(8)
        40000000
        >>> default_bucket_size(64)
        64000000
    """
    return max(40_000_000, 1_000_000 * int(dp_size))


def _did_you_mean(unknown: list[Any], names: list[str]) -> str:
    """``'bucket_sise' (did you mean 'bucket_size'?), 'foo'``: unknown names with close matches."""
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), names, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)


def _err(field: str, value: Any, expected: str, fix: str, exc: type[Exception] = ValueError):
    return exc(f"DDPConfig.{field}: got {value!r}; expected {expected}. Fix: {fix}")


def _scan_patterns(rules: Any) -> tuple[tuple[str, int], ...]:
    """Validate ``scan_param_patterns``: ``((regex, axis), ...)`` or a ``{regex: axis}`` map."""
    field, fix = "scan_param_patterns", "pass e.g. scan_param_patterns=(('layers/', 0),)"
    if isinstance(rules, dict):
        rules = tuple(rules.items())
    if isinstance(rules, str) or not isinstance(rules, (tuple, list)):
        raise _err(field, rules, "a tuple of (regex, stacked axis) pairs", fix, TypeError)
    out = []
    for r in rules:
        ok = isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], str) and r[0]
        ax = r[1] if ok else None
        if not ok or isinstance(ax, bool) or not isinstance(ax, (int, np.integer)) or ax < 0:
            raise _err(field, rules, "(non-empty regex, axis >= 0) pairs", f"fix {r!r}", TypeError)
        try:
            re.compile(r[0])
        except re.error as e:
            raise _err(field, rules, f"valid regular expressions ({r[0]!r}: {e})", fix) from e
        out.append((r[0], int(ax)))
    return tuple(out)


def _check_bool(field: str, value: Any) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise _err(
            field,
            value,
            "a bool (True or False)",
            f"pass {field}=True or {field}=False",
            TypeError,
        )


def _canonical_dtype(field: str, value: Any, allow_none: bool) -> str | None:
    if value is None and allow_none:
        return None
    try:
        name = None if value is None else np.dtype(value).name
    except TypeError:
        name = None
    if name is None or name not in _FLOAT_DTYPES:
        what = "None (keep the params' own dtypes) or " if allow_none else ""
        raise _err(
            field,
            value,
            f"{what}a floating dtype name, one of {_FLOAT_DTYPES}",
            f"pass e.g. {field}='{'bfloat16' if allow_none else 'float32'}' (or a jnp dtype)",
            TypeError if name is None else ValueError,
        )
    return name


@dataclasses.dataclass(frozen=True)
class DDPConfig:
    """Configuration of bucketed gradient reduction, FP32 accumulation and ZeRO sharding.

    Attributes:
        zero_stage: 0 = all-reduce DDP with a replicated optimizer; 1 = distributed optimizer
            (optimizer state and fp32 master weights sharded over ``data_axis``, gradients
            reduce-scattered, params all-gathered); 2 = stage 1 plus a sharded gradient
            accumulator (a reduce-scatter per micro-batch); 3 = stage 2 plus sharded params:
            each bucket is all-gathered inside every micro-batch's forward pass and again in
            its backward pass (never kept as a residual), and its gradient reduce-scattered
            with stage 2's numerics; ``loss_fn`` still receives the full params.
        bucket_size: Elements per bucket. ``"auto"`` (default) resolves to Megatron's
            ``max(40_000_000, 1_000_000 * dp)`` once the data-parallel size is known; ``None``
            means one bucket per buffer. A bucket closes once its element count reaches this
            value, counted after the parameter that crosses it.
        overlap_grad_reduce: Keep several buckets so that XLA can overlap their collectives with
            the backward pass. As in Megatron, ``False`` forces one bucket per buffer.
        average_in_collective: Average inside the collective (``pmean``) instead of pre-scaling
            the gradients by ``1/dp`` and summing.
        grad_reduce_in_fp32: Cast gradients to fp32 before the reduction (fp32 on the wire, fp32
            gradient buffers).
        reduce_scatter_with_fp32_accumulation: Megatron's variant: gradients travel in their own
            (e.g. bf16) dtype with an ``all_to_all`` and each rank sums its shard in fp32, then
            casts once. Needs a distributed optimizer (``zero_stage >= 1``).
        deterministic_reduction: Sum every gradient bucket and every metric in a fixed rank
            order (an ``all_to_all`` plus an ordered local sum in fp32 for gradients, an
            all-gather plus an ordered sum for scalars), so results are bit-identical however
            the devices are split into processes and whatever algorithm the collective library
            picks. Gradients are then summed in fp32 whatever the wire dtype (as with
            ``reduce_scatter_with_fp32_accumulation``); at ``zero_stage=0`` each bucket becomes
            an ``all_to_all`` plus an ``all_gather`` (the bytes of a ring all-reduce). Costs
            speed where the collective library's fused reduce-scatter is faster than an
            ``all_to_all`` (NCCL on GPU); see BENCHMARKS.md.
        pad_buckets_for_high_nccl_busbw: Pad bucket ends to ``lcm(dp, 128, 2**16)`` elements
            instead of ``lcm(dp, 128)`` (distributed optimizer only).
        check_for_nan_in_grad: Check each bucket's local gradients for NaN/Inf before the
            collective and raise ``FloatingPointError`` naming the parameters.
        clip_grad: Maximum global L2 norm of the gradients; ``None`` or ``0`` turns clipping off.
        num_microbatches: Micro-batches accumulated per step (gradient accumulation).
        calculate_per_token_loss: ``loss_fn`` returns ``(loss_sum, num_tokens)`` and gradients
            are normalised by the global token count.
        param_dtype: Working dtype of the model params (e.g. ``"bfloat16"``); the optimizer owns
            an fp32 master copy. ``None`` keeps the params' own dtypes.
        main_grads_dtype: Dtype of the gradient accumulators that sum micro-batches locally
            (Megatron's ``main_grads_dtype``, default ``"float32"``); gradients are cast to the
            wire dtype only at the collective.
        data_axis: Name of the mesh axis that data parallelism runs over.
        own_bucket_param_patterns: ``fnmatch`` patterns over parameter paths (``"a/b/c"``) of
            parameters that get a bucket of their own (Megatron's ``shared_embedding``, for tied
            embeddings), e.g. ``("*embedding*",)``.
        bucket_layout: ``"interleaved"`` (default with a distributed optimizer: every parameter
            is split into ``dp`` equal pieces and rank ``r`` owns piece ``r`` of every parameter,
            so optimizer state keeps the params' tree structure) or ``"megatron"`` (contiguous
            buckets cut into ``dp`` contiguous shards, Megatron's exact padding rules).
        gradient_accumulation_fusion: Compute the weight gradients of :mod:`jaxdp.nn` layers as
            ``dot(x, dy, preferred_element_type=float32)`` from low-precision operands, added
            into the fp32 accumulator without a bf16 rounding (Megatron's
            ``wgrad_gemm_accum_fp32``). Other layers are unaffected. Not supported with
            ``zero_stage=3`` yet (the gathered params are not leaves the fusion can upcast).
        overlap_param_gather: Megatron's field. Keep the working params sharded between steps
            (``TrainState.params`` is the layout's shard view in ``param_dtype``) and gather them
            bucket by bucket at the *start* of the next step, before the forward pass, instead
            of after the optimizer update; the gathered params serve all micro-batches (one
            gather per bucket per step). Needs a distributed optimizer (``zero_stage >= 1``);
            ``zero_stage=3`` implies it (its params are always sharded and gathered at use).
            Default ``False``, from the compiled 8-H100 program (``bench/bench_memory_gpu.py``:
            4.2M-param MLP, 5 buckets, bf16, Adam): at ``G = 1`` it overlaps every gather but
            the first with forward GEMMs (at the end of the step they overlap only splitting the
            previous bucket) but the per-device total is 4.78 bytes/param against 4.60 without
            it; with ``G = 4`` the gathered params stay live through the micro-batch loop next
            to their unpacked copies (stage 1: 8.11 -> 10.32, stage 2: 5.76 -> 7.98). Turn it
            on at ``G = 1`` when the exposed end-of-step gathers cost more than 0.2 B/param.
        expert_axis: Mesh axis that experts are distributed over (expert parallelism), or
            ``None``. The dense data-parallel group then spans ``data_axis`` and this axis (the
            batch is split over both); expert params (split over this axis, or matched by
            ``expert_param_patterns``) get buffers of their own and are reduced over
            ``data_axis`` only, the expert-data-parallel group, with Megatron's gradient
            scaling (the expert factor ``expt_dp / dp`` under ``average_in_collective``).
            Needs ``zero_stage=0`` for now.
        expert_param_patterns: ``fnmatch`` patterns over parameter paths of expert params,
            e.g. ``("*/experts/*",)``; a matching param without a sharding over
            ``expert_axis`` is split over it on its first (expert) dimension. Params already
            split over ``expert_axis`` are expert params whether or not they match.
        scan_layers: ``zero_stage=3`` only. Gather parameters stacked ``[L, ...]`` for a
            ``lax.scan`` (flax ``nn.scan``, ``nnx.scan``, a raw ``lax.scan`` over layers) one
            layer per scan iteration, in the forward loop and again in the backward loop,
            instead of the whole stack at once; each such leaf is stored per layer (rank ``r``
            holds piece ``r`` of every layer) in a bucket of its own, and its gradient is
            reduce-scattered per layer with the same numerics as a bucket. Stacks are found
            automatically when ``DataParallel.init(params, example_batch=...)`` is given a
            (possibly abstract) batch: a leaf is stacked when its every use is as ``xs`` of a
            scan (possibly after a transpose, a cast, inside ``jit``/``remat``), see
            :func:`jaxdp.find_scanned_axes`. Needs ``bucket_layout="interleaved"``. ``False``
            gathers stacks whole, with their bucket, as any other parameter (and ignores
            ``scan_param_patterns``). Checkpoints restore across this setting.
        scan_param_patterns: ``zero_stage=3`` with ``scan_layers`` only (ignored otherwise).
            Mark stacks by hand, for models where detection cannot see the
            scan (layers sliced by hand, ``fori_loop``) or where ``init`` gets no batch:
            ``((regex, stacked axis), ...)`` (a mapping is accepted), matched with
            ``re.search`` against each leaf's ``"a/b/c"`` path, e.g.
            ``(("layers/", 0),)`` or ``(("^params/ScanBlock_0/", 1),)`` for
            ``nn.scan(variable_axes={"params": 1})``. The first matching rule wins over
            detection; a pattern that matches no leaf is an error at ``init``.
        remat_policy: ``zero_stage=3`` only (MaxText's name): what the ``jax.checkpoint``
            around each micro-batch's loss (and around each scan body of a gathered layer
            stack) saves for the backward pass. No policy saves a gathered parameter or a
            slice, reshape, cast or transpose of one, so the backward pass gathers the params
            again. ``"gemm"`` (default): only the outputs of ``dot_general`` without batch
            dimensions (the GEMMs of dense layers and attention projections); norms,
            activations, softmax, batched attention dots and cuDNN attention are recomputed,
            so XLA fuses them into their consumers instead of writing them out.
            ``"dots"``: every ``dot_general`` (batched too: attention scores and context),
            convolution and cuDNN fused-attention output
            (``jax.nn.dot_product_attention(implementation="cudnn")``, with its softmax
            statistics): attention is not recomputed, but with XLA's attention every layer's
            ``[batch, heads, T, T]`` scores are kept. ``"everything"``: every intermediate
            but the gathered params (jaxdp before this field). ``"nothing"``: recompute the
            whole forward pass. Compiled for 8 H100s (``bench/bench_remat.py``, a
            100.7M-parameter GPT, 12 layers of width 832, context 512, ``G = 1``), per device:
            ``"gemm"`` 2.48 GiB and 15.5 GiB of non-GEMM memory traffic, ``"everything"``
            4.92 GiB and 21.3 GiB, ``"nothing"`` 3.27 GiB, ``"dots"`` 2.15 GiB (but 3.83 GiB
            against ``"gemm"``'s 2.32 at context 1024, same tokens); on one H100 (a 304M GPT,
            measured before this field with a patched policy of the same rule) saving GEMM
            outputs only took the step from 1.26x to 1.10x of plain ``jit``.
            Limitation: a policy sees shapes, not provenance, so a GEMM whose operands both
            come from gathered params only (e.g. a low-rank ``A @ B`` weight) is saved by
            every policy but ``"nothing"`` (its operands are still gathered again for their
            gradients).
            Stages 0-2 do not rematerialise, so another value there is an error (wrap your
            ``loss_fn`` in ``jax.checkpoint`` yourself).

    Example:
        >>> cfg = DDPConfig(zero_stage=1, bucket_size=1_000_000, grad_reduce_in_fp32=True)
        >>> cfg.resolve_bucket_size(dp_size=8)
        1000000
        >>> DDPConfig().resolve_bucket_size(dp_size=64)
        64000000
    """

    zero_stage: int = 0
    bucket_size: int | Literal["auto"] | None = AUTO_BUCKET_SIZE
    overlap_grad_reduce: bool = True
    average_in_collective: bool = False
    grad_reduce_in_fp32: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    deterministic_reduction: bool = False
    pad_buckets_for_high_nccl_busbw: bool = False
    check_for_nan_in_grad: bool = False
    clip_grad: float | None = None
    num_microbatches: int = 1
    calculate_per_token_loss: bool = False
    param_dtype: str | None = None
    main_grads_dtype: str = "float32"
    data_axis: str = "data"
    own_bucket_param_patterns: tuple[str, ...] = ()
    bucket_layout: Literal["interleaved", "megatron"] = "interleaved"
    gradient_accumulation_fusion: bool = False
    overlap_param_gather: bool = False
    expert_axis: str | None = None
    expert_param_patterns: tuple[str, ...] = ()
    scan_layers: bool = True
    scan_param_patterns: tuple[tuple[str, int], ...] = ()
    remat_policy: Literal["gemm", "dots", "everything", "nothing"] = "gemm"

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self._check_fields()
        self._check_combinations()

    def _check_fields(self) -> None:
        z = self.zero_stage
        if isinstance(z, bool) or not isinstance(z, (int, np.integer)):
            raise _err("zero_stage", z, "an int in {0, 1, 2, 3}", "pass zero_stage=0..3", TypeError)
        if z not in (0, 1, 2, 3):
            raise _err(
                "zero_stage",
                z,
                "0 (DDP), 1 (sharded optimizer), 2 (+ sharded grads) or 3 (+ sharded params)",
                "pick one of 0, 1, 2, 3",
            )
        object.__setattr__(self, "zero_stage", int(z))

        bs = self.bucket_size
        if bs is not None and bs != AUTO_BUCKET_SIZE:
            if isinstance(bs, bool) or not isinstance(bs, (int, np.integer)):
                raise _err(
                    "bucket_size",
                    bs,
                    "a positive int (elements), None (one bucket per buffer) or 'auto'",
                    "pass e.g. bucket_size=40_000_000",
                    TypeError,
                )
            if bs <= 0:
                raise _err(
                    "bucket_size",
                    bs,
                    "a positive number of elements",
                    "use bucket_size=None for a single bucket, or a count > 0",
                )
            object.__setattr__(self, "bucket_size", int(bs))

        for name in (
            "overlap_grad_reduce",
            "average_in_collective",
            "grad_reduce_in_fp32",
            "reduce_scatter_with_fp32_accumulation",
            "deterministic_reduction",
            "pad_buckets_for_high_nccl_busbw",
            "check_for_nan_in_grad",
            "calculate_per_token_loss",
            "gradient_accumulation_fusion",
            "overlap_param_gather",
        ):
            _check_bool(name, getattr(self, name))
            object.__setattr__(self, name, bool(getattr(self, name)))

        cg = self.clip_grad
        if cg is not None:
            if isinstance(cg, bool) or not isinstance(cg, (int, float, np.integer, np.floating)):
                raise _err(
                    "clip_grad",
                    cg,
                    "None (off) or a non-negative float (max global L2 norm)",
                    "pass e.g. clip_grad=1.0",
                    TypeError,
                )
            if not math.isfinite(cg) or cg < 0:
                raise _err(
                    "clip_grad",
                    cg,
                    "a finite, non-negative max norm (0 or None turn clipping off)",
                    "pass e.g. clip_grad=1.0, or clip_grad=None to disable",
                )
            object.__setattr__(self, "clip_grad", float(cg) if cg > 0 else None)

        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
            raise _err(
                "num_microbatches", m, "a positive int", "pass e.g. num_microbatches=4", TypeError
            )
        if m < 1:
            raise _err(
                "num_microbatches",
                m,
                "an int >= 1 (1 = no gradient accumulation)",
                "pass num_microbatches=1 or more",
            )
        object.__setattr__(self, "num_microbatches", int(m))

        object.__setattr__(
            self, "param_dtype", _canonical_dtype("param_dtype", self.param_dtype, True)
        )
        object.__setattr__(
            self,
            "main_grads_dtype",
            _canonical_dtype("main_grads_dtype", self.main_grads_dtype, False),
        )

        ax = self.data_axis
        if not isinstance(ax, str):
            raise _err(
                "data_axis",
                ax,
                "the str name of a mesh axis",
                "pass e.g. data_axis='data'",
                TypeError,
            )
        if not ax:
            raise _err("data_axis", ax, "a non-empty mesh axis name", "pass e.g. data_axis='data'")

        pats = self.own_bucket_param_patterns
        if isinstance(pats, str) or not isinstance(pats, (tuple, list)):
            raise _err(
                "own_bucket_param_patterns",
                pats,
                "a tuple of fnmatch pattern strings over parameter paths",
                "wrap a single pattern in a tuple, e.g. ('*embedding*',)",
                TypeError,
            )
        for p in pats:
            if not isinstance(p, str) or not p:
                raise _err(
                    "own_bucket_param_patterns",
                    pats,
                    "non-empty pattern strings only",
                    f"remove or fix the entry {p!r}",
                    TypeError,
                )
        object.__setattr__(self, "own_bucket_param_patterns", tuple(pats))

        ea = self.expert_axis
        if ea is not None and (not isinstance(ea, str) or not ea):
            raise _err(
                "expert_axis",
                ea,
                "None or the non-empty str name of the mesh axis experts are split over",
                "pass e.g. expert_axis='expert'",
                TypeError if not isinstance(ea, str) else ValueError,
            )
        if ea is not None and ea == self.data_axis:
            raise _err(
                "expert_axis",
                ea,
                f"a mesh axis other than data_axis={self.data_axis!r} (experts are replicated "
                "over data_axis, their expert-data-parallel group)",
                "name the expert axis of the mesh, e.g. expert_axis='expert'",
            )
        epats = self.expert_param_patterns
        if isinstance(epats, str) or not isinstance(epats, (tuple, list)):
            raise _err(
                "expert_param_patterns",
                epats,
                "a tuple of fnmatch pattern strings over parameter paths",
                "wrap a single pattern in a tuple, e.g. ('*/experts/*',)",
                TypeError,
            )
        for p in epats:
            if not isinstance(p, str) or not p:
                raise _err(
                    "expert_param_patterns",
                    epats,
                    "non-empty pattern strings only",
                    f"remove or fix the entry {p!r}",
                    TypeError,
                )
        object.__setattr__(self, "expert_param_patterns", tuple(epats))
        _check_bool("scan_layers", self.scan_layers)
        object.__setattr__(self, "scan_param_patterns", _scan_patterns(self.scan_param_patterns))

        if self.bucket_layout not in _LAYOUTS:
            raise _err(
                "bucket_layout",
                self.bucket_layout,
                f"one of {_LAYOUTS}",
                "use 'interleaved' (optimizer state keeps the params' structure) or 'megatron'",
            )

        if not isinstance(self.remat_policy, str) or self.remat_policy not in REMAT_POLICIES:
            raise _err(
                "remat_policy",
                self.remat_policy,
                f"one of {REMAT_POLICIES} (what stage 3's jax.checkpoint saves)",
                "use 'gemm' (GEMM outputs only, the default), 'dots', 'everything' or 'nothing'",
                TypeError if not isinstance(self.remat_policy, str) else ValueError,
            )

    def _check_combinations(self) -> None:
        if self.reduce_scatter_with_fp32_accumulation:
            if self.zero_stage == 0:
                raise _err(
                    "reduce_scatter_with_fp32_accumulation",
                    True,
                    "a distributed optimizer (zero_stage >= 1); with zero_stage=0 gradients are "
                    "all-reduced, not reduce-scattered",
                    "set zero_stage=1 (or 2/3), or grad_reduce_in_fp32=True for an fp32 all-reduce",
                )
            if self.average_in_collective:
                raise _err(
                    "reduce_scatter_with_fp32_accumulation",
                    True,
                    "a SUM reduction, but average_in_collective=True asks for an AVG collective "
                    "(Megatron asserts the same)",
                    "set average_in_collective=False (gradients are pre-scaled by 1/dp instead)",
                )
            if self.grad_reduce_in_fp32:
                raise _err(
                    "reduce_scatter_with_fp32_accumulation",
                    True,
                    "low-precision gradients, but grad_reduce_in_fp32=True already reduces in fp32",
                    "keep only one of grad_reduce_in_fp32 / reduce_scatter_with_fp32_accumulation",
                )
        if self.overlap_param_gather and self.zero_stage == 0:
            raise _err(
                "overlap_param_gather",
                True,
                "a distributed optimizer (zero_stage >= 1): with zero_stage=0 the params are "
                "replicated and never gathered (Megatron asserts the same)",
                "set zero_stage=1 or 2 (zero_stage=3 implies it), or overlap_param_gather=False",
            )
        if self.gradient_accumulation_fusion and self.zero_stage == 3:
            raise _err(
                "gradient_accumulation_fusion",
                True,
                "zero_stage <= 2: at zero_stage=3 the params reach loss_fn through a per-bucket "
                "gather whose transpose is the reduce-scatter, and the fused fp32 weight "
                "gradients are not supported through it yet",
                "use zero_stage=2 with gradient_accumulation_fusion=True, or drop the fusion at "
                "zero_stage=3",
            )
        if (
            self.scan_param_patterns
            and self.zero_stage == 3
            and self.bucket_layout != "interleaved"
        ):
            raise _err(
                "scan_param_patterns",
                self.scan_param_patterns,
                "bucket_layout='interleaved': per-layer stacks are laid out per rank and layer",
                "use bucket_layout='interleaved', or drop scan_param_patterns",
            )
        if self.remat_policy != "gemm" and self.zero_stage != 3:
            raise _err(
                "remat_policy",
                self.remat_policy,
                "zero_stage=3: only stage 3 wraps the loss in jax.checkpoint (to gather the "
                "params again in the backward pass); stages 0-2 keep the full params and save "
                "what plain autodiff saves",
                "set zero_stage=3, or drop remat_policy (to rematerialise at stages 0-2, wrap "
                "loss_fn in jax.checkpoint yourself)",
            )
        if self.calculate_per_token_loss and self.average_in_collective:
            raise _err(
                "calculate_per_token_loss",
                True,
                "a SUM reduction normalised by the global token count; average_in_collective=True "
                "would divide by dp as well (Megatron rejects this combination)",
                "set average_in_collective=False",
            )
        if self.expert_param_patterns and self.expert_axis is None:
            raise _err(
                "expert_param_patterns",
                self.expert_param_patterns,
                "an expert_axis to split the matching params over",
                "set expert_axis='expert' (the mesh axis of expert parallelism)",
            )
        if self.pad_buckets_for_high_nccl_busbw and self.zero_stage == 0:
            raise _err(
                "pad_buckets_for_high_nccl_busbw",
                True,
                "a distributed optimizer (zero_stage >= 1); stage-0 buckets are not padded",
                "set zero_stage >= 1 or drop pad_buckets_for_high_nccl_busbw",
            )

    # ------------------------------------------------------------------ helpers
    @property
    def use_distributed_optimizer(self) -> bool:
        """Megatron's name for ``zero_stage >= 1``."""
        return self.zero_stage >= 1

    @property
    def shards_params(self) -> bool:
        """Whether the working params are sharded between steps (``zero_stage=3`` or
        ``overlap_param_gather``)."""
        return self.zero_stage == 3 or self.overlap_param_gather

    def resolve_bucket_size(self, dp_size: int) -> int | None:
        """The bucket size in elements for ``dp_size`` ranks (``None`` = one bucket per buffer).

        ``"auto"`` becomes ``max(40_000_000, 1_000_000 * dp_size)``; with
        ``overlap_grad_reduce=False`` every buffer is a single bucket, as in Megatron.
        """
        if not self.overlap_grad_reduce or self.bucket_size is None:
            return None
        if self.bucket_size == AUTO_BUCKET_SIZE:
            return default_bucket_size(dp_size)
        return int(self.bucket_size)

    def is_expert_path(self, path: str) -> bool:
        """Whether the parameter at ``path`` matches ``expert_param_patterns``."""
        return any(fnmatch.fnmatchcase(path, p) for p in self.expert_param_patterns)

    def owns_bucket(self, path: str) -> bool:
        """Whether the parameter at ``path`` matches ``own_bucket_param_patterns``."""
        return any(fnmatch.fnmatchcase(path, p) for p in self.own_bucket_param_patterns)

    def replace(self, **changes: Any) -> DDPConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ YAML
    def to_dict(self) -> dict[str, Any]:
        """Plain-Python dict of every field (tuples become lists)."""
        out = dataclasses.asdict(self)
        out["own_bucket_param_patterns"] = list(self.own_bucket_param_patterns)
        out["expert_param_patterns"] = list(self.expert_param_patterns)
        out["scan_param_patterns"] = [list(r) for r in self.scan_param_patterns]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "mapping") -> DDPConfig:
        """Build a config from a mapping, rejecting unknown keys by name."""
        if not isinstance(data, dict):
            raise TypeError(
                f"DDPConfig.from_dict: {source} holds a {type(data).__name__}; expected a mapping "
                "of field names to values. Fix: write the file as 'field: value' lines."
            )
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in names]
        if unknown:
            raise ValueError(
                f"DDPConfig: unknown key(s) in {source}: {_did_you_mean(unknown, names)}; "
                f"expected only {names}. Fix: rename or remove them."
            )
        kwargs = dict(data)
        for key in ("own_bucket_param_patterns", "expert_param_patterns"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = tuple(kwargs[key])
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> DDPConfig:
        """Load a config from a YAML file of ``field: value`` lines.

        Example:
            >>> import tempfile, pathlib
            >>> p = pathlib.Path(tempfile.mkdtemp()) / "ddp.yaml"
            >>> DDPConfig(zero_stage=2, clip_grad=1.0).to_yaml(p)
            >>> DDPConfig.from_yaml(p).zero_stage
            2
        """
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        if data is None:
            data = {}
        return cls.from_dict(data, source=str(path))

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str | None:
        """Write the config as YAML to ``path``, or return the YAML text when ``path`` is None."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is None:
            return text
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return None


def _named_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap a dataclass ``__init__`` so that an unknown keyword is named with a did-you-mean
    hint (Python's own error only says "unexpected keyword argument"); ``replace`` goes through
    it too. ``functools.wraps`` keeps the signature (``inspect.signature`` follows it)."""

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        fields = type(self).__dataclass_fields__
        if any(k not in fields for k in kwargs):
            names = [f.name for f in dataclasses.fields(self)]
            unknown = [k for k in kwargs if k not in fields]
            raise TypeError(
                f"{type(self).__name__}: unknown keyword argument(s) "
                f"{_did_you_mean(unknown, names)}; expected only the fields {names}. "
                "Fix: rename or remove them."
            )
        init(self, *args, **kwargs)

    return __init__


# setattr, not assignment: mypy types construction from the dataclass fields either way.
setattr(DDPConfig, "__init__", _named_keywords(DDPConfig.__init__))  # noqa: B010
