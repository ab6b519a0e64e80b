"""The plan: every variant question of an engine, decided once in ``DataParallel.init``.

:func:`build_plan` reads the config, the mesh, the params (and an example batch) and decides:

* the **group** (:class:`jaxdp._src.topology.group.ReductionGroup`): who reduces with whom;
* the **sharding** of the params over the mesh's other axes
  (:class:`jaxdp._src.topology.sharding.ShardingPlan`; trivial on a 1-D mesh) and so the **bucket
  operations** (:func:`_ops`: nested regions on tensor-parallel meshes, per-parameter
  collectives at stages 1-2, :mod:`jaxdp._src.comm.per_param`);
* the **layout** (:class:`jaxdp.BucketLayout`, with the scanned layer stacks ZeRO-3 gathers
  per layer), its bucket size (``bucket_size="auto"`` across nodes: the alpha-beta rule of
  :mod:`jaxdp._src.topology.links`) and what the link model predicts for it;
* the **strategy** (:mod:`jaxdp._src.strategy.strategy`), with its codecs and gradient kernel;
* the **state policy** of ``optimizer_cpu_offload``: which buckets' master weights and
  optimizer state live in host memory (:func:`offload_of`);
* the optimizer state's **storage dtypes** (:func:`state_policy`: Adam's moments in bfloat16);
* the gradient mean's **divisor carried by the loss** (:mod:`jaxdp._src.strategy.loss_divisor`),
held by
  the operations that reduce, which the kernel that differentiates reads it from.

It is the only reader of ``zero_stage``, ``overlap_param_gather``, ``expert_axis``, the mesh
kind and the scan stacks; the step, the checkpoints and the reports ask the strategy.
Unsupported combinations are the rows of :data:`UNSUPPORTED`, checked before anything is
built.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ..comm.nested import NestedOps, PlainOps
from ..comm.per_param import AllReduceOps, PerParamOps
from ..comm.public import wire_of
from ..comm.wire import Wire
from ..config.config import AUTO_BUCKET_SIZE, DDPConfig
from ..core.loss import UnboundAxis
from ..forms.codec import (
    HOST,
    BlockCodec,
    Codec,
    InterleavedCodec,
    MegatronCodec,
    Offload,
    ParamCodec,
    StatePolicy,
)
from ..layout.layout import BucketLayout, rules_of
from ..optim.check import check_optimizer
from ..optim.known import MOMENT_STATES, moment_roles, state_names
from ..platform.gemm_padding import unaligned
from ..topology.group import ReductionGroup
from ..topology.links import BucketChoice, auto_bucket_bytes, nodes_of, ring_link
from ..topology.sharding import ShardingPlan
from ..zero3.dot_operands import name_batched_dot_operands
from ..zero3.gather import gathers_per_parameter, zero3_value_and_grad
from ..zero3.remat import remat_policy_for
from ..zero3.scan import find_stacks, zero3_scan_value_and_grad
from .kernels import (
    AtEnd,
    Buckets,
    EachMicrobatch,
    InGrad,
    Kernel,
    PerParameter,
    Sharded,
)
from .loss_divisor import loss_divisor
from .spec import StepSpec
from .strategy import Replicated, ShardedOpt, ShardedParams, Strategy

__all__ = [
    "UNSUPPORTED",
    "Plan",
    "build_plan",
    "check_engine_args",
    "check_supported",
    "bucket_choice",
    "unbound_axis_error",
    "finds_stacks",
    "names_dot_operands",
    "offload_of",
    "per_parameter_all_reduce",
    "per_parameter_collectives",
    "reduces_per_parameter",
    "rematerialises",
    "state_policy",
]


# ------------------------------------------------------------------ the variant questions
# Every rule the plan applies, here and nowhere below it: the modules below get the answers.


def _all_to_all(config: DDPConfig) -> bool:
    """Whether gradients reduce-scatter through an ``all_to_all`` and a local sum in rank
    order (the fp32-accumulation and deterministic modes), which sum explicit buckets."""
    return config.reduce_scatter_with_fp32_accumulation or config.deterministic_reduction


def per_parameter_collectives(config: DDPConfig, layout: BucketLayout) -> bool:
    """Whether a stage-1/2 engine with params whole on each device reduces and gathers per
    parameter: the interleaved layout without scanned stacks, a reduce-scatter on the wire
    (the all_to_all modes sum explicit buckets)."""
    return layout.kind == "interleaved" and not layout.stacked and not _all_to_all(config)


def per_parameter_all_reduce(config: DDPConfig, layout: BucketLayout) -> bool:
    """Whether a stage-0 engine with params whole on each device all-reduces per parameter:
    a ``psum`` on the wire (the all_to_all modes reduce-scatter explicit, padded buckets) over
    the contiguous layout without scanned stacks. On every platform: on GPUs with
    :data:`jaxdp._src.comm.per_param.PASSES_OFF` for the step
    (:meth:`jaxdp._src.comm.per_param.AllReduceOps.passes_off`).

    Compiled for compile-only GPUs (BENCHMARKS.md section 7), it compiles faster than the
    bucketed path, close to plain ``jit``, since the updates no longer read slices of a bucket
    at their own offsets, which XLA's multi-output fusion had merged into a few large kernels,
    each compiled on its own; and the 100.7M GPT moves slightly less gradient traffic per step
    than with buckets, with no gradient concatenation."""
    return layout.kind == "contiguous" and not layout.stacked and not _all_to_all(config)


def reduces_per_parameter(config: DDPConfig, layout: BucketLayout) -> bool:
    """Whether ZeRO-3 also reduce-scatters every gradient per parameter and accumulates it in
    an array of its own (one per parameter, :class:`jaxdp._src.comm.per_param.PerParamOps`): gathers
    per parameter, and every bucket's gradient reduced on a bf16 wire by ``psum_scatter``
    (:func:`jaxdp._src.zero3.gather.make_leaf_gather`). One accumulator per bucket would make each
    reduced gradient
    the concatenation of its bucket's pieces, which XLA fuses into every parameter's update
    (no memory traffic) but which makes each update a kernel of its own."""
    return (
        gathers_per_parameter(layout)
        and not _all_to_all(config)
        and all(jnp.dtype(b.grad_dtype).itemsize < 4 for b in layout.buckets)
    )


def finds_stacks(config: DDPConfig) -> bool:
    """Whether ``config`` gathers scanned layer stacks per layer (stage 3, ``scan_layers``,
    the interleaved layout; the plan asks, on meshes without tensor-parallel params)."""
    return (
        config.zero_stage == 3
        and config.scan_layers
        and config.bucket_layout == "interleaved"
        and not config.hierarchical  # instances gather whole stacks (docs/parallelism.md)
    )


def rematerialises(config: DDPConfig, group: ReductionGroup) -> bool:
    """Whether stage 3 wraps the loss in ``jax.checkpoint`` with ``remat_policy``
    (:func:`jaxdp._src.zero3.remat.remat_policy_for`): where its params are split into more
    than one shard.

    The checkpoint is there so that the backward pass gathers the params again instead of
    keeping them gathered from the forward pass. With one shard (one rank, or one per
    instance) every gather is an identity and the params are whole on the device: there is
    nothing to gather again, and a checkpoint would only make the backward pass recompute
    what the forward pass computed (norms, activations, casts), as stages 0-2 do not. Without
    it one rank's step computes what stage 2's does (the same params bit for bit,
    ``tests/test_remat_policy.py``) with stage 2's kernels and memory: compiled for one
    compile-only GPU (BENCHMARKS.md section 18) it moves as many bytes as stages 0-2 instead
    of 15% more, and needs their peak, not the smaller one the recompute bought. Wrap
    ``loss_fn`` in ``jax.checkpoint`` to trade that time for memory on one rank, as at
    stages 0-2.

    Example:
        >>> import jax
        >>> from jaxdp import DDPConfig, make_mesh
        >>> from jaxdp._src.topology.group import ReductionGroup
        >>> cfg = DDPConfig(zero_stage=3)
        >>> rematerialises(cfg, ReductionGroup(make_mesh(jax.devices()[:1]), "data"))
        False
    """
    return config.zero_stage == 3 and group.shard_count > 1


def names_dot_operands(config: DDPConfig) -> bool:
    """Whether stage 3 names the operands of the loss's batched dots
    (:func:`jaxdp._src.zero3.dot_operands.name_batched_dot_operands`): for the policies that save
    them.

    Example:
        >>> from jaxdp import DDPConfig
        >>> names_dot_operands(DDPConfig(zero_stage=3)), names_dot_operands(
        ...     DDPConfig(zero_stage=3, remat_policy="nothing"))
        (True, False)
    """
    return config.remat_policy in ("gemm", "dots")


def offload_of(config: DDPConfig, layout: BucketLayout, mesh: Any) -> Offload | None:
    """The state policy of ``optimizer_cpu_offload`` (``None`` when it is off): the first
    buckets of ``layout`` until their elements reach ``optimizer_offload_fraction`` of all
    (Megatron offloads a share of the optimizer state; the first buckets hold the last
    parameters, whose gradients are reduced first).

    Raises ``ValueError`` on devices without a pinned host memory (compile-only devices: their
    programs are compiled by ``jaxdp.aot.cross_compile_step``)."""
    if not config.optimizer_cpu_offload:
        return None
    try:
        kind = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=HOST)
        ok = kind.memory_kind == HOST
    except (ValueError, RuntimeError):
        ok = False
    if not ok:
        dev = mesh.devices.flat[0]
        raise ValueError(
            "DDPConfig.optimizer_cpu_offload: got True; expected devices with a "
            f"{HOST!r} memory, but {dev.platform} device {dev.id} has none (compile-only "
            "devices have no memories). Fix: build the engine on devices that run (for a "
            "compile-only GPU program, on CPU devices and compile it with "
            "jaxdp.aot.cross_compile_step), or set optimizer_cpu_offload=False."
        )
    total = sum(b.numel for b in layout.buckets)
    chosen: list[int] = []
    acc = 0
    for i, b in enumerate(layout.buckets):
        if acc >= config.optimizer_offload_fraction * total:
            break
        chosen.append(i)
        acc += b.numel
    return Offload(frozenset(chosen))


def fences_backward(config: DDPConfig, layout: BucketLayout, platform: str = "gpu") -> bool:
    """Stages 0-2 with a weight whose GEMM widths are off XLA's grid (a width of 724 bf16
    elements): the loss is differentiated behind a fence, so that XLA:GPU cannot build the
    backward's padded copies of such weights in the forward pass
    (:mod:`jaxdp._src.platform.gemm_padding`). Compiled for compile-only GPUs, this takes
    most of those copies off the temporaries of an MLP of width 724 at stages 0-2; on aligned
    widths the fence only costs memory, so it is left out there (BENCHMARKS.md section 4).
    Stage 3 rematerialises with its gathers already: the backward's params are gathered
    again, not kept. XLA:GPU only (``platform``): the padding is its split-K rewrite's, and on
    XLA:CPU the fence would change the program for nothing."""
    if config.zero_stage == 3 or platform == "cpu":
        return False
    work = [(s.path, s.shape, layout.buckets[s.bucket].dtype) for s in layout.slots]
    return bool(unaligned(work))


def unbound_axis_error(where: str, name: str, bound: tuple[str, ...], data_axis: Any) -> ValueError:
    """The error for a ``loss_fn`` collective over ``name`` where only ``bound`` are bound."""
    names = " and ".join(repr(a) for a in bound)
    return ValueError(
        f"{where}: loss_fn runs a collective over the axis name {name!r} (e.g. "
        f"nn.BatchNorm(axis_name={name!r}) or jax.lax.pmean(x, {name!r})), but the step binds "
        f"only {names} (DDPConfig.data_axis={data_axis!r}), so jax cannot resolve it. "
        f"Fix: DDPConfig(data_axis={name!r}) (the default mesh then names its axis {name!r}; "
        f"a mesh you pass needs it too, e.g. jaxdp.make_mesh(axis={name!r})), or use "
        f"axis_name={data_axis!r} in the model."
    )


def _expert_zero(config: DDPConfig, sharding: ShardingPlan | None) -> str | None:
    if config.expert_axis is None or config.zero_stage == 0:
        return None
    return (
        f"DataParallel: expert_axis={config.expert_axis!r} with zero_stage={config.zero_stage} "
        "is not implemented yet (expert buffers would need their own ZeRO shard over the "
        "expert-data-parallel group); expected zero_stage=0. Fix: use zero_stage=0 with "
        "expert parallelism."
    )


def _megatron_split(config: DDPConfig, sharding: ShardingPlan | None) -> str | None:
    if sharding is None or sharding.trivial or config.zero_stage == 0:
        return None
    if config.bucket_layout != "megatron":
        return None
    return (
        "DataParallel: bucket_layout='megatron' with parameters split over "
        f"{sharding.auto_axes} is not implemented; expected bucket_layout='interleaved' (the "
        "default) on a multi-axis mesh. Fix: drop bucket_layout='megatron'."
    )


#: The combinations jaxdp refuses, one row each: ``check(config, sharding) -> message or
#: None`` (``sharding`` is ``None`` before ``init`` has seen the params).
UNSUPPORTED: tuple[Callable[[DDPConfig, ShardingPlan | None], str | None], ...] = (
    _expert_zero,
    _megatron_split,
)


def check_supported(config: DDPConfig, sharding: ShardingPlan | None = None) -> None:
    """Raise ``NotImplementedError`` for the first row of :data:`UNSUPPORTED` that applies."""
    for row in UNSUPPORTED:
        msg = row(config, sharding)
        if msg is not None:
            raise NotImplementedError(msg)


def check_engine_args(loss_fn: Any, optimizer: Any, config: Any) -> None:
    """Refuse ``DataParallel``'s arguments of the wrong kind, then unsupported configs
    (:func:`check_supported`), before anything is built."""
    if not callable(loss_fn):
        raise TypeError(
            f"DataParallel: loss_fn is a {type(loss_fn).__name__}; expected a callable "
            "loss_fn(params, microbatch) -> loss. Fix: pass the function itself."
        )
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"DataParallel: optimizer is a {type(optimizer).__name__}; expected an "
            "optax.GradientTransformation (with init and update). Fix: e.g. optax.adamw(1e-3)."
        )
    if not isinstance(config, DDPConfig):
        raise TypeError(
            f"DataParallel: config is a {type(config).__name__}; expected a jaxdp.DDPConfig. "
            "Fix: config=DDPConfig(...) or DDPConfig.from_yaml(path)."
        )
    check_supported(config)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What :func:`build_plan` decided (module docstring).

    Attributes:
        group: who reduces with whom.
        sharding: the params' shardings over the mesh's other axes.
        layout: the bucket layout (of the rank-local blocks on a tensor-parallel mesh).
        strategy: the ZeRO strategy; ask it about state forms, the step, checkpoints.
        finds_stacks: scanned layer stacks are detected and gathered per layer.
        buckets: how the bucket size was chosen and what the link model predicts for the
            gradient collectives (:func:`bucket_choice`).
    """

    group: ReductionGroup
    sharding: ShardingPlan
    layout: BucketLayout
    strategy: Strategy
    finds_stacks: bool = False
    buckets: BucketChoice | None = None

    @property
    def passes_off(self) -> tuple[str, ...]:
        """XLA passes the step compiles without: those its collectives need off
        (:meth:`jaxdp._src.comm.per_param.AllReduceOps.passes_off`)."""
        return self.strategy.ops.passes_off()


