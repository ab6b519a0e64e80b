"""``DDPConfig``: the validated, frozen configuration of jaxdp's gradient machinery.

Field names follow Megatron-LM's ``DistributedDataParallelConfig`` where one exists, so a Megatron
user can carry settings over. Every value is checked in ``__post_init__`` and a bad one raises a
``ValueError`` or ``TypeError`` that names the field, shows what was given, says what is allowed
and how to fix it, before anything is traced or compiled (the checks:
:mod:`jaxdp._src.config.checks`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import os
from collections.abc import Callable
from typing import Any, Literal

import yaml

from .checks import (
    AUTO_BUCKET_SIZE,
    REMAT_POLICIES,
    _did_you_mean,
    check_combinations,
    check_fields,
)

__all__ = ["DDPConfig", "AUTO_BUCKET_SIZE", "REMAT_POLICIES", "default_bucket_size"]


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: ``max(40_000_000, 1_000_000 * dp_size)``.

    Example:
        >>> default_bucket_size(8)
        40000000
        >>> default_bucket_size(64)
        64000000
    """
    return max(40_000_000, 1_000_000 * int(dp_size))


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
            the backward pass. As in Megatron, ``False`` forces one bucket per buffer; with
            micro-batches it also runs the last one in the loop with the others (stages 0-1
            otherwise peel it out, so that its backward overlaps the reduction after the loop),
            so the model compiles once instead of twice.
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
        data_axis: Name of the mesh axis that data parallelism runs over; or two names
            ``(outer, inner)`` of a two-level mesh you pass (MaxText's DCN x ICI, e.g.
            ``jax.make_mesh((nodes, gpus), ("dcn", "ici"))``): the outer axis indexes the
            distributed-optimizer instances (see ``num_distributed_optimizer_instances``,
            which may be left at 1 or must match it); without a mesh, the default one is
            grouped into ``num_distributed_optimizer_instances`` instances with these names.
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
            Default ``False``, from the program compiled for compile-only GPUs
            (``bench/bench_memory_gpu.py``, BENCHMARKS.md section 4): at ``G = 1`` it overlaps
            every gather but the first with forward GEMMs (at the end of the step they overlap
            only splitting the previous bucket), but the per-device total grows a little; with
            ``G = 4`` the gathered params stay live through the micro-batch loop next to their
            unpacked copies, which costs more. Turn it on at ``G = 1`` when the exposed
            end-of-step gathers cost more than the memory it adds.
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
            again. ``"gemm"`` (default): the outputs of ``dot_general`` without batch
            dimensions (the GEMMs of dense layers and attention projections) and of batched
            ones no larger than their larger operand (XLA's attention context, not its
            ``T x T`` scores), of cuDNN fused attention
            (``jax.nn.dot_product_attention(implementation="cudnn")``: its output and softmax
            statistics, no ``T x T`` scores), and the operands of batched
            ``dot_general`` s that are not params: with XLA's attention, each layer's
            queries, keys, values and softmax probabilities (stage 3 names them in the loss,
            :mod:`jaxdp._src.zero3.dot_operands`, so the backward pass does not rebuild them from
            the
            projections); norms and activations are recomputed, so XLA fuses them into their
            consumers instead of writing them out. ``"dots"``: also the outputs of every
            batched ``dot_general`` (XLA's attention scores too) and convolution.
            ``"everything"``: every intermediate but the gathered params (jaxdp before this
            field). ``"nothing"``: recompute the whole forward pass. Compiled for compile-only
            GPUs (``bench/bench_remat.py``, GPTs with XLA's attention), ``"gemm"`` has the
            smallest peak of the four and, with ``"dots"``, the least non-GEMM memory traffic,
            below the GSPMD ZeRO-1 peer's (BENCHMARKS.md section 11) and the bare step's;
            ``"everything"`` moves the most, since every saved residual is written out.
            ``"gemm"`` recomputes each layer's attention scores (fp32, ``T x T`` per head),
            which ``"dots"`` keeps. On a GPU (BENCHMARKS.md section 13), stage 3's step with either
            policy costs a few percent of device time over the bare step at a fraction of its
            memory (with cuDNN attention, recomputing the attention output cost more than
            saving it); saving every intermediate had cost far more time.
            Limitation: a policy sees shapes, not provenance, so a GEMM whose operands both
            come from gathered params only (e.g. a low-rank ``A @ B`` weight) is saved by
            every policy but ``"nothing"`` (its operands are still gathered again for their
            gradients).
            Stages 0-2 do not rematerialise, so another value there is an error (wrap your
            ``loss_fn`` in ``jax.checkpoint`` yourself). Nor does stage 3 with one shard (one
            rank, or one per instance): its gathers are identities, nothing is gathered
            again, and it computes what stage 2 does (BENCHMARKS.md section 18).
        model_state_sync: how the ranks combine the non-trainable state
            (``DataParallel.init(params, model_state=...)``: BatchNorm statistics and the
            like) at the end of each step, after each rank has updated its copy over its
            micro-batches in order. ``"mean"`` (default): the mean over the data-parallel
            group (floating leaves, summed in fp32; integer leaves such as counters take
            rank 0's value), right for running statistics. ``"broadcast"``: rank 0's state
            (PyTorch DDP's ``broadcast_buffers``).
        grad_norm_skip_threshold: Megatron's name. When the global gradient norm exceeds it,
            or is not finite, the step skips its update inside the compiled program: params,
            master copy, optimizer state, model state and step counter stay bit-unchanged and
            ``metrics["skipped"]`` is 1 (0 otherwise). ``None`` (default): off.
        check_for_large_grads: Megatron's name. Each bucket's gradient norm is compared with
            10x the largest of its last 100 values (kept in ``TrainState.grad_history`` and
            checkpointed; the check starts once 10 are recorded); a bucket over it skips the
            step the same way and ``metrics["large_grad_bucket"]`` is its index in
            ``engine.layout.buckets`` (-1 otherwise).
        num_distributed_optimizer_instances: Megatron's name. ``N > 1`` splits the ``dp``
            data ranks into ``N`` instances of ``dp / N`` consecutive devices (in
            ``jax.devices()`` order: one host's devices together), hierarchical data
            parallelism: each bucket is reduce-scattered within its instance (over the fast
            intra-node links, every micro-batch where the stage does so) and the instance's
            shard is combined across instances once per step, after the last micro-batch
            (over the slow inter-node links, ``1 / (dp / N)`` of the bytes). The engine's
            mesh becomes ``(data_axis + "_outer", data_axis + "_inner")``; a ``loss_fn``
            collective over the whole group names both axes. Stages 1-3 (stage 0 is an
            error: use stage 1, the same communication). Default 1: flat.
        outer_dp_sharding_strategy: Megatron's name, with ``N > 1``: ``"no_shard"``
            (default, HSDP) all-reduces the instance's shard across instances, so the master
            weights and optimizer state are sharded ``dp / N`` ways and replicated across
            instances; ``"optim"`` reduce-scatters it instead and shards them ``dp`` ways
            (1/dp per device), all-gathering the updated shard back across instances.
        exp_avg_dtype: Megatron's name. Storage dtype of Adam's first moment (optax's
            ``mu``): ``"float32"`` (default: as optax keeps it) or ``"bfloat16"`` (also
            Megatron's ``"fp32"`` / ``"bf16"``). The moments are stored at this dtype,
            sharded as the rest of the optimizer state, widened to float32 before each optax
            update and rounded to nearest after it, so the arithmetic stays float32 (as in
            Megatron's precision-aware optimizer; no stochastic rounding). Checkpoints keep the
            dtype; restoring into an engine with another one casts. For optax's Adam-family
            states (adam, adamw, nadam, lamb, amsgrad, adabelief, lion:
            :data:`jaxdp._src.optim.known.MOMENT_STATES`); another optimizer is refused at
            ``init``. ``"float16"`` is refused: the moments underflow its range
            (docs/numerics.md).
        exp_avg_sq_dtype: Megatron's name. The same for the second moment (optax's ``nu``,
            and amsgrad's ``nu_max``). Lion keeps none: leave it ``"float32"`` there.
        num_buckets: Megatron's name. Cut each buffer into this many buckets of about equal
            size instead of closing them at ``bucket_size``: bucket boundaries stay at
            parameter boundaries, a bucket closes after the parameter that reaches the next
            ``1/num_buckets`` of the buffer, so there are ``num_buckets`` of them when no
            parameter is larger than that share (fewer otherwise). Replaces
            ``bucket_size="auto"``; with an explicit ``bucket_size`` (an int, or ``None``)
            it is an error. ``overlap_grad_reduce=False`` still makes each buffer one bucket.
            ``None`` (default): buckets by ``bucket_size``.
        optimizer_cpu_offload: Megatron's name. Keep the optimizer state and the fp32 master
            weights in pinned host memory between steps (``memory_kind="pinned_host"``): the
            update brings them into device memory bucket by bucket, updates that bucket and
            writes it back, each bucket's transfer in waiting for the previous bucket's
            update so that about two buckets of it are on the device at once, and the copies
            back overlapping the next bucket's update. The update is the same operations in
            the same dtypes, so the values are bit-equal to the on-device run's; only where
            they live changes. It saves device memory at the price of host <-> device
            traffic every step (docs/training.md). Where the optimizer mixes buckets (e.g. an
            ``optax.clip_by_global_norm`` inside the chain; jaxdp's own ``clip_grad`` does
            not), the whole state is brought in at once instead. Any ``zero_stage``; at
            ``zero_stage=0`` without a master copy (fp32 params) only the optimizer state
            moves.
        optimizer_offload_fraction: Megatron's name. The share of the optimizer state (by
            element count) kept in host memory with ``optimizer_cpu_offload``, in ``(0, 1]``:
            the first buckets of ``engine.layout.buckets`` (the last parameters, whose
            gradients are reduced first) until their elements reach this share; the rest
            stay on the device. ``1.0`` (default): all of it.

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
    data_axis: str | tuple[str, str] = "data"
    own_bucket_param_patterns: tuple[str, ...] = ()
    bucket_layout: Literal["interleaved", "megatron"] = "interleaved"
    gradient_accumulation_fusion: bool = False
    overlap_param_gather: bool = False
    expert_axis: str | None = None
    expert_param_patterns: tuple[str, ...] = ()
    scan_layers: bool = True
    scan_param_patterns: tuple[tuple[str, int], ...] = ()
    remat_policy: Literal["gemm", "dots", "everything", "nothing"] = "gemm"
    model_state_sync: Literal["mean", "broadcast"] = "mean"
    grad_norm_skip_threshold: float | None = None
    check_for_large_grads: bool = False
    num_distributed_optimizer_instances: int = 1
    outer_dp_sharding_strategy: Literal["no_shard", "optim"] = "no_shard"
    exp_avg_dtype: str = "float32"
    exp_avg_sq_dtype: str = "float32"
    num_buckets: int | None = None
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        self._check_fields()
        self._check_combinations()

    def _check_fields(self) -> None:
        check_fields(self)

    def _check_combinations(self) -> None:
        check_combinations(self)

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

    @property
    def hierarchical(self) -> bool:
        """Whether the data ranks form distributed-optimizer instances
        (``num_distributed_optimizer_instances > 1``, or a two-level ``data_axis``)."""
        return self.num_distributed_optimizer_instances > 1 or isinstance(self.data_axis, tuple)

    def resolve_bucket_size(self, dp_size: int) -> int | None:
        """The bucket size in elements for ``dp_size`` ranks (``None`` = one bucket per buffer).

        ``"auto"`` becomes ``max(40_000_000, 1_000_000 * dp_size)``; with
        ``overlap_grad_reduce=False`` every buffer is a single bucket, as in Megatron. With
        ``num_buckets`` the size depends on the params, so this is ``None`` and the layout
        cuts the buckets (:attr:`jaxdp.BucketLayout.bucket_size` is the size it chose).
        """
        if not self.overlap_grad_reduce or self.bucket_size is None or self.num_buckets:
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
        if isinstance(self.data_axis, tuple):
            out["data_axis"] = list(self.data_axis)
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
