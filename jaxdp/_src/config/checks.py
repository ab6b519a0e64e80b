"""Field validation of ``DDPConfig``: the checks its ``__post_init__`` runs, and their messages.

``check_fields`` checks (and canonicalises) each field on its own, ``check_combinations`` the
fields against each other. A bad value raises a ``ValueError`` or ``TypeError`` that names the
field, shows what was given, says what is allowed and how to fix it. The allowed values
(``AUTO_BUCKET_SIZE``, ``REMAT_POLICIES``, the layouts and dtypes) live here too;
``jaxdp._src.config.config`` re-exports the public ones.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Final

import numpy as np

__all__ = ["AUTO_BUCKET_SIZE", "REMAT_POLICIES", "check_combinations", "check_fields"]

#: Value of ``DDPConfig.bucket_size`` that means "Megatron's default, resolved once dp is known".
AUTO_BUCKET_SIZE: Final = "auto"

_LAYOUTS = ("interleaved", "megatron")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")
#: Values of ``DDPConfig.remat_policy`` (the policies themselves: ``jaxdp._src.zero3.gather``).
REMAT_POLICIES: Final = ("gemm", "dots", "everything", "nothing")
#: Values of ``DDPConfig.model_state_sync``.
MODEL_STATE_SYNC: Final = ("mean", "broadcast")
#: ``DDPConfig.outer_dp_sharding_strategy``'s values.
OUTER_STRATEGIES: Final = ("no_shard", "optim")
#: Values of ``DDPConfig.exp_avg_dtype`` and ``exp_avg_sq_dtype``: the storage dtypes of Adam's
#: moments. float16 is left out: Adam's second moment holds squared gradients (1e-8 and less
#: is common), below float16's smallest normal (6.1e-5) and soon below its smallest subnormal
#: (6e-8), and the update divides by its square root; bfloat16 has float32's exponent range.
MOMENT_DTYPES: Final = ("float32", "bfloat16")


def _did_you_mean(unknown: list[Any], names: list[str]) -> str:
    """``'bucket_sise' (did you mean 'bucket_size'?), 'foo'``: unknown names with close matches."""
    hints = []
    for k in unknown:
        close = difflib.get_close_matches(str(k), names, n=1)
        hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(hints)


def _err(field: str, value: Any, expected: str, fix: str, exc: type[Exception] = ValueError):
    return exc(f"DDPConfig.{field}: got {value!r}; expected {expected}. Fix: {fix}")


def _fnmatch_patterns(cfg: Any, field: str, example: str) -> None:
    """Validate a tuple of ``fnmatch`` patterns over parameter paths; store it as a tuple."""
    pats = getattr(cfg, field)
    if isinstance(pats, str) or not isinstance(pats, (tuple, list)):
        raise _err(
            field,
            pats,
            "a tuple of fnmatch pattern strings over parameter paths",
            f"wrap a single pattern in a tuple, e.g. {example}",
            TypeError,
        )
    for p in pats:
        if not isinstance(p, str) or not p:
            raise _err(
                field,
                pats,
                "non-empty pattern strings only",
                f"remove or fix the entry {p!r}",
                TypeError,
            )
    object.__setattr__(cfg, field, tuple(pats))


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


#: Megatron's command-line names of the moment dtypes (``--exp-avg-dtype bf16``).
_MEGATRON_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _moment_dtype(field: str, value: Any) -> str:
    """Canonical name of a moment storage dtype (``jnp.bfloat16`` and ``"bf16"`` ->
    ``"bfloat16"``)."""
    try:
        value_ = _MEGATRON_DTYPES.get(value, value) if isinstance(value, str) else value
        name = np.dtype(value_).name if isinstance(value_, (str, type, np.dtype)) else None
    except TypeError:
        name = None
    if name in MOMENT_DTYPES:
        return str(name)
    if name == "float16":
        raise _err(
            field,
            value,
            f"one of {MOMENT_DTYPES}; float16 is not offered: Adam's moments underflow its "
            "range (squared gradients are often below 1e-8, its smallest subnormal is 6e-8) "
            "and the update divides by the second moment's square root",
            f"use {field}='bfloat16' (float32's exponent range, 8 bits of mantissa)",
        )
    raise _err(
        field,
        value,
        f"a dtype name, one of {MOMENT_DTYPES} (Adam's moments' storage dtype)",
        f"pass {field}='bfloat16' to store them in half the memory, or 'float32'",
        TypeError if name is None else ValueError,
    )


def check_fields(cfg: Any) -> None:
    """Check and canonicalise each field of the ``DDPConfig`` ``cfg`` on its own (in place:
    ``cfg`` is frozen, so values are set with ``object.__setattr__``)."""
    z = cfg.zero_stage
    if isinstance(z, bool) or not isinstance(z, (int, np.integer)):
        raise _err("zero_stage", z, "an int in {0, 1, 2, 3}", "pass zero_stage=0..3", TypeError)
    if z not in (0, 1, 2, 3):
        raise _err(
            "zero_stage",
            z,
            "0 (DDP), 1 (sharded optimizer), 2 (+ sharded grads) or 3 (+ sharded params)",
            "pick one of 0, 1, 2, 3",
        )
    object.__setattr__(cfg, "zero_stage", int(z))

    bs = cfg.bucket_size
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
        object.__setattr__(cfg, "bucket_size", int(bs))

    if cfg.num_buckets is not None:
        _count(
            cfg,
            "num_buckets",
            "None (buckets by bucket_size) or an int >= 1 (buckets per buffer)",
            "an int >= 1 (buckets per buffer; 1 = one bucket per buffer)",
            (
                "pass e.g. num_buckets=4",
                "pass e.g. num_buckets=4, or None to size buckets by bucket_size",
            ),
        )

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
        "check_for_large_grads",
        "optimizer_cpu_offload",
    ):
        _check_bool(name, getattr(cfg, name))
        object.__setattr__(cfg, name, bool(getattr(cfg, name)))

    cg = cfg.clip_grad
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
        object.__setattr__(cfg, "clip_grad", float(cg) if cg > 0 else None)

    st = cfg.grad_norm_skip_threshold
    if st is not None:
        if isinstance(st, bool) or not isinstance(st, (int, float, np.integer, np.floating)):
            raise _err(
                "grad_norm_skip_threshold",
                st,
                "None (off) or a positive float (the largest global gradient norm to apply)",
                "pass e.g. grad_norm_skip_threshold=100.0",
                TypeError,
            )
        if not math.isfinite(st) or st <= 0:
            raise _err(
                "grad_norm_skip_threshold",
                st,
                "a positive, finite float (non-finite norms are always skipped when it is set)",
                "pass e.g. grad_norm_skip_threshold=100.0, or None to turn skipping off",
            )
        object.__setattr__(cfg, "grad_norm_skip_threshold", float(st))

    of = cfg.optimizer_offload_fraction
    if isinstance(of, bool) or not isinstance(of, (int, float, np.integer, np.floating)):
        raise _err(
            "optimizer_offload_fraction",
            of,
            "a float in (0, 1] (the share of the optimizer state kept in host memory)",
            "pass e.g. optimizer_offload_fraction=0.5",
            TypeError,
        )
    if not (0 < of <= 1):
        raise _err(
            "optimizer_offload_fraction",
            of,
            "a float in (0, 1] (0 would offload nothing: use optimizer_cpu_offload=False)",
            "pass a share such as 0.5, or 1.0 to offload the whole optimizer state",
        )
    object.__setattr__(cfg, "optimizer_offload_fraction", float(of))

    _count(
        cfg,
        "num_microbatches",
        "a positive int",
        "an int >= 1 (1 = no gradient accumulation)",
        ("pass e.g. num_microbatches=4", "pass num_microbatches=1 or more"),
    )

    object.__setattr__(cfg, "param_dtype", _canonical_dtype("param_dtype", cfg.param_dtype, True))
    object.__setattr__(
        cfg,
        "main_grads_dtype",
        _canonical_dtype("main_grads_dtype", cfg.main_grads_dtype, False),
    )

    ax = cfg.data_axis
    if isinstance(ax, list):
        ax = tuple(ax)
        object.__setattr__(cfg, "data_axis", ax)
    if isinstance(ax, tuple):  # (outer, inner): a two-level mesh (hierarchical instances)
        if len(ax) != 2 or not all(isinstance(a, str) and a for a in ax) or ax[0] == ax[1]:
            raise _err(
                "data_axis",
                ax,
                "a mesh axis name, or two distinct names (outer, inner) of a two-level mesh "
                "whose outer axis indexes the instances (MaxText's DCN x ICI)",
                "pass e.g. data_axis=('dcn', 'ici') with jax.make_mesh((nodes, gpus), "
                "('dcn', 'ici'))",
                TypeError if len(ax) != 2 else ValueError,
            )
    elif not isinstance(ax, str):
        raise _err(
            "data_axis",
            ax,
            "the str name of a mesh axis",
            "pass e.g. data_axis='data'",
            TypeError,
        )
    elif not ax:
        raise _err("data_axis", ax, "a non-empty mesh axis name", "pass e.g. data_axis='data'")

    _fnmatch_patterns(cfg, "own_bucket_param_patterns", "('*embedding*',)")

    ea = cfg.expert_axis
    if ea is not None and (not isinstance(ea, str) or not ea):
        raise _err(
            "expert_axis",
            ea,
            "None or the non-empty str name of the mesh axis experts are split over",
            "pass e.g. expert_axis='expert'",
            TypeError if not isinstance(ea, str) else ValueError,
        )
    if ea is not None and (ea == cfg.data_axis or ea in tuple(cfg.data_axis)):
        raise _err(
            "expert_axis",
            ea,
            f"a mesh axis other than data_axis={cfg.data_axis!r} (experts are replicated "
            "over data_axis, their expert-data-parallel group)",
            "name the expert axis of the mesh, e.g. expert_axis='expert'",
        )
    _fnmatch_patterns(cfg, "expert_param_patterns", "('*/experts/*',)")
    _check_bool("scan_layers", cfg.scan_layers)
    object.__setattr__(cfg, "scan_param_patterns", _scan_patterns(cfg.scan_param_patterns))

    if cfg.bucket_layout not in _LAYOUTS:
        raise _err(
            "bucket_layout",
            cfg.bucket_layout,
            f"one of {_LAYOUTS}",
            "use 'interleaved' (optimizer state keeps the params' structure) or 'megatron'",
        )

    _check_choice(
        "remat_policy",
        cfg.remat_policy,
        REMAT_POLICIES,
        "what stage 3's jax.checkpoint saves",
        "use 'gemm' (GEMM and fused-attention outputs, the default), 'dots', 'everything' or "
        "'nothing'",
    )
    for name in ("exp_avg_dtype", "exp_avg_sq_dtype"):
        object.__setattr__(cfg, name, _moment_dtype(name, getattr(cfg, name)))
    _check_choice(
        "model_state_sync",
        cfg.model_state_sync,
        MODEL_STATE_SYNC,
        "how the ranks combine the model_state each step",
        "use 'mean' (running statistics, the default) or 'broadcast' (rank 0's)",
    )
    what = "an int >= 1 (the number of instances the data ranks form; 1 = flat)"
    fix = "pass e.g. num_distributed_optimizer_instances=2 (one per node)"
    _count(cfg, "num_distributed_optimizer_instances", what, what, (fix, fix))
    _check_choice(
        "outer_dp_sharding_strategy",
        cfg.outer_dp_sharding_strategy,
        OUTER_STRATEGIES,
        "what is sharded across instances",
        "use 'no_shard' (optimizer replicated across instances, the default) or 'optim' "
        "(optimizer sharded across instances too)",
    )


def _count(cfg: Any, field: str, of_type: str, of_value: str, fixes: tuple[str, str]) -> None:
    """An int field that counts something, at least 1: ``TypeError`` (``of_type``) for a
    non-int (a bool included), ``ValueError`` (``of_value``) below 1; canonicalised to a
    Python int. ``fixes``: the fix for each."""
    n = getattr(cfg, field)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise _err(field, n, of_type, fixes[0], TypeError)
    if n < 1:
        raise _err(field, n, of_value, fixes[1])
    object.__setattr__(cfg, field, int(n))


def _check_choice(field: str, value: Any, choices: tuple[str, ...], what: str, fix: str) -> None:
    """A string field with a fixed set of values: TypeError for a non-string, else ValueError."""
    if not isinstance(value, str) or value not in choices:
        exc = TypeError if not isinstance(value, str) else ValueError
        raise _err(field, value, f"one of {choices} ({what})", fix, exc)


def check_combinations(cfg: Any) -> None:
    """Check the fields of the ``DDPConfig`` ``cfg`` against each other."""
    if cfg.num_buckets is not None and cfg.bucket_size != AUTO_BUCKET_SIZE:
        raise _err(
            "num_buckets",
            cfg.num_buckets,
            f"bucket_size='auto' (the default): num_buckets sizes the buckets instead of "
            f"bucket_size, and bucket_size={cfg.bucket_size!r} sizes them too (Megatron "
            "asserts the same)",
            "keep only one: drop bucket_size (or set it to 'auto'), or drop num_buckets",
        )
    if cfg.reduce_scatter_with_fp32_accumulation:
        if cfg.zero_stage == 0:
            raise _err(
                "reduce_scatter_with_fp32_accumulation",
                True,
                "a distributed optimizer (zero_stage >= 1); with zero_stage=0 gradients are "
                "all-reduced, not reduce-scattered",
                "set zero_stage=1 (or 2/3), or grad_reduce_in_fp32=True for an fp32 all-reduce",
            )
        if cfg.average_in_collective:
            raise _err(
                "reduce_scatter_with_fp32_accumulation",
                True,
                "a SUM reduction, but average_in_collective=True asks for an AVG collective "
                "(Megatron asserts the same)",
                "set average_in_collective=False (gradients are pre-scaled by 1/dp instead)",
            )
        if cfg.grad_reduce_in_fp32:
            raise _err(
                "reduce_scatter_with_fp32_accumulation",
                True,
                "low-precision gradients, but grad_reduce_in_fp32=True already reduces in fp32",
                "keep only one of grad_reduce_in_fp32 / reduce_scatter_with_fp32_accumulation",
            )
    if cfg.overlap_param_gather and cfg.zero_stage == 0:
        raise _err(
            "overlap_param_gather",
            True,
            "a distributed optimizer (zero_stage >= 1): with zero_stage=0 the params are "
            "replicated and never gathered (Megatron asserts the same)",
            "set zero_stage=1 or 2 (zero_stage=3 implies it), or overlap_param_gather=False",
        )
    if cfg.gradient_accumulation_fusion and cfg.zero_stage == 3:
        raise _err(
            "gradient_accumulation_fusion",
            True,
            "zero_stage <= 2: at zero_stage=3 the params reach loss_fn through a per-bucket "
            "gather whose transpose is the reduce-scatter, and the fused fp32 weight "
            "gradients are not supported through it yet",
            "use zero_stage=2 with gradient_accumulation_fusion=True, or drop the fusion at "
            "zero_stage=3",
        )
    if cfg.scan_param_patterns and cfg.zero_stage == 3 and cfg.bucket_layout != "interleaved":
        raise _err(
            "scan_param_patterns",
            cfg.scan_param_patterns,
            "bucket_layout='interleaved': per-layer stacks are laid out per rank and layer",
            "use bucket_layout='interleaved', or drop scan_param_patterns",
        )
    if cfg.remat_policy != "gemm" and cfg.zero_stage != 3:
        raise _err(
            "remat_policy",
            cfg.remat_policy,
            "zero_stage=3: only stage 3 wraps the loss in jax.checkpoint (to gather the "
            "params again in the backward pass); stages 0-2 keep the full params and save "
            "what plain autodiff saves",
            "set zero_stage=3, or drop remat_policy (to rematerialise at stages 0-2, wrap "
            "loss_fn in jax.checkpoint yourself)",
        )
    if cfg.calculate_per_token_loss and cfg.average_in_collective:
        raise _err(
            "calculate_per_token_loss",
            True,
            "a SUM reduction normalised by the global token count; average_in_collective=True "
            "would divide by dp as well (Megatron rejects this combination)",
            "set average_in_collective=False",
        )
    if cfg.expert_param_patterns and cfg.expert_axis is None:
        raise _err(
            "expert_param_patterns",
            cfg.expert_param_patterns,
            "an expert_axis to split the matching params over",
            "set expert_axis='expert' (the mesh axis of expert parallelism)",
        )
    if cfg.hierarchical:
        _check_hierarchical(cfg)
    if cfg.optimizer_offload_fraction != 1.0 and not cfg.optimizer_cpu_offload:
        raise _err(
            "optimizer_offload_fraction",
            cfg.optimizer_offload_fraction,
            "optimizer_cpu_offload=True: the fraction says how much of the state to offload",
            "set optimizer_cpu_offload=True, or drop optimizer_offload_fraction",
        )
    if cfg.pad_buckets_for_high_nccl_busbw and cfg.zero_stage == 0:
        raise _err(
            "pad_buckets_for_high_nccl_busbw",
            True,
            "a distributed optimizer (zero_stage >= 1); stage-0 buckets are not padded",
            "set zero_stage >= 1 or drop pad_buckets_for_high_nccl_busbw",
        )


def _check_hierarchical(cfg: Any) -> None:
    """``num_distributed_optimizer_instances > 1`` against the other fields (the mesh is
    checked when the engine is built: dp must be a multiple of it)."""
    n = cfg.num_distributed_optimizer_instances
    if cfg.zero_stage == 0:
        raise _err(
            "num_distributed_optimizer_instances",
            n,
            "a distributed optimizer (zero_stage >= 1): instances shard the optimizer within "
            "themselves; a stage-0 all-reduce has nothing to shard",
            "set zero_stage=1 (the same bytes as a hierarchical all-reduce, and the "
            "optimizer state sharded within each instance), or drop the field",
        )
    if cfg.expert_axis is not None:
        raise _err(
            "num_distributed_optimizer_instances",
            n,
            "no expert_axis: hierarchical data parallelism with expert parallelism is not "
            "implemented",
            "drop expert_axis, or use num_distributed_optimizer_instances=1",
        )
