"""``DataParallel``: a jitted training step with bucketed gradient reduction and ZeRO 0-3.

This module is the facade: argument checks, ``init``, batch placement and checks, and the
jitted step. Every variant question (ZeRO stage, mesh kind, layout, scanned layer stacks) is
decided once, in ``init``, by the plan (:mod:`jaxdp._src.strategy.plan`), which builds the strategy
(:mod:`jaxdp._src.strategy.strategy`). The step is then one straight line:

1. ``strategy.local_step``: in a ``shard_map`` over the data-parallel group, each rank
   computes its local gradients micro-batch by micro-batch and reduces them bucket by bucket
   (:mod:`jaxdp._src.strategy.local`, :mod:`jaxdp._src.strategy.kernels`);
2. global-norm clipping and the optax update on the strategy's view of the master weights
   (:mod:`jaxdp._src.strategy.update`; sharded at stages >= 1, so each rank updates its shard);
3. ``strategy.rebuild``: the working params (gathered, cast, or kept sharded).

See docs/how-a-step-works.md for the whole flow and CONTRIBUTING.md for where its parts live.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..comm.order import hold
from ..config.config import DDPConfig
from ..core.loss import LossCall, check_init_inputs, plain_loss
from ..core.state import TrainState
from ..layout.layout import BucketLayout
from ..platform.xla_flags import engine_compiler_options, with_passes_off
from ..strategy import spikes
from ..strategy.offload import to_device, update_by_bucket
from ..strategy.plan import Plan, build_plan, check_engine_args
from ..strategy.update import optimizer_update
from ..topology.group import ReductionGroup
from ..topology.mesh import auto_mesh, instance_axes, instance_mesh, make_mesh
from .state_build import build_state, per_leaf_plan
from .step import BatchGuard, Step, warn_if_undetected

__all__ = ["DataParallel", "TrainState"]


class DataParallel:
    """Data-parallel training with Megatron's gradient machinery.

    Args:
        loss_fn: ``loss_fn(params, microbatch) -> loss`` (mean over the micro-batch),
            ``-> (loss, aux)`` or ``-> jaxdp.LossOutput(loss, aux, model_state, num_tokens)``;
            with ``config.calculate_per_token_loss`` it returns ``(loss_sum, num_tokens)``.
            When :meth:`init` got a ``model_state`` / an ``rng`` it is also passed
            ``model_state=`` / ``rng=`` (keywords). ``metrics["aux"]`` is the elementwise mean
            of ``aux`` over micro-batches and ranks.
        optimizer: an ``optax.GradientTransformation``.
        config: a :class:`DDPConfig`.
        mesh: a mesh with ``config.data_axis`` (default: :func:`make_mesh` over all devices);
            its axes are used as ``Auto`` axes (see :func:`jaxdp._src.topology.mesh.auto_mesh`).
            Params keep their shardings over its other axes (tensor parallelism,
            docs/parallelism.md); see ``DDPConfig.expert_axis`` for experts.
        donate: donate the input state to the step (saves a copy of params and optimizer
            state; the input state is unusable afterwards).
        compiler_options: XLA options the step compiles with. ``None`` (default): XLA's
            defaults and ``XLA_FLAGS``. ``"jaxdp"``: on GPU meshes,
            :func:`jaxdp.xla_compiler_options` for ``config`` and this mesh's data-parallel
            size (the combine thresholds that keep buckets apart, the latency-hiding
            scheduler), less the options ``XLA_FLAGS`` names; nothing on other platforms.
            A dict: exactly those options. Unlike :func:`jaxdp.apply_xla_flags` this works
            after the backend has started, and only for the step (docs/gpu-and-xla-flags.md); the
            step adds the passes its collectives need off (:attr:`step_compiler_options`).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DataParallel, DDPConfig
        >>> def loss_fn(params, batch):
        ...     return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
        >>> dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig(zero_stage=1))
        >>> state = dp.init({"w": jnp.zeros((4, 1))})
        >>> batch = {"x": jnp.ones((16, 4)), "y": jnp.ones((16, 1))}
        >>> state, metrics = dp.step(state, dp.shard_batch(batch))
        >>> round(float(metrics["loss"]), 3)
        1.0
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        config: DDPConfig,
        mesh: Any = None,
        *,
        donate: bool = True,
        compiler_options: dict[str, Any] | str | None = None,
    ):
        check_engine_args(loss_fn, optimizer, config)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        self.mesh, self.group = _mesh_and_group(mesh, config)
        self.dp = self.group.size  # |data| (x |expert| with expert parallelism)
        self.donate = donate
        self._options_asked = compiler_options
        #: the options the step compiles with (with ``num_buckets`` and ``"jaxdp"``: set by
        #: ``init``, as the combine thresholds follow the bucket size the layout chose)
        self.compiler_options = (
            None
            if self._options_follow_layout()
            else engine_compiler_options(
                compiler_options,
                config,
                dp_size=self.dp,
                platform=self.group.platform,
                device=self.mesh.devices.flat[0],
            )
        )
        self._plan: Plan | None = None
        #: the host-side checks every batch passes before the step sees it
        self.batch_guard = BatchGuard(config.num_microbatches, self.dp)
        self._step: Step | None = None
        self._export: Any = None
        self._call = LossCall()
        self.plain_loss: Callable[..., Any] = loss_fn
        self._abstract: TrainState | None = None
        #: the params' shapes as loss_fn sees them (set by init; explains a failed first trace)
        self.work_params: Any = None

    # ------------------------------------------------------------------ properties
    @property
    def plan(self) -> Plan:
        """What ``init`` decided (:class:`jaxdp._src.strategy.plan.Plan`): the reduction group, the
        params' shardings, the layout and the ZeRO strategy (``plan.strategy``), which
        ``CheckpointManager``, ``jaxdp.aot`` and ``jaxdp-train`` ask about the state."""
        if self._plan is None:
            raise RuntimeError(
                "DataParallel.plan: the plan is built from the params; call init(params) "
                "first (jax.eval_shape(dp.init, params) is enough)."
            )
        return self._plan

    @property
    def loss_call(self) -> LossCall:
        """Which keywords ``loss_fn`` gets (``model_state=``, ``rng=``), as ``init`` decided."""
        return self._call

    @property
    def layout(self) -> BucketLayout:
        """The :class:`BucketLayout` of the params (available after :meth:`init`)."""
        if self._plan is None:
            raise RuntimeError(
                "DataParallel.layout: the layout is built from the params; call init(params) "
                "first (jax.eval_shape(dp.init, params) is enough)."
            )
        return self._plan.layout

    @property
    def abstract_state(self) -> TrainState:
        """The ``jax.ShapeDtypeStruct`` of every :class:`TrainState` leaf ``init`` returns
        (available after ``init``; ``model_state`` and ``rng`` included)."""
        self.layout  # noqa: B018 - raises a clear error before init
        assert self._abstract is not None
        return self._abstract

    @property
    def state_shardings(self) -> TrainState:
        """The ``NamedSharding`` of every :class:`TrainState` leaf (available after ``init``)."""
        self.layout  # noqa: B018 - raises a clear error before init
        return self._shardings

    @property
    def batch_sharding(self) -> NamedSharding:
        """How a global batch is placed: split along its leading axis over the group."""
        return self._sharding(self.group.batch_spec())

    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    # ------------------------------------------------------------------ init
    def init(
        self,
        params: Any,
        *,
        model_state: Any = None,
        rng: Any = None,
        example_batch: Any = None,
        param_specs: Any = None,
    ) -> TrainState:
        """Build the plan and the sharded :class:`TrainState` from a full params pytree.

        Works under ``jax.eval_shape`` (then nothing is allocated). The state is built by
        one compiled program, or, for a model of many leaves that repeat a few shapes (64
        leaves or more, 8 or more per kind on average), by one small program per kind of
        leaf and one for the optimizer's ``init``, which compile several times faster at
        1,000 leaves (``jaxdp._src.engine.state_build``); the state is the same either way.

        Args:
            params: the full trainable params (e.g. linen's ``variables["params"]``).
            model_state: the model's non-trainable state (linen's ``batch_stats`` and other
                mutable collections; nnx's ``BatchStat`` and other non-``Param`` state), or
                ``None``. With one, ``loss_fn`` is called with ``model_state=<this rank's
                state>`` and must return :class:`jaxdp.LossOutput` with the updated state; the
                ranks' states are combined after every step (``DDPConfig.model_state_sync``).
            rng: a typed PRNG key (``jax.random.key(seed)``), or ``None``. With one,
                ``loss_fn`` is called with ``rng=<key>``: a fresh key for every step, rank and
                micro-batch, ``fold_in(fold_in(rng, step), rank * G + microbatch)``.
            example_batch: a global batch like ``step``'s (arrays or ``jax.ShapeDtypeStruct``;
                only shapes are used): lets ``zero_stage=3`` detect scanned layer stacks and
                gather them one layer per scan iteration (``DDPConfig.scan_layers``); without it
                only ``scan_param_patterns`` apply.
            param_specs: on a multi-axis mesh each param keeps the ``NamedSharding`` it carries
                over the non-data axes (tensor parallelism), or the ``PartitionSpec`` given for
                it here (a pytree like ``params``; needed under ``jax.eval_shape`` the first
                time, as tracers carry none).
        """
        model_state, rng, self._call = check_init_inputs(model_state, rng)
        self.plain_loss = plain_loss(self.loss_fn, self._call, model_state)
        self._plan = build_plan(
            self.plain_loss,
            self.optimizer,
            self.config,
            self.group,
            params,
            param_specs=param_specs,
            example_batch=example_batch,
            previous=self._plan,
        )
        chosen = self._plan.layout.bucket_size  # across nodes, "auto" follows the link model
        if self._options_follow_layout() or (
            self._options_asked == "jaxdp" and chosen != self.config.resolve_bucket_size(self.dp)
        ):
            self.compiler_options = engine_compiler_options(
                self._options_asked,
                self.config,
                dp_size=self.dp,
                platform=self.group.platform,
                device=self.mesh.devices.flat[0],
                bucket_numel=chosen,
            )
        # Without an example batch, stacks were not looked for: the first batch tells.
        undetected = example_batch is None and self._plan.finds_stacks
        self.batch_guard.first_batch = (
            (lambda batch: warn_if_undetected(self, batch)) if undetected else None
        )
        self.work_params = _working_shapes(params, self.config.param_dtype)
        strategy = self._plan.strategy

        history: Any = spikes.history0(len(self._plan.layout.buckets))
        if not strategy.spec.check_for_large_grads:
            history = None

        def full(p: Any, ms: Any, key: Any) -> TrainState:
            return strategy.init_state(p)._replace(model_state=ms, rng=key, grad_history=history)

        params = self._replicate_uncommitted(params)
        abstract = jax.eval_shape(full, params, model_state, rng)
        replicated = self._sharding(P())
        self._shardings = strategy.state_shardings(abstract)._replace(
            model_state=jax.tree.map(lambda _: replicated, abstract.model_state),
            rng=None if rng is None else replicated,
            grad_history=jax.tree.map(lambda _: replicated, abstract.grad_history),
        )
        self._abstract = abstract
        leaf_plan = per_leaf_plan(strategy, params, self._shardings)
        if leaf_plan is not None:  # one small program per kind of leaf (engine.state_build)
            state = build_state(strategy, leaf_plan, params, self._shardings, model_state, rng)
            if history is None:
                return state
            return state._replace(grad_history=jax.device_put(history, replicated))
        return jax.jit(full, out_shardings=self._shardings)(params, model_state, rng)

    def _options_follow_layout(self) -> bool:
        """Whether jaxdp's compiler options wait for the layout: its combine thresholds are
        sized by the bucket size, which ``num_buckets`` derives from the params. (Across nodes
        ``bucket_size="auto"`` does too; ``init`` sets them again when the layout chose
        another size than the config's.)"""
        return self._options_asked == "jaxdp" and self.config.num_buckets is not None

    def _replicate_uncommitted(self, params: Any) -> Any:
        """Uncommitted single-device params (what ``model.init`` returns) go onto the mesh
        replicated before ``init``'s program runs. Left to ``jit``, XLA picks a sharded input
        layout for them at stages 1-3 and jax splits each array with a slicing program
        compiled per distinct shape (0.13 s of a 10-parameter stage-1 ``init`` in a fresh
        process, 0.2 s at 100). The largest per-device footprint is unchanged: the device
        holding the whole params already has them. Host arrays (NumPy) are left to jax, which
        splits them on the host, so a model bigger than one device still starts from host
        memory; committed arrays (tensor-parallel shardings) and tracers are left as they are."""
        if jax.process_count() > 1:
            return params
        replicated = self._sharding(P())

        def uncommitted(x: Any) -> bool:
            try:
                return not x.committed
            except (AttributeError, TypeError):  # NumPy arrays; tracers raise a TypeError
                return False

        leaves, treedef = jax.tree_util.tree_flatten(params)
        moved = [i for i, x in enumerate(leaves) if uncommitted(x)]
        if moved:  # one batched transfer (one call per leaf: 0.36 s at 1,000 leaves)
            placed = jax.device_put([leaves[i] for i in moved], replicated)
            for i, x in zip(moved, placed, strict=True):
                leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    # ------------------------------------------------------------------ batches
    def shard_batch(self, batch: Any) -> Any:
        """Place a process-local batch on the mesh, split along the leading axis.

        On one process this is the global batch; with several processes each passes its own
        slice and the global batch is their concatenation in process order.
        """
        self.batch_guard.check(batch, local=True)
        sharding = self.batch_sharding
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)

        def put(x: Any) -> Any:
            if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
                data = put(jax.random.key_data(x))  # typed keys travel as their uint32 data
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))

        return jax.tree.map(put, batch)

    # ------------------------------------------------------------------ step
    @property
    def step_compiler_options(self) -> dict[str, Any] | None:
        """The options the step compiles with (after ``init``): ``compiler_options`` and the
        passes its collectives need off (stage 0 on GPUs: XLA's ``all-reduce-contiguous``)."""
        return with_passes_off(self.compiler_options, self.plan.passes_off)

    @property
    def step(self) -> Step:
        """``step(state, batch) -> (state, metrics)``, jitted; has ``.lower(state, batch)``."""
        if self._step is None:
            self.layout  # noqa: B018 - raises a clear error before init
            shardings = self._shardings
            out = (shardings, self._sharding(P()))
            jitted = jax.jit(
                self._step_fn,
                donate_argnums=(0,) if self.donate else (),
                out_shardings=out,
                compiler_options=self.step_compiler_options,
            )
            self._step = Step(self, jitted)
        return self._step

    def _step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        strategy, call = self.plan.strategy, self._call
        key = jax.random.fold_in(state.rng, state.step) if call.rng else None
        grads, metrics, model_state = strategy.local_step(
            self.loss_fn, state.params, batch, call, state.model_state, key
        )
        good = None  # where the update is applied (else the input state comes back unchanged)
        history = state.grad_history
        if strategy.spec.checks_spikes:
            skip, reasons, history = spikes.check(
                strategy.spec,
                metrics["grad_norm"],
                grads,
                state.grad_history,
                self.plan.layout.view_leaf_buckets(),
            )
            metrics.update(reasons)
            good = ~skip
        if self.config.check_for_nan_in_grad:
            # Skip the update when any rank saw a non-finite gradient: the caller gets the last
            # good state back even though the input was donated.
            finite = ~jnp.any(metrics["nonfinite_ranks"] > 0)
            good = finite if good is None else good & finite
        target = strategy.target(state)
        if self.donate and strategy.holds_params:  # jaxdp._src.comm.order.hold
            target = hold(target, state.params, metrics["grad_norm"])
        step = state.step + 1
        master: Any = None
        if strategy.offload is not None:  # the update bucket by bucket, its state brought in
            new_target, opt_state, master = self._offloaded_update(
                grads, metrics["grad_norm"], good, state, target
            )
        else:
            new_target, opt_state = optimizer_update(
                self.optimizer,
                grads,
                metrics["grad_norm"],
                state.opt_state,
                target,
                strategy.spec.clip_grad,
                strategy.state_policy,
            )
        if good is not None:
            # Chosen before the params are rebuilt: the working params are the master's cast
            # (gathered), so an unchanged master rebuilds the same params, and the choice reads
            # the optimizer's view (a 1/dp shard at stages 1-3), not the whole params. (The
            # offloaded update chose already, bucket by bucket.)
            if strategy.offload is None:
                new_target = _pick(good, new_target, target)
                opt_state = _pick(good, opt_state, state.opt_state)
            model_state = _pick(good, model_state, state.model_state)
            history = _pick(good, history, state.grad_history)
            step = jnp.where(good, step, state.step)
        params, rebuilt = strategy.rebuild(new_target, state.params, metrics["grad_norm"])
        if strategy.offload is None:
            master = rebuilt
        new = TrainState(
            step=step,
            params=params,
            master=master,
            opt_state=opt_state,
            model_state=model_state,
            rng=state.rng,
            grad_history=history,
        )
        return new, metrics

    def _offloaded_update(
        self, grads: Any, norm: jax.Array, good: Any, state: TrainState, target: Any
    ) -> tuple[Any, Any, Any]:
        """``optimizer_cpu_offload``: the update (and the skip) bucket by bucket, each bucket's
        master weights and optimizer state brought into device memory and written back
        (:func:`jaxdp._src.strategy.offload.update_by_bucket`), the first bucket once the
        gradient norm is computed, so that no state is brought in during the backward pass.
        Returns the new target cast to the working dtypes on the device (what the working
        params are rebuilt from), the optimizer state and the master weights as written back
        (``None`` without a master copy)."""
        strategy, sh = self.plan.strategy, self._shardings
        clip, policy = strategy.spec.clip_grad, strategy.state_policy
        dtypes = strategy.work_view_dtypes()

        def update(g: Any, n: Any, ok: Any, opt: Any, tgt: Any) -> Any:
            new_target, new_opt = optimizer_update(self.optimizer, g, n, opt, tgt, clip, policy)
            if ok is not None:
                new_target, new_opt = _pick(ok, new_target, tgt), _pick(ok, new_opt, opt)
            # the working params' values, cast bucket by bucket: what stays on the device
            # for the rebuild is in the working dtype, as in the on-device step's fusion
            leaves, treedef = jax.tree_util.tree_flatten(new_target)
            work = [x.astype(d) for x, d in zip(leaves, dtypes, strict=True)]
            return new_target, new_opt, jax.tree_util.tree_unflatten(treedef, work)

        buckets = strategy.master_codec.leaf_buckets(target)
        unknown = jax.tree.map(lambda _: None, state.opt_state)
        on_device = jax.tree.map(lambda _: None, target)
        target_sh = sh.master if strategy.has_master else on_device
        out_target_sh = sh.master if strategy.has_master else on_device
        placed, computed = update_by_bucket(
            update,
            (grads, norm, good, state.opt_state, target),
            (buckets, None, None, unknown, buckets),
            (jax.tree.map(lambda _: None, grads), None, None, sh.opt_state, target_sh),
            (out_target_sh, sh.opt_state, on_device),
            start_after=norm,
        )
        master = placed[0] if strategy.has_master else None
        return computed[2], placed[1], master

    # ------------------------------------------------------------------ export
    def params(self, state: TrainState) -> Any:
        """The full, unsharded params pytree, in the dtypes of the params given to ``init``.

        Values come from the fp32 master weights where there are any (so nothing is lost to
        ``param_dtype`` rounding), otherwise from the working params.
        """
        if state.master is None:
            return state.params
        if self._export is None:  # jit once: eval loops call this every few steps
            strategy, master_sh = self.plan.strategy, self._shardings.master

            def export(master: Any) -> Any:  # an offloaded master is read on the device
                return strategy.export(jax.tree.map(to_device, master, master_sh))

            self._export = jax.jit(export, out_shardings=self._sharding(P()))
        return self._export(state.master)

    def model_state(self, state: TrainState) -> Any:
        """The whole model state (as :meth:`params` for the params): the non-trainable state
        given to ``init(params, model_state=...)`` as of ``state``'s step, for eval and export
        (e.g. ``model.apply({"params": dp.params(state), **dp.model_state(state)}, x)``);
        ``None`` when ``init`` got none. It is replicated, so this is ``state.model_state``."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"DataParallel.model_state: state is a {type(state).__name__}; expected the "
                "jaxdp.TrainState returned by init / step."
            )
        return state.model_state


def _mesh_and_group(mesh: Any, config: DDPConfig) -> tuple[Mesh, ReductionGroup]:
    """The engine's mesh and reduction group. With ``num_distributed_optimizer_instances``
    ``N > 1`` the 1-D data mesh is regrouped into ``N`` instances of consecutive devices
    (:func:`jaxdp._src.topology.mesh.instance_mesh`); a mesh that already has the two axes
    (another hierarchical engine's, or the ``(outer, inner)`` of a two-level ``data_axis``)
    is used as it is, its outer axis indexing the instances."""
    n = config.num_distributed_optimizer_instances
    data_axis = config.data_axis
    two_level = isinstance(data_axis, tuple)
    names: tuple[str, str] = data_axis if isinstance(data_axis, tuple) else instance_axes(data_axis)
    outer, inner = names
    field = "DDPConfig.num_distributed_optimizer_instances"
    if isinstance(mesh, Mesh) and (two_level or n > 1) and set(names) <= set(mesh.axis_names):
        if set(mesh.axis_names) != set(names):
            raise ValueError(
                f"DataParallel: data_axis {names} on a mesh with axes {dict(mesh.shape)}; "
                "expected a mesh of exactly those two axes (hierarchical data parallelism "
                "with tensor or expert parallelism is not implemented). Fix: pass "
                f"jax.make_mesh((nodes, gpus_per_node), {names})."
            )
        if n > 1 and int(mesh.shape[outer]) != n:
            raise ValueError(
                f"DataParallel: the mesh has {int(mesh.shape[outer])} instances along "
                f"{outer!r}; {field}={n}. Fix: leave {field.split('.')[1]} at 1 (the mesh "
                "decides), or make the two agree."
            )
        hmesh = auto_mesh(mesh)
    elif two_level and isinstance(mesh, Mesh):
        raise ValueError(
            f"DataParallel: DDPConfig.data_axis={names} but the mesh has axes "
            f"{dict(mesh.shape)}. Fix: pass jax.make_mesh((nodes, gpus_per_node), {names}), "
            "or no mesh (with num_distributed_optimizer_instances=N the default one is "
            "grouped into N instances)."
        )
    else:
        axis = data_axis if isinstance(data_axis, str) else inner
        check_mesh(mesh, axis, config.expert_axis)
        flat = auto_mesh(make_mesh(mesh, axis=axis))
        if n == 1 and not two_level:
            return flat, ReductionGroup(flat, axis, config.expert_axis)
        if n == 1:
            raise ValueError(
                f"DataParallel: DDPConfig.data_axis={names} names a two-level mesh, but none "
                f"was passed and {field}=1. Fix: pass mesh=jax.make_mesh((nodes, "
                f"gpus_per_node), {names}), or set {field.split('.')[1]} to the number of "
                "instances."
            )
        hmesh = instance_mesh(flat, axis, n, names)
    optim = config.outer_dp_sharding_strategy == "optim"
    return hmesh, ReductionGroup(hmesh, inner, None, outer_axis=outer, shard_outer=optim)


def _pick(good: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where the step is applied, else ``old`` (leaf by leaf)."""
    return jax.tree.map(lambda n, o: jnp.where(good, n, o), new, old)


def check_mesh(mesh: Any, data_axis: str, expert_axis: str | None) -> None:
    """A ``Mesh`` given to ``DataParallel`` must have ``data_axis`` (and ``expert_axis`` when
    set)."""
    if expert_axis is not None and not (isinstance(mesh, Mesh) and expert_axis in mesh.axis_names):
        axes = dict(mesh.shape) if isinstance(mesh, Mesh) else "the default 1-D data mesh"
        raise ValueError(
            f"DataParallel: DDPConfig.expert_axis={expert_axis!r} but the mesh is {axes}; "
            f"expected a mesh with axes {data_axis!r} and {expert_axis!r}. Fix: pass mesh="
            f"jax.make_mesh((2, 4), ({data_axis!r}, {expert_axis!r})) or drop expert_axis."
        )
    if isinstance(mesh, Mesh) and data_axis not in mesh.axis_names:
        raise ValueError(
            f"DataParallel: the mesh has axes {dict(mesh.shape)}; expected one named "
            f"{data_axis!r} (DDPConfig.data_axis) to run data parallelism over. Fix: "
            f"build the mesh with a {data_axis!r} axis (e.g. jax.make_mesh((4, 2), "
            f"({data_axis!r}, 'model'))) or set DDPConfig(data_axis=<one of "
            f"{tuple(mesh.axis_names)}>)."
        )


def _working_shapes(params: Any, param_dtype: str | None) -> Any:
    """``ShapeDtypeStruct`` of each param as ``loss_fn`` gets it (floating leaves in
    ``param_dtype``), for the shape-only trace that explains a failed first step."""

    def one(x: Any) -> jax.ShapeDtypeStruct:
        dt = jnp.result_type(x)
        if param_dtype is not None and jnp.issubdtype(dt, jnp.floating):
            dt = jnp.dtype(param_dtype)
        return jax.ShapeDtypeStruct(jnp.shape(x), dt)

    return jax.tree.map(one, params)