def read_sharding(
    params: Any, group: ReductionGroup, config: DDPConfig, param_specs: Any, previous: Plan | None
) -> ShardingPlan:
    """The params' non-data shardings. Under ``jax.eval_shape`` (tracer leaves carry no
    sharding) the previous plan's are reused unless ``param_specs`` is given."""
    tracers = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(params))
    if param_specs is None and previous is not None and tracers:
        treedef = jax.tree_util.tree_structure(params)
        param_specs = jax.tree_util.tree_unflatten(
            treedef, [ls.pspec for ls in previous.sharding.leaves]
        )
    return ShardingPlan.from_params(
        params,
        group.mesh,
        group.data_axis,
        param_specs,
        expert_axis=config.expert_axis,
        expert_patterns=config.expert_param_patterns,
    )


def _layout(
    loss_fn: Any,
    params: Any,
    config: DDPConfig,
    group: ReductionGroup,
    sharding: ShardingPlan,
    example_batch: Any,
    previous: Plan | None,
) -> BucketLayout:
    dp = group.shard_count  # the ZeRO shards: dp, or dp / N with instances that replicate them
    stacks: dict[int, int] = {}
    shard_axes = None
    if not sharding.trivial:  # the layout of the rank-local blocks; stacks are not detected
        params, shard_axes = sharding.local_params(params), sharding.buffer_keys()
    elif finds_stacks(config):
        prev = dict(previous.layout.stacked) if previous is not None else None
        try:
            stacks = find_stacks(
                loss_fn,
                params,
                example_batch,
                dp,
                prev,
                num_microbatches=config.num_microbatches,
                param_dtype=config.param_dtype,
                patterns=config.scan_param_patterns,
                axes=group.manual_axes,
            )
        except UnboundAxis as e:  # a model collective over an axis the step does not bind
            err = unbound_axis_error("DataParallel.init", e.name, e.bound, config.data_axis)
            raise err from e.__cause__
    layout = BucketLayout.from_params(params, config, dp, stacked=stacks, shard_axes=shard_axes)
    numel = _across_nodes(config, layout, group)
    if numel is None or numel == layout.bucket_size:
        return layout
    rules = rules_of(config, dp).replace(bucket_size=numel)
    return BucketLayout.build(params, rules, dp, stacks, shard_axes=shard_axes)


