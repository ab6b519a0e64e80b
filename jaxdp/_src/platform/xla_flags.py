"""XLA GPU flags that keep jaxdp's gradient buckets intact and overlappable.

jaxdp emits one collective per bucket, but XLA's combiner passes merge collectives whose combined
size stays under ``--xla_gpu_{all_reduce,reduce_scatter,all_gather}_combine_threshold_bytes``
(default 30 MiB + 7 B), and one merged collective at the end of the backward pass overlaps
nothing. :func:`xla_flags` derives thresholds from the config so that no two full buckets fit
under them (a full bucket alone is already over the threshold, and the combiner leaves such a
collective alone), and turns on the latency-hiding scheduler. At ``zero_stage=3`` with the
interleaved layout jaxdp gathers and reduce-scatters per parameter instead, and the same
thresholds make XLA combine those into groups of at most one bucket.

XLA aborts the whole process on a flag it does not know, and flags come and go between
releases, so every flag is looked up in ``FLAG_TABLE`` (:mod:`jaxdp._src.platform.xla_flag_table`:
when each
flag exists) before it is emitted.

XLA reads ``XLA_FLAGS`` once, when the first backend starts. :func:`apply_xla_flags` sets it and
refuses to run later; :func:`xla_compiler_options` gives the same settings as per-executable
``compiler_options`` for ``jax.jit(..., compiler_options=...)`` or ``lowered.compile(...)``,
which work at any time.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any, Final

import numpy as np

from ..config.config import AUTO_BUCKET_SIZE, DDPConfig, default_bucket_size
from .xla_flag_table import (
    _BY_NAME,
    FLAG_TABLE,
    SEEN_ACCEPTED,
    FlagSpec,
    Version,
    _resolve_version,
    _version_for,
    flag_available,
)
from .xla_flag_table import NEWEST_CHECKED as NEWEST_CHECKED
from .xla_flag_table import OLDEST_CHECKED as OLDEST_CHECKED

__all__ = [
    "FLAG_TABLE",
    "FlagSpec",
    "apply_xla_flags",
    "combine_thresholds",
    "flag_available",
    "xla_compiler_options",
    "xla_flags",
]

_GRAD_MIN_BYTES = 2  # smallest float dtype a gradient bucket can hold (bf16/f16)
_ITEMSIZE: Final = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _itemsize(dtype: str | None, default: int) -> int:
    # DDPConfig canonicalises param_dtype to one of these names.
    return default if dtype is None else _ITEMSIZE[dtype]


def _check_dp(dp_size: int | None) -> int | None:
    if dp_size is None:
        return None
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ValueError(
            f"xla_flags: dp_size={dp_size!r}; expected a positive int (the size of the data "
            "axis) or None. Fix: pass e.g. dp_size=8 for 8 GPUs, or leave it out."
        )
    return int(dp_size)


def _check_numel(bucket_numel: int | None) -> int | None:
    if bucket_numel is None:
        return None
    if (
        isinstance(bucket_numel, bool)
        or not isinstance(bucket_numel, (int, np.integer))
        or bucket_numel < 1
    ):
        raise ValueError(
            f"combine_thresholds: bucket_numel={bucket_numel!r}; expected a positive int (the "
            "layout's bucket size in elements) or None. Fix: pass engine.layout.bucket_size."
        )
    return int(bucket_numel)


def combine_thresholds(
    config: DDPConfig, *, dp_size: int | None = None, bucket_numel: int | None = None
) -> dict[str, int]:
    """Combine thresholds (bytes) under which no two full buckets of ``config`` fit.

    A bucket holds at least ``bucket_size`` elements (only the last one of a buffer, and the own
    buckets of ``own_bucket_param_patterns``, can be smaller), so a threshold of one byte less
    than the smallest full bucket keeps every full bucket out of XLA's combiners, while smaller,
    unrelated collectives (the loss and norm scalars) can still be combined with each other.

    * all-reduce (stage 0): ``bucket_size`` elements of the gradient wire dtype (fp32 with
      ``grad_reduce_in_fp32``, else ``param_dtype``; bf16 assumed when unknown);
    * reduce-scatter (stages 1-2): XLA counts the *output* bytes, ``bucket_size // dp`` per
      rank; without ``dp_size`` the threshold is 0 (never combine: every reduce-scatter of a
      jaxdp step is a bucket);
    * all-gather (stages 1-2): XLA counts the gathered bytes, ``bucket_size`` elements of
      ``param_dtype``;
    * the all-to-all of ``reduce_scatter_with_fp32_accumulation`` has no combiner in XLA:GPU
      (jaxlib 0.10.2) and needs no threshold.

    ``bucket_size="auto"`` uses Megatron's default for ``dp_size`` (40M elements, its lower
    bound, when ``dp_size`` is unknown). Returns ``{}`` when the config asks for one bucket per
    buffer (``bucket_size=None`` or ``overlap_grad_reduce=False``): nothing to keep apart.

    ``bucket_numel``: the bucket size the layout chose, when the config alone cannot say it
    (:attr:`jaxdp.BucketLayout.bucket_size`): with ``num_buckets`` it depends on the params
    (the largest buffer's elements over ``num_buckets``), and it is needed; the engine
    passes its layout's. With ``num_buckets`` a bucket can be a little smaller than that
    size (each differs from it by less than its largest parameter), but any two consecutive
    buckets together exceed it.

    Example:
        >>> cfg = DDPConfig(zero_stage=1, bucket_size=1_000_000, param_dtype="bfloat16",
        ...                 grad_reduce_in_fp32=True)
        >>> combine_thresholds(cfg, dp_size=8)  # doctest: +NORMALIZE_WHITESPACE
        {'xla_gpu_all_reduce_combine_threshold_bytes': 3999999,
         'xla_gpu_reduce_scatter_combine_threshold_bytes': 499999,
         'xla_gpu_all_gather_combine_threshold_bytes': 1999999}
    """
    if not isinstance(config, DDPConfig):
        raise TypeError(
            f"combine_thresholds: config is a {type(config).__name__}; expected a "
            "jaxdp.DDPConfig. Fix: pass the config given to DataParallel."
        )
    dp = _check_dp(dp_size)
    given = _check_numel(bucket_numel)
    if not config.overlap_grad_reduce or config.bucket_size is None:
        return {}
    if config.num_buckets is not None and given is None:
        raise ValueError(
            f"combine_thresholds: config.num_buckets={config.num_buckets} sizes the buckets "
            "from the params, which the config does not know; expected bucket_numel=<the "
            "layout's bucket size in elements>. Fix: pass bucket_numel="
            "jaxdp.BucketLayout.from_params(params, config, dp_size).bucket_size (params may "
            "be jax.ShapeDtypeStruct leaves), or use DataParallel(compiler_options='jaxdp'), "
            "which passes its layout's."
        )
    if given is not None:
        elems = given
    elif config.bucket_size == AUTO_BUCKET_SIZE:
        elems = default_bucket_size(dp or 1)
    else:
        elems = int(config.bucket_size)
    grad_bytes = 4 if config.grad_reduce_in_fp32 else _itemsize(config.param_dtype, _GRAD_MIN_BYTES)
    param_bytes = _itemsize(config.param_dtype, _GRAD_MIN_BYTES)
    rs = 0 if dp is None else max(elems // dp * grad_bytes - 1, 0)
    return {
        "xla_gpu_all_reduce_combine_threshold_bytes": elems * grad_bytes - 1,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": rs,
        "xla_gpu_all_gather_combine_threshold_bytes": elems * param_bytes - 1,
    }


#: First jaxlib release whose XLA aborts the process (``Check failed: buffer != nullptr`` in
#: ``CalculateLaunchDimensions``, from ``AnalyticalLatencyEstimator::NodeCost``) when it
#: schedules a ZeRO-3 step with micro-batches under ``xla_gpu_enable_analytical_latency_estimator``:
#: seen with jaxlib 0.11.2 on GPU machines (the 303M and a 4-layer GPT, cuDNN and XLA attention;
#: BENCHMARKS.md section 13), where 0.10.2 compiles the same programs for compile-only GPUs.
#: jaxdp does not set that option from this release on; an ``XLA_FLAGS`` that names it still
#: wins.
ANALYTICAL_ESTIMATOR_BROKEN: Final[Version] = (0, 11, 0)


def xla_compiler_options(
    config: DDPConfig,
    jaxlib_version: str | Version | None = None,
    *,
    dp_size: int | None = None,
    latency_hiding_scheduler: bool = True,
    bucket_numel: int | None = None,
) -> dict[str, bool | int]:
    """The settings of :func:`xla_flags` as per-executable XLA compiler options.

    Pass them as ``jax.jit(f, compiler_options=...)`` or ``lowered.compile(compiler_options=...)``:
    unlike ``XLA_FLAGS`` they work after the backend has started, and only for that program.

    Example:
        >>> opts = xla_compiler_options(DDPConfig(bucket_size=1_000_000), "0.10.2", dp_size=8)
        >>> opts["xla_gpu_enable_latency_hiding_scheduler"]
        True
    """
    version = _resolve_version(jaxlib_version)  # checked below, once the names are known
    opts: dict[str, bool | int] = {}
    opts.update(combine_thresholds(config, dp_size=dp_size, bucket_numel=bucket_numel))
    if latency_hiding_scheduler:
        opts["xla_gpu_enable_latency_hiding_scheduler"] = True
    # Pinned to their defaults: a future default change must not undo the buckets' overlap.
    opts["xla_gpu_enable_highest_priority_async_stream"] = True
    opts["xla_gpu_experimental_enable_heuristic_collective_combining"] = False
    if config.zero_stage == 3 and config.num_microbatches == 1:
        # ZeRO-3 gathers a scanned layer's params inside the loop body; the collective
        # pipeliner starts iteration i+1's gather during iteration i's GEMMs (checked on the
        # program compiled for compile-only GPUs in tests/test_xla_flags.py: without it the
        # gather is exposed). Not with micro-batches: it would pipeline the micro-batch loop
        # too, keeping the next micro-batch's gathered params alive through this one's backward
        # (measured with bench/bench_memory_gpu.py's MLP at G = 4: the bytes per parameter nearly
        # doubled).
        opts["xla_gpu_enable_pipelined_all_gather"] = True
    elif config.zero_stage == 3 and version < ANALYTICAL_ESTIMATOR_BROKEN:
        # With micro-batches ZeRO-3 runs every one of them in one loop body
        # (jaxdp._src.strategy.kernels.InGrad), whose backward both re-gathers params and
        # reduce-scatters gradients. With XLA's default cost model the scheduler finished the
        # body's backward gathers back to back, first thing; with the analytical one it
        # interleaves them with the backward's GEMMs, which shrinks the temporaries of
        # bench/bench_memory_gpu.py's MLP at G = 4 (BENCHMARKS.md section 13). Not on
        # jaxlib 0.11: its GPU compiler aborts the whole process in that cost model on these
        # programs (see ANALYTICAL_ESTIMATOR_BROKEN), so there the scheduler keeps its default
        # model.
        opts["xla_gpu_enable_analytical_latency_estimator"] = True
    _version_for(version, frozenset(opts))
    return {k: v for k, v in opts.items() if _BY_NAME[k].available(version)}


def xla_flags(
    config: DDPConfig,
    jaxlib_version: str | Version | None = None,
    *,
    dp_size: int | None = None,
    latency_hiding_scheduler: bool = True,
    bucket_numel: int | None = None,
) -> list[str]:
    """XLA GPU flags that keep ``config``'s buckets intact and overlappable.

    Returns ``--flag=value`` strings for ``XLA_FLAGS``: the all-reduce, reduce-scatter and
    all-gather combine thresholds of :func:`combine_thresholds`, the latency-hiding scheduler,
    and two defaults pinned (async collectives on the high-priority stream; XLA's heuristic
    combining, which would override the thresholds, off); at ``zero_stage=3`` with one
    micro-batch also XLA's collective pipeliner for all-gathers in loops, so the next scanned
    layer's params are gathered during this layer's compute. Only flags that ``jaxlib_version``
    accepts are emitted (``FLAG_TABLE``); an unknown flag in ``XLA_FLAGS`` aborts the process.

    Args:
        config: the :class:`DDPConfig` of the training run.
        jaxlib_version: the jaxlib release the flags are for (e.g. ``"0.10.2"``); ``None`` for
            the installed one.
        dp_size: size of the data axis; makes the reduce-scatter threshold exact and resolves
            ``bucket_size="auto"``.
        latency_hiding_scheduler: add ``--xla_gpu_enable_latency_hiding_scheduler=true``.
        bucket_numel: the layout's bucket size in elements, where the config alone cannot
            say it (``num_buckets``; see :func:`combine_thresholds`).

    Example:
        >>> cfg = DDPConfig(zero_stage=1, bucket_size=4_000_000, param_dtype="bfloat16")
        >>> for f in xla_flags(cfg, "0.10.2", dp_size=8):
        ...     print(f)
        --xla_gpu_all_reduce_combine_threshold_bytes=7999999
        --xla_gpu_reduce_scatter_combine_threshold_bytes=999999
        --xla_gpu_all_gather_combine_threshold_bytes=7999999
        --xla_gpu_enable_latency_hiding_scheduler=true
        --xla_gpu_enable_highest_priority_async_stream=true
        --xla_gpu_experimental_enable_heuristic_collective_combining=false
    """
    opts = xla_compiler_options(
        config,
        jaxlib_version,
        dp_size=dp_size,
        latency_hiding_scheduler=latency_hiding_scheduler,
        bucket_numel=bucket_numel,
    )
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items()]


def _set_in_xla_flags() -> dict[str, str]:
    """The options ``XLA_FLAGS`` sets, by name (``--name=value``; ``""`` for ``--name``)."""
    pairs = (f.lstrip("-").split("=", 1) for f in os.environ.get("XLA_FLAGS", "").split())
    return {p[0]: p[1] if len(p) > 1 else "" for p in pairs}


@functools.cache
def _accepted(items: tuple[tuple[str, Any], ...], device: Any) -> bool:
    """Whether ``device``'s XLA compiles a scalar program with these options (asked once per
    process: every engine of a run, and each variant of a benchmark, asks the same)."""
    import jax

    spec = jax.ShapeDtypeStruct((), np.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(items)).lower(spec).compile()
    except Exception as e:  # XLA's INVALID_ARGUMENT surfaces as a JaxRuntimeError
        if "compile option" in str(e):
            return False
        raise
    return True


def known_options(opts: dict[str, Any], device: Any) -> dict[str, Any]:
    """``opts`` less the options this XLA refuses ("No such compile option"), each dropped
    with a warning: a jaxlib newer than :data:`FLAG_TABLE` may have removed one, and a
    per-executable option XLA does not know fails the compile. Probed by compiling a scalar
    program on ``device`` (tens of milliseconds).

    Example:
        >>> import jax, warnings
        >>> with warnings.catch_warnings(record=True):
        ...     known_options({"xla_gpu_enable_latency_hiding_scheduler": True,
        ...                    "xla_gone_flag": 1}, jax.devices()[0])
        {'xla_gpu_enable_latency_hiding_scheduler': True}
    """

    def accepted(o: dict[str, Any]) -> bool:
        return _accepted(tuple(sorted(o.items())), device)

    if not opts or accepted(opts):
        return opts
    kept = {k: v for k, v in opts.items() if accepted({k: v})}
    warnings.warn(
        f"xla_compiler_options: this jaxlib's XLA has no option {sorted(set(opts) - set(kept))}; "
        "the step compiles without it. Fix: update jaxdp's FLAG_TABLE for this release (or "
        "pass compiler_options=None and set XLA_FLAGS yourself).",
        stacklevel=3,
    )
    return kept


def engine_compiler_options(
    compiler_options: object,
    config: DDPConfig,
    *,
    dp_size: int,
    platform: str,
    device: Any = None,
    bucket_numel: int | None = None,
) -> dict[str, bool | int] | None:
    """``DataParallel(compiler_options=...)`` resolved into the step's ``jax.jit`` options.

    ``None``: none (XLA's defaults and ``XLA_FLAGS``). ``"jaxdp"``: on GPU meshes,
    :func:`xla_compiler_options` for ``config`` and ``dp_size`` less every option ``XLA_FLAGS``
    names (the process's flags win, as with :func:`apply_xla_flags`); nothing on other
    platforms, as every option is an XLA GPU one. On a jaxlib newer than the flag table, the
    options it was not seen to accept are first tried on ``device`` (:func:`known_options`).
    A dict: exactly those options. ``bucket_numel``: the layout's bucket size
    (:func:`combine_thresholds`; the engine passes it with ``num_buckets``).

    Example:
        >>> cfg = DDPConfig(zero_stage=1, bucket_size=1_000_000)
        >>> engine_compiler_options("jaxdp", cfg, dp_size=8, platform="cpu") is None
        True
        >>> opts = engine_compiler_options("jaxdp", cfg, dp_size=8, platform="gpu")
        >>> opts["xla_gpu_reduce_scatter_combine_threshold_bytes"]
        249999
    """
    if compiler_options is None:
        return None
    if isinstance(compiler_options, dict):
        bad = [k for k in compiler_options if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"DataParallel: compiler_options has key {bad[0]!r} "
                f"({type(bad[0]).__name__}); expected XLA option names (str), e.g. "
                "{'xla_gpu_enable_latency_hiding_scheduler': True}."
            )
        return dict(compiler_options) or None
    if compiler_options != "jaxdp":
        raise ValueError(
            f"DataParallel: compiler_options={compiler_options!r}; expected None (XLA's "
            "defaults and XLA_FLAGS), 'jaxdp' (jaxdp.xla_compiler_options for the config, on "
            "GPU meshes) or a dict of XLA options. Fix: e.g. compiler_options='jaxdp'."
        )
    if platform not in ("gpu", "cuda", "rocm"):
        return None
    taken = _set_in_xla_flags()
    mine = xla_compiler_options(config, dp_size=dp_size, bucket_numel=bucket_numel)
    opts = {k: v for k, v in mine.items() if k not in taken}
    version = _resolve_version(None)
    seen = SEEN_ACCEPTED.get(version[:3], frozenset())
    if device is not None and version > NEWEST_CHECKED and not set(opts) <= seen:
        opts = known_options(opts, device)  # a release the table has not checked: ask its XLA
    return opts or None


def with_passes_off(opts: dict[str, Any] | None, passes: tuple[str, ...]) -> dict[str, Any] | None:
    """``opts`` with the XLA passes ``passes`` added to ``xla_disable_hlo_passes``.

    Merged, not replaced: the passes ``opts`` already turns off, or else those ``XLA_FLAGS``
    does (a per-program option takes the place of the flag's whole list), stay off.

    Example:
        >>> with_passes_off({"xla_disable_hlo_passes": "cse"}, ("all-reduce-contiguous",))
        {'xla_disable_hlo_passes': 'cse,all-reduce-contiguous'}
        >>> with_passes_off(None, ()) is None
        True
    """
    if not passes:
        return opts
    key = "xla_disable_hlo_passes"
    given = str(opts[key]) if opts and key in opts else _set_in_xla_flags().get(key, "")
    names = [n for n in given.split(",") if n]
    return {**(opts or {}), key: ",".join(names + [p for p in passes if p not in names])}


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", None)
    if started is not None:
        return bool(started())
    return bool(getattr(xla_bridge, "_backends", {}))  # pragma: no cover - older jax


def apply_xla_flags(
    config: DDPConfig,
    jaxlib_version: str | Version | None = None,
    *,
    dp_size: int | None = None,
    latency_hiding_scheduler: bool = True,
    bucket_numel: int | None = None,
) -> list[str]:
    """Add :func:`xla_flags` to the ``XLA_FLAGS`` environment variable, before XLA starts.

    Must run before the first backend starts (before ``jax.devices()``, the first array or the
    first compilation; importing jax is fine), because XLA reads ``XLA_FLAGS`` only then. Flags
    already in ``XLA_FLAGS`` win over jaxdp's. Returns the flags it added. With
    ``num_buckets``, pass ``bucket_numel`` (:func:`combine_thresholds`).

    Raises:
        RuntimeError: a JAX backend has already started, so the flags would be silently ignored.

    Usage, at the top of a training script::

        import jaxdp
        config = jaxdp.DDPConfig(zero_stage=1, bucket_size=40_000_000, param_dtype="bfloat16")
        jaxdp.apply_xla_flags(config, dp_size=8)  # before anything starts a backend
        import jax
        mesh = jaxdp.make_mesh()

    Example:
        >>> import jax
        >>> _ = jax.devices()  # the backend has started: too late
        >>> apply_xla_flags(DDPConfig())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: apply_xla_flags: a JAX backend has already started, ...
    """
    if _backend_started():
        raise RuntimeError(
            "apply_xla_flags: a JAX backend has already started, and XLA reads XLA_FLAGS only "
            "when the first backend starts, so these flags would be silently ignored. Fix: call "
            "jaxdp.apply_xla_flags(config) at the top of your script, before jax.devices(), "
            "jax.distributed.initialize() or any array is created; or pass "
            "compiler_options=jaxdp.xla_compiler_options(config, dp_size=...) to jax.jit / "
            "lowered.compile(), which works at any time."
        )
    flags = xla_flags(
        config,
        jaxlib_version,
        dp_size=dp_size,
        latency_hiding_scheduler=latency_hiding_scheduler,
        bucket_numel=bucket_numel,
    )
    current = os.environ.get("XLA_FLAGS", "").split()
    present = _set_in_xla_flags()
    added = [f for f in flags if f.lstrip("-").split("=", 1)[0] not in present]
    os.environ["XLA_FLAGS"] = " ".join([*current, *added])
    return added
