"""Ahead-of-time compilation of a :class:`DataParallel` step from abstract values.

Nothing is allocated: the state comes from ``jax.eval_shape(dp.init, params)`` with the
engine's shardings attached, the batch is a tree of ``ShapeDtypeStruct`` sharded over the data
axis, and ``dp.step.lower(state, batch).compile()`` gives the executable (``.as_text()``: the
scheduled program). With compile-only devices (:func:`h100_mesh`) this is how a GPU schedule is
inspected on a machine without GPUs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P  # noqa: F401 - abstract_batch's example

from .. import DataParallel
from .._src.platform.xla_flags import with_passes_off, xla_compiler_options
from ._report import Collective, ScheduleReport

__all__ = [
    "abstract_state",
    "abstract_batch",
    "compile_step",
    "cross_compile_step",
    "collective_roles",
    "gradient_collectives",
    "example_mlp",
]


def _check_engine(fn: str, dp: Any) -> None:
    if not isinstance(dp, DataParallel):
        raise TypeError(
            f"{fn}: dp is a {type(dp).__name__}; expected a jaxdp.DataParallel. Fix: pass the "
            "engine, e.g. DataParallel(loss_fn, optimizer, config, mesh=h100_mesh(8))."
        )


def abstract_state(dp: DataParallel, params: Any, batch: Any = None) -> Any:
    """The engine's ``TrainState`` as ``ShapeDtypeStruct`` leaves carrying their shardings.

    Runs ``jax.eval_shape(dp.init, params, batch)`` (which also builds ``dp.layout``; the
    optional example ``batch`` lets ``zero_stage=3`` find scanned layer stacks), so ``params``
    may itself be abstract. Nothing is allocated.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> dp = DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1),
        ...                   DDPConfig(zero_stage=1))
        >>> state = abstract_state(dp, {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)})
        >>> state.master["w"].shape, state.master["w"].sharding.spec == P("data")
        ((64,), True)
    """
    _check_engine("abstract_state", dp)
    abstract = jax.eval_shape(lambda p: dp.init(p, example_batch=batch), params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        abstract,
        dp.state_shardings,
    )


def abstract_batch(dp: DataParallel, batch: Any) -> Any:
    """``batch`` (arrays or ``ShapeDtypeStruct``, global batch first) sharded over the data axis.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> dp = DataParallel(lambda p, b: 0.0, optax.sgd(0.1), DDPConfig())
        >>> abstract_batch(dp, {"x": jnp.zeros((64, 3))})["x"].sharding.spec == P("data")
        True
    """
    _check_engine("abstract_batch", dp)
    sharding = dp.batch_sharding
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), batch)


def compile_step(
    dp: DataParallel,
    params: Any,
    batch: Any,
    *,
    compiler_options: dict[str, Any] | str | None = "jaxdp",
) -> Any:
    """Lower and compile ``dp.step`` for abstract ``params`` and ``batch``; nothing runs.

    Args:
        dp: the engine, typically on a mesh of compile-only devices (:func:`h100_mesh`).
        params: the params pytree (arrays or ``ShapeDtypeStruct``).
        batch: the global batch (arrays or ``ShapeDtypeStruct``).
        compiler_options: ``"jaxdp"`` (default): :func:`jaxdp.xla_compiler_options` for the
            engine's config and data-parallel size; ``None``: XLA's defaults (with whatever
            the engine itself was built with, ``DataParallel(compiler_options=...)``); or a
            dict. Options given here win over the engine's.

    Returns:
        The ``jax.stages.Compiled`` step; ``.as_text()`` is the scheduled program.

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> dp = DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.sgd(0.1),
        ...                   DDPConfig(zero_stage=1))
        >>> params = {"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)}
        >>> batch = {"x": jax.ShapeDtypeStruct((64, 16), jnp.float32)}
        >>> "HloModule" in compile_step(dp, params, batch, compiler_options=None).as_text()
        True
    """
    _check_engine("compile_step", dp)
    if isinstance(compiler_options, str) and compiler_options != "jaxdp":
        raise ValueError(
            f"compile_step: compiler_options={compiler_options!r}; expected 'jaxdp', None "
            "or a dict of XLA options. Fix: pass compiler_options='jaxdp' for jaxdp's flags."
        )
    state = abstract_state(dp, params, batch)  # builds the plan
    opts: dict[str, Any] | None
    if compiler_options == "jaxdp":  # the thresholds follow the bucket size the layout chose
        opts = xla_compiler_options(dp.config, dp_size=dp.dp, bucket_numel=dp.layout.bucket_size)
    else:
        opts = compiler_options  # type: ignore[assignment]
    if opts:  # these win over the engine's: keep the passes its collectives need off
        opts = with_passes_off(opts, dp.plan.passes_off)
    with warnings.catch_warnings():
        # Donation is meaningless without buffers; the lowering warns about unusable ones.
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = dp.step.lower(state, abstract_batch(dp, batch))
        return lowered.compile(compiler_options=opts) if opts else lowered.compile()


def _lowering_platform(devices: list[Any]) -> str:
    """The platform name jax lowers for (its compile-only GPU devices say ``"gpu"``)."""
    platform = devices[0].platform
    if platform == "gpu":
        return "rocm" if "rocm" in str(getattr(devices[0], "client", "")).lower() else "cuda"
    return str(platform)


class CrossCompiled:
    """A step compiled by :func:`cross_compile_step`: what ``jax.stages.Compiled`` offers for
    inspection (``as_text``, ``memory_analysis``); it cannot run."""

    def __init__(self, executable: Any):
        self._exe = executable

    def as_text(self) -> str:
        """The optimised, scheduled program."""
        return "\n\n".join(m.to_string() for m in self._exe.hlo_modules())

    def memory_analysis(self) -> Any:
        """XLA's buffer assignment: device bytes (``argument_size_in_bytes``, ...) and host
        bytes (``host_argument_size_in_bytes``, ...) apart."""
        return self._exe.get_compiled_memory_stats()


def cross_compile_step(
    dp: DataParallel,
    params: Any,
    batch: Any,
    devices: Any,
    *,
    compiler_options: dict[str, Any] | str | None = "jaxdp",
) -> CrossCompiled:
    """Compile the step of ``dp`` (an engine on devices that run, e.g. CPU devices) for other,
    compile-only ``devices`` of the same count (e.g. ``h100_topology(8)``); nothing runs.

    :func:`compile_step` needs the engine on the compile-only devices themselves, which have
    no memories, so jax drops every memory kind there: a state kept in host memory
    (``DDPConfig.optimizer_cpu_offload``) would compile as if on the device. Here the step is
    lowered on the engine's own mesh (whose devices have a ``pinned_host`` memory) for the
    target's platform and compiled for ``devices`` in the mesh's device order, so the program
    keeps its host transfers and :meth:`CrossCompiled.memory_analysis` reports device and
    host bytes apart. Uses jax's internal compile entry points (``jax._src.compiler``).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> from jaxdp import aot
        >>> cpu = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])
        >>> dp = DataParallel(lambda p, b: jnp.mean(b["x"] @ p["w"]), optax.adam(1e-3),
        ...                   DDPConfig(zero_stage=1, optimizer_cpu_offload=True), mesh=cpu)
        >>> params = {"w": jax.ShapeDtypeStruct((256, 4), jnp.float32)}
        >>> batch = {"x": jax.ShapeDtypeStruct((8, 256), jnp.float32)}
        >>> compiled = cross_compile_step(dp, params, batch, jax.devices("cpu")[:1])
        >>> "HloModule" in compiled.as_text()  # for compile-only GPUs: aot.h100_topology(8)
        True
    """
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client

    _check_engine("cross_compile_step", dp)
    devices = list(devices)
    if len(devices) != dp.mesh.devices.size:
        raise ValueError(
            f"cross_compile_step: {len(devices)} devices for an engine on "
            f"{dp.mesh.devices.size}; expected as many. Fix: build the engine on a mesh of "
            f"{len(devices)} devices (e.g. CPU devices with "
            "XLA_FLAGS=--xla_force_host_platform_device_count)."
        )
    if isinstance(compiler_options, str):
        if compiler_options != "jaxdp":
            raise ValueError(
                f"cross_compile_step: compiler_options={compiler_options!r}; expected 'jaxdp', "
                "None or a dict of XLA options. Fix: pass compiler_options='jaxdp'."
            )
        opts: dict[str, Any] | None = xla_compiler_options(dp.config, dp_size=dp.dp)
    else:
        opts = compiler_options
    state = abstract_state(dp, params, batch)
    opts = with_passes_off(opts or {}, dp.plan.passes_off)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = dp.step.lower(
            state, abstract_batch(dp, batch), lowering_platforms=(_lowering_platform(devices),)
        )
    n = len(devices)
    options = compiler.get_compile_options(
        num_replicas=1,
        num_partitions=n,
        device_assignment=np.array(devices).reshape(1, n),
        env_options_overrides=opts or None,
    )
    options.executable_build_options.use_spmd_partitioning = True
    options.executable_build_options.use_shardy_partitioner = bool(
        getattr(jax.config, "jax_use_shardy_partitioner", True)
    )
    exe = compiler.backend_compile_and_load(
        devices[0].client,
        lowered.compiler_ir("stablehlo"),
        xla_client.DeviceList(tuple(devices)),
        options,
        [],
    )
    return CrossCompiled(exe)


_HLO_DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "float64": "f64"}


def collective_roles(report: ScheduleReport, dp: DataParallel) -> list[str]:
    """Label each collective of ``report``: ``"grad bucket"``, ``"param bucket"``,
    ``"grad group"``, ``"param group"`` or ``""``.

    A gradient collective is one of the kind the config reduces with (all-reduce at stage 0,
    all-to-all with ``reduce_scatter_with_fp32_accumulation``, else reduce-scatter) moving
    exactly one bucket's elements; a param collective is an all-gather of one bucket. A
    collective that XLA combined from several buckets matches no bucket and gets ``""``.

    At ``zero_stage=3`` with the interleaved layout
    (:func:`jaxdp._src.zero3.gather.make_leaf_gather`),
    and at stages 0-2 in the bf16 and fp32-wire modes (:mod:`jaxdp._src.comm.per_param`), jaxdp
    gathers
    and reduces (stage 0: all-reduces) each parameter on its own and XLA's combiners merge
    them into groups of at most one bucket (:func:`jaxdp.combine_thresholds`): an all-gather in
    the working dtype, or a gradient collective in the wire dtype, of at most the largest
    bucket's elements is a ``"param group"`` / ``"grad group"``. Collectives of the micro-batch
    loop get ``" (loop)"`` appended.

    With distributed-optimizer instances (``num_distributed_optimizer_instances``) the
    collectives over one rank per instance (groups of the instance count) are the level
    across instances: ``"grad outer"`` (the instance's shard all-reduced or reduce-scattered,
    once per step) and ``"param outer"`` (the updated shard gathered back); those within an
    instance are labelled as above.
    """
    _check_engine("collective_roles", dp)
    numels = {b.numel for b in dp.layout.buckets}
    biggest = max(numels)
    strategy = dp.plan.strategy
    grad = strategy.grad_collectives
    groups, reduced = strategy.gathers_per_parameter, strategy.reduces_per_parameter
    wire = {_HLO_DTYPES.get(jnp.dtype(b.grad_dtype).name) for b in dp.layout.buckets}
    work = {_HLO_DTYPES.get(jnp.dtype(b.dtype).name) for b in dp.layout.buckets}
    roles = []
    group = dp.group
    outer = group.outer_size if group.outer_axis and group.outer_size != group.inner_size else 0
    for c in report.collectives:
        if outer and c.group_size == outer and c.elements > 1:
            roles.append("param outer" if c.kind == "all-gather" else "grad outer")
        elif c.elements in numels and c.operands == 1 and c.kind in grad:
            roles.append("grad bucket")
        elif c.elements in numels and c.operands == 1 and c.kind == "all-gather":
            roles.append("param bucket")
        elif reduced and 0 < c.elements <= biggest and c.kind in grad and c.dtype in wire:
            roles.append("grad group")
        elif groups and 0 < c.elements <= biggest and c.kind == "all-gather" and c.dtype in work:
            roles.append("param group")
        else:
            roles.append("")
        if roles[-1] and not c.entry:
            roles[-1] += " (loop)"
    return roles


def gradient_collectives(
    report: ScheduleReport, dp: DataParallel, *, entry_only: bool = True
) -> tuple[Collective, ...]:
    """The gradient collectives of ``report``: buckets and groups of parameters
    (see :func:`collective_roles`).

    With ``entry_only`` (default) only those of the ENTRY computation, i.e. of the last
    micro-batch: stage 2 with ``num_microbatches > 1`` also reduce-scatters inside the
    micro-batch loop.
    """
    roles = collective_roles(report, dp)
    return tuple(
        c
        for c, r in zip(report.collectives, roles, strict=True)
        if r.startswith("grad") and (c.entry or not entry_only)
    )


def example_mlp(
    layers: int = 8, width: int = 512, batch: int = 64
) -> tuple[Callable[..., Any], Any, Any]:
    """An abstract ``layers``-deep tanh MLP: ``(loss_fn, params, batch)`` for :func:`compile_step`.

    Params ``{"layer00": {"w": [width, width], "b": [width]}, ...}`` (fp32; zero-padded names
    keep the pytree order equal to the forward order), batch ``{"x", "y"}`` of
    ``[batch, width]``; the loss is the mean squared error of the output.

    Example:
        >>> loss_fn, params, batch = example_mlp(layers=2, width=8, batch=4)
        >>> sorted(params), params["layer00"]["w"].shape, batch["x"].shape
        (['layer00', 'layer01'], (8, 8), (4, 8))
    """
    params = {
        f"layer{i:02d}": {
            "w": jax.ShapeDtypeStruct((width, width), jnp.float32),
            "b": jax.ShapeDtypeStruct((width,), jnp.float32),
        }
        for i in range(layers)
    }
    data = {
        "x": jax.ShapeDtypeStruct((batch, width), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch, width), jnp.float32),
    }

    def loss_fn(p: Any, b: Any) -> jax.Array:
        dtype = p["layer00"]["w"].dtype
        h = b["x"].astype(dtype)
        for i in range(layers):
            h = jnp.tanh(h @ p[f"layer{i:02d}"]["w"] + p[f"layer{i:02d}"]["b"])
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    return loss_fn, params, data