def _gradient_kind(config: DDPConfig) -> str:
    return "all-reduce" if config.zero_stage == 0 else "reduce-scatter"


def _bucket_link(group: ReductionGroup) -> tuple[int, Any, int]:
    """``(nodes, link, ranks)`` of the ring a bucket is reduced over: the group's, or with
    distributed-optimizer instances the instance's (its buckets reduce within it; across
    instances only the shard travels, once per step)."""
    devices, ranks = group.mesh.devices, group.size
    if group.outer_axis is not None:
        devices = devices.take(0, axis=group.mesh.axis_names.index(group.outer_axis))
        ranks = group.inner_size
    nodes = nodes_of(list(devices.flat))
    return nodes, ring_link(nodes, max(ranks // nodes, 1)), ranks


def _across_nodes(config: DDPConfig, layout: BucketLayout, group: ReductionGroup) -> int | None:
    """``bucket_size="auto"`` on a group that spans several nodes: the bucket size (elements)
    of the alpha-beta rule (:func:`jaxdp._src.topology.links.auto_bucket_bytes`), at most
    Megatron's default; ``None`` where the rule does not apply (one node, a size or a count
    given, one bucket per buffer)."""
    nodes, link, ranks = _bucket_link(group)
    if nodes == 1 or config.bucket_size != AUTO_BUCKET_SIZE or layout.bucket_size is None:
        return None
    if config.num_buckets is not None:
        return None
    itemsize = max(jnp.dtype(b.grad_dtype).itemsize for b in layout.buffers)
    total = sum(b.numel * jnp.dtype(b.grad_dtype).itemsize for b in layout.buffers)
    chosen = auto_bucket_bytes(
        total,
        ranks,
        link,
        kind=_gradient_kind(config),
        largest_bytes=layout.bucket_size * itemsize,
    )
    return max(chosen // itemsize, 1)


def bucket_choice(config: DDPConfig, layout: BucketLayout, group: ReductionGroup) -> BucketChoice:
    """How ``layout``'s bucket size was chosen, priced by the link model for the group's ring
    (one node: NVLink; several: the network's bandwidth, :func:`ring_link`)."""
    nodes, link, ranks = _bucket_link(group)
    if layout.num_buckets is not None:
        rule = f"num_buckets={layout.num_buckets}"
    elif layout.bucket_size is None:
        rule = "one per buffer"
    elif config.bucket_size == AUTO_BUCKET_SIZE:
        rule = "auto, alpha-beta rule" if nodes > 1 else "auto"
    else:
        rule = "bucket_size"
    sizes = [b.numel * jnp.dtype(b.grad_dtype).itemsize for b in layout.buckets]
    return BucketChoice.price(rule, link, _gradient_kind(config), ranks, sizes)


def _ops(
    config: DDPConfig,
    wire: Wire,
    layout: BucketLayout,
    group: ReductionGroup,
    sharding: ShardingPlan,
    divisor: int,
) -> PlainOps:
    """The gradient / param collectives' operations: nested regions when some parameter is
    split over an axis the step is not manual over (tensor parallelism); per parameter at
    stages 1-2 where :func:`jaxdp._src.comm.per_param.per_parameter_collectives` allows it, and at
    stage 0 where :func:`jaxdp._src.comm.per_param.per_parameter_all_reduce` does; else per bucket.
    ``divisor``: what the loss divides the gradients by
    (:mod:`jaxdp._src.strategy.loss_divisor`)."""
    args = (layout, wire, group, sharding, divisor)
    if sharding.auto_axes:
        return NestedOps(*args)
    if config.zero_stage in (1, 2) and per_parameter_collectives(config, layout):
        return PerParamOps(*args)
    if config.zero_stage == 3 and reduces_per_parameter(config, layout):
        return PerParamOps(*args)
    if config.zero_stage == 0 and per_parameter_all_reduce(config, layout):
        return AllReduceOps(*args)
    return PlainOps(*args)


def _codecs(
    config: DDPConfig, layout: BucketLayout, sharding: ShardingPlan, group: ReductionGroup
) -> tuple[Codec, Codec]:
    """``(params codec, sharded view codec)``; views are sharded over the group's shard axes."""
    plain = ParamCodec(layout, sharding)
    if config.zero_stage == 0:
        return plain, plain
    if not sharding.trivial:
        return plain, BlockCodec(layout, sharding)
    view_cls = MegatronCodec if layout.kind == "megatron" else InterleavedCodec
    return plain, view_cls(layout, sharding, group.shard_axes)


_MOMENT_FIELDS = {"exp_avg": "exp_avg_dtype", "exp_avg_sq": "exp_avg_sq_dtype"}
_MOMENT_WORDS = {"exp_avg": "first moments", "exp_avg_sq": "second moments"}


def state_policy(
    config: DDPConfig, optimizer: optax.GradientTransformation, layout: BucketLayout
) -> StatePolicy:
    """The storage dtypes of the optimizer's moments (:class:`StatePolicy`), from
    ``DDPConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype``. ``"float32"`` leaves a moment as optax
    keeps it; a narrower dtype needs the optimizer's state to hold moments of that role
    (:data:`jaxdp._src.optim.known.MOMENT_STATES`), else a ``ValueError`` names the field,
    before anything compiles (the state's structure comes from ``jax.eval_shape``)."""
    asked = {
        role: getattr(config, field)
        for role, field in _MOMENT_FIELDS.items()
        if getattr(config, field) != "float32"
    }
    if not asked:
        return StatePolicy()
    wide = any(s.dtype == "float64" for s in layout.slots)
    master = jnp.float64 if wide else jnp.float32
    abstract = jax.eval_shape(
        optimizer.init,
        jax.tree_util.tree_unflatten(
            layout.treedef, [jax.ShapeDtypeStruct(s.shape, master) for s in layout.slots]
        ),
    )
    roles = moment_roles(abstract)
    for role, dtype in asked.items():
        if role in roles:
            continue
        field = _MOMENT_FIELDS[role]
        known = ", ".join(
            f"{cls.__name__} ({'/'.join(sorted(set(f.values())))})"
            for cls, f in MOMENT_STATES.items()
        )
        found = ", ".join(state_names(abstract)) or "no optax state classes"
        raise ValueError(
            f"DataParallel.init: DDPConfig.{field}={dtype!r} asks to store Adam's "
            f"{_MOMENT_WORDS[role]} in {dtype}, but this optimizer's state holds none that "
            f"jaxdp can map (its state: {found}). jaxdp maps the moments of optax's {known}: "
            "adam, adamw, nadam, lamb, amsgrad, adabelief, lion (first moment only) and the "
            f"wrappers around them. Fix: leave {field}='float32' for this optimizer, or use "
            "an Adam-family optax optimizer."
        )
    return StatePolicy(
        exp_avg=asked.get("exp_avg"),
        exp_avg_sq=asked.get("exp_avg_sq"),
        compute=jnp.dtype(master).name,
    )


def _strategy(
    config: DDPConfig,
    layout: BucketLayout,
    sharding: ShardingPlan,
    group: ReductionGroup,
    optimizer: optax.GradientTransformation,
) -> Strategy:
    plain, view = _codecs(config, layout, sharding, group)
    g, stage = config.num_microbatches, config.zero_stage
    wire = wire_of(config)
    spec = StepSpec(
        num_microbatches=g,
        param_dtype=config.param_dtype,
        clip_grad=config.clip_grad,
        model_state_sync=config.model_state_sync,
        fusion=config.gradient_accumulation_fusion,
        grad_norm_skip_threshold=config.grad_norm_skip_threshold,
        check_for_large_grads=config.check_for_large_grads,
        fence_backward=fences_backward(config, layout, group.platform),
    )
    # Stages 0-2 divide the gradients through the loss where that gives the same bits (a
    # power of two); stage 3 reduces inside its gathers' transpose and divides there.
    divisor = 1
    if stage < 3:
        groups = group.bucket_groups(layout)
        divisor = loss_divisor(
            layout, groups, wire, num_microbatches=g, param_dtype=config.param_dtype
        )
    rs_fp32 = config.reduce_scatter_with_fp32_accumulation
    common = dict(
        spec=spec,
        # the opcode of a bucket's gradient collective (jaxdp.aot labels them by it)
        grad_collectives=("all-to-all",) if rs_fp32 else ("reduce-scatter",),
        layout=layout,
        sharding=sharding,
        group=group,
        optimizer=optimizer,
        state_policy=state_policy(config, optimizer, layout),
        ops=_ops(config, wire, layout, group, sharding, divisor),
        # The step is manual over the group's axes; on a mesh whose other axes hold no split
        # parameter, over all of them (the params are whole there).
        axis_names=set(group.mesh.axis_names if sharding.trivial else group.manual_axes),
        offload=offload_of(config, layout, group.mesh),
    )
    # With micro-batches, accumulate per parameter (the GEMM's epilogue can do the add) where
    # the params are whole on each device; nested regions keep bucket accumulators.
    per_param_acc = g > 1 and not isinstance(common["ops"], NestedOps)
    at_end = PerParameter() if per_param_acc else Buckets()  # the accumulator when reducing last
    # Kernels that reduce after the loop peel its last micro-batch out of it, so that its
    # backward overlaps the collectives (jaxdp._src.strategy.local.local_gradients). With one rank
    # there
    # are none, and with overlap_grad_reduce=False none is wanted: the copy of the model
    # would only double what XLA compiles (the peeled stage 1 compiled much slower than
    # stage 2, which never peels; BENCHMARKS.md section 13).
    peel = group.size > 1 and config.overlap_grad_reduce
    kernel: Callable[..., Any]
    if stage == 0:
        # Whole-parameter buckets all-reduced with a psum: the metric sums wait for them, so
        # that XLA does not combine a scalar into a bucket's all-reduce (Kernel). Not
        # tensor-parallel buckets (NestedOps): one element of a bucket split over the model
        # axes would have to be sent to the other model ranks to be waited for.
        psum_buckets = common["ops"].packs_whole_buckets and not _all_to_all(config)
        kernel = functools.partial(
            Kernel,
            accumulator=at_end,
            reduction=AtEnd(sharded=False),
            peel_last=peel,
            order_metrics=psum_buckets and group.size > 1,
        )
        return Replicated(
            kernel=kernel,
            master_codec=plain,
            params_codec=plain,
            per_parameter=isinstance(common["ops"], AllReduceOps),
            **common,
        )
    if stage in (1, 2):
        early = config.overlap_param_gather  # params kept sharded, gathered up front
        if stage == 2 and g > 1:  # reduce-scatter every micro-batch into a sharded accumulator
            kernel = functools.partial(
                Kernel, accumulator=Sharded(), reduction=EachMicrobatch(), gather_first=early
            )
        else:
            kernel = functools.partial(
                Kernel,
                accumulator=at_end,
                reduction=AtEnd(sharded=True),
                gather_first=early,
                peel_last=peel,
            )
        per_parameter = isinstance(common["ops"], PerParamOps)
        return ShardedOpt(
            kernel=kernel,
            master_codec=view,
            params_codec=view if early else plain,
            params_sharded=early,
            scatters_per_step=g if stage == 2 else 1,
            per_parameter=per_parameter,
            # one flat view per parameter, every parameter whole on each device: the gather
            # after the update is the partitioner's (ShardedOpt._gather_global). Not where the
            # shards span the instances: XLA gathers them over every rank at once, all the
            # bytes across nodes, where jaxdp gathers across instances first (1/(dp/N) of
            # them) and then within (bench/bench_hierarchical.py)
            gathers_globally=per_parameter and sharding.trivial and not group.shard_outer,
            **common,
        )
    # stage 3: scanned layer stacks are gathered one layer per scan iteration
    # Params are gathered over the shard axes; the gathers' transpose reduces within the
    # instance (the whole group when flat) and the instances are combined after the loop.
    remat = rematerialises(config, group)
    z3: dict[str, Any] = dict(
        axis=group.shard_axes,
        # None: no checkpoint, where the gathers are identities (one shard)
        policy=remat_policy_for(config.remat_policy) if remat else None,
    )
    if group.levels is not None:
        z3["levels"] = group.levels
    if layout.stacked:  # each layer's slices are laid out by the layout's own rules
        z3["rules"] = rules_of(config, layout.dp_size)
    else:  # accs: one per parameter where the ops reduce per parameter (not on a
        # tensor-parallel mesh, whose nested regions keep bucket accumulators)
        z3["per_slot"] = isinstance(common["ops"], PerParamOps)
    vg: Callable[..., Any] = functools.partial(
        zero3_scan_value_and_grad if layout.stacked else zero3_value_and_grad, **z3
    )
    if remat and names_dot_operands(config):  # the policy saves what XLA's attention reads
        vg = _naming_dot_operands(vg)
    pre: Callable[..., Any] = layout.shard_unview if layout.stacked else (lambda v: v)
    kernel = functools.partial(Kernel, accumulator=Sharded(), reduction=InGrad(vg, pre))
    return ShardedParams(
        kernel=kernel,
        master_codec=view,
        params_codec=view,
        per_parameter=gathers_per_parameter(layout),
        **common,
    )


def _naming_dot_operands(vg: Callable[..., Any]) -> Callable[..., Any]:
    """Stage 3's value-and-grad builder, given the loss with its batched dots' operands named
    (:func:`jaxdp._src.zero3.dot_operands.name_batched_dot_operands`)."""

    def build(parts: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        return vg(name_batched_dot_operands(parts), *args, **kw)

    return build


def build_plan(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    config: DDPConfig,
    group: ReductionGroup,
    params: Any,
    *,
    param_specs: Any = None,
    example_batch: Any = None,
    previous: Plan | None = None,
) -> Plan:
    """Decide everything (module docstring). ``previous``: the plan of an earlier ``init`` of
    the same engine (its stacks and shardings are kept; another model is refused)."""
    sharding = read_sharding(params, group, config, param_specs, previous)
    check_supported(config, sharding)
    layout = _layout(loss_fn, params, config, group, sharding, example_batch, previous)
    if previous is not None and previous.layout != layout:
        raise ValueError(
            "DataParallel.init: these params have a different structure, shapes or dtypes "
            "than the ones this engine was initialised with. Fix: build a new DataParallel "
            "for a different model."
        )
    strategy = _strategy(config, layout, sharding, group, optimizer)
    if previous is None or previous.strategy.optimizer is not optimizer:
        # a re-init with the same optimizer (and, checked above, the same layout) passed before
        check_optimizer(optimizer, layout, strategy.master_dtype)
    return Plan(
        group=group,
        sharding=sharding,
        layout=layout,
        strategy=strategy,
        finds_stacks=finds_stacks(config) and sharding.trivial,
        buckets=bucket_choice(config, layout, group),
    )
