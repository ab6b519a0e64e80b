"""``DataParallel``: a jitted training step with bucketed gradient reduction and ZeRO 0-3.

One step, all in one XLA program:

1. ``shard_map`` over the data axis: each rank computes the gradient of its local batch with
   respect to a *varying* copy of the replicated params (so autodiff inserts no collective),
   accumulating micro-batches ``1..G-1`` in a ``lax.scan`` into flat fp32 bucket buffers with no
   communication; the last micro-batch is peeled out of the scan so that its backward pass and
   the bucket collectives sit in one straight-line region XLA can overlap. Then one collective
   per bucket: all-reduce (stage 0) or reduce-scatter (stages 1-2). Stage 2 reduce-scatters
   every micro-batch into a sharded accumulator instead (``G`` times the communication,
   ``1/dp`` of the accumulator memory).
2. Global-norm clipping (fp32 norm over all shards) and the optax update, on sharded arrays
   (stages >= 1: rank ``r`` updates its shard of the fp32 master weights and optimizer state).
3. Stages 1-2: one all-gather per bucket rebuilds the working params in ``param_dtype``.
   Stage 3 and ``overlap_param_gather`` keep them sharded instead (the cast of the new master
   shards) and gather them inside the next step (:mod:`jaxdp._gather`).

This module is the facade: state, shardings, batch checks and the jitted step. The per-device
half (1.) is :mod:`jaxdp._local`, the global half (2., 3.) :mod:`jaxdp._update`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._config import DDPConfig
from ._layout import BucketLayout
from ._local import local_gradients
from ._mesh import auto_mesh, make_mesh
from ._multiaxis import (
    batch_spec,
    check_mesh,
    dense_dp,
    gather,
    layout_for,
    local_step,
    read_plan,
    state_shardings,
)
from ._optim_check import check_optimizer
from ._step import _batch_signature, _Step
from ._update import gather_params, optimizer_update
from ._zero3_scan import find_stacks, warn_if_undetected

__all__ = ["DataParallel", "TrainState"]


class TrainState(NamedTuple):
    """The training state, a pytree of globally sharded arrays.

    Attributes:
        step: number of completed steps (int32 scalar, replicated).
        params: working params in ``param_dtype``. Replicated params-shaped tree at stages 0-2
            (what the forward pass uses). With ``zero_stage=3`` or ``overlap_param_gather``
            they are sharded like ``master``: the layout's shard view (interleaved: one 1-D
            leaf per parameter, flattened and zero-padded to a multiple of dp; megatron: one
            array per bucket), cast to ``param_dtype`` and sharded ``P(data_axis)``, so each
            rank holds ``1/dp`` of them between steps; the step gathers them bucket by bucket.
            Scanned layer stacks at stage 3 (``BucketLayout.stacked``) are laid out per layer
            instead (rank ``r``'s block is piece ``r`` of every layer) and gathered one layer
            per scan iteration.
            Always the cast of ``master`` to the working dtype.
        master: fp32 master weights. ``None`` at stage 0 when the params are already fp32;
            replicated params-shaped tree at stage 0; at stages >= 1 the layout's sharded view
            (interleaved: each parameter flattened and zero-padded to a multiple of dp,
            sharded over the data axis).
        opt_state: the optax state of ``master`` (or of ``params`` when ``master`` is None),
            sharded like it.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any


class DataParallel:
    """Data-parallel training with Megatron's gradient machinery.

    Args:
        loss_fn: ``loss_fn(params, microbatch) -> loss`` (mean over the micro-batch) or
            ``-> (loss, aux)``; with ``config.calculate_per_token_loss`` it returns
            ``(loss_sum, num_tokens)``.
        optimizer: an ``optax.GradientTransformation``.
        config: a :class:`DDPConfig`.
        mesh: a mesh with ``config.data_axis`` (default: :func:`make_mesh` over all devices);
            its axes are used as ``Auto`` axes (see :func:`jaxdp._mesh.auto_mesh`). Params
            keep their shardings over its other axes (tensor parallelism, README "With
            tensor / expert parallelism"); see ``DDPConfig.expert_axis`` for experts.
        donate: donate the input state to the step (saves a copy of params and optimizer
            state; the input state is unusable afterwards).

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
    ):
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
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        check_mesh(mesh, config)
        self.mesh = auto_mesh(make_mesh(mesh, axis=config.data_axis))
        self.dp = dense_dp(self.mesh, config)  # |data| (x |expert| with expert parallelism)
        self.donate = donate
        self._layout: BucketLayout | None = None
        self._batch_sig: Any = None
        self._step: _Step | None = None
        self._export: Any = None
        self._plan: Any = None  # the params' shardings over the other mesh axes (_sharding.py)

    # ------------------------------------------------------------------ properties
    @property
    def layout(self) -> BucketLayout:
        """The :class:`BucketLayout` of the params (available after :meth:`init`)."""
        if self._layout is None:
            raise RuntimeError(
                "DataParallel.layout: the layout is built from the params; call init(params) "
                "first (jax.eval_shape(dp.init, params) is enough)."
            )
        return self._layout

    @property
    def state_shardings(self) -> TrainState:
        """The ``NamedSharding`` of every :class:`TrainState` leaf (available after ``init``)."""
        self.layout  # noqa: B018 - raises a clear error before init
        return self._shardings

    def _sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def _sharded(self) -> bool:
        return self.config.zero_stage >= 1

    # ------------------------------------------------------------------ init
    def _master_dtype(self, layout: BucketLayout) -> Any:
        return jnp.float64 if any(s.dtype == "float64" for s in layout.slots) else jnp.float32

    @property
    def _multi(self) -> bool:  # params split over a non-data axis, or an expert axis
        return self._plan is not None and not self._plan.trivial

    def _build_layout(
        self, params: Any, param_specs: Any = None, example_batch: Any = None
    ) -> BucketLayout:
        plan = read_plan(params, self.mesh, self.config, param_specs, self._plan)
        if plan.trivial:
            prev = dict(self._layout.stacked) if self._layout is not None else None
            stacks = find_stacks(self.loss_fn, params, example_batch, self.config, self.dp, prev)
            layout = BucketLayout.from_params(params, self.config, self.dp, stacked=stacks)
        else:
            layout = layout_for(plan, params, self.config, self.dp)
        if self._layout is not None and self._layout != layout:
            raise ValueError(
                "DataParallel.init: these params have a different structure, shapes or dtypes "
                "than the ones this engine was initialised with. Fix: build a new DataParallel "
                "for a different model."
            )
        if not plan.trivial and self.config.shards_params:
            raise NotImplementedError(
                "DataParallel.init: params split over the mesh axes "
                f"{list(plan.auto_axes)} (tensor parallelism) "
                f"with zero_stage={self.config.zero_stage}, overlap_param_gather="
                f"{self.config.overlap_param_gather} keep their working params sharded over the "
                "data axis too, which is not supported on a multi-axis mesh yet; expected "
                "zero_stage <= 2 without overlap_param_gather. Fix: use zero_stage=1 or 2."
            )
        check_optimizer(self.optimizer, layout, self._master_dtype(layout))
        self._plan = plan
        return layout

    def _init_fn(self, params: Any) -> TrainState:
        layout = self.layout
        mdt = self._master_dtype(layout)
        work_dt = [jnp.dtype(self.config.param_dtype or s.dtype) for s in layout.slots]
        leaves = jax.tree_util.tree_leaves(params)
        work = jax.tree_util.tree_unflatten(
            layout.treedef, [jnp.asarray(x).astype(d) for x, d in zip(leaves, work_dt, strict=True)]
        )
        if self.config.shards_params:
            work = layout.to_global_view(work)  # already in the working dtypes
        if self._sharded:
            master = (
                self._plan.to_global_view(layout, params, mdt)
                if self._multi
                else layout.to_global_view(params, mdt)
            )
        elif all(d == mdt for d in work_dt):
            master = None
        else:
            master = jax.tree.map(lambda x: jnp.asarray(x).astype(mdt), params)
        target = work if master is None else master
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=work,
            master=master,
            opt_state=self.optimizer.init(target),
        )

    def _state_shardings(self, abstract: TrainState) -> TrainState:
        if self._multi:
            return state_shardings(self._plan, self.layout, abstract, self._sharded, TrainState)
        rep = self._sharding(P())
        if not self._sharded:
            return jax.tree.map(lambda _: rep, abstract)
        shard = self._sharding(P(self.config.data_axis))
        return TrainState(
            step=rep,  # type: ignore[arg-type]
            params=jax.tree.map(
                lambda _: shard if self.config.shards_params else rep, abstract.params
            ),
            master=jax.tree.map(lambda _: shard, abstract.master),
            opt_state=jax.tree.map(lambda x: shard if x.ndim >= 1 else rep, abstract.opt_state),
        )

    def init(
        self, params: Any, example_batch: Any = None, *, param_specs: Any = None
    ) -> TrainState:
        """Build the layout and the sharded :class:`TrainState` from a full params pytree.

        Works under ``jax.eval_shape`` (then nothing is allocated). ``example_batch`` (a global
        batch like ``step``'s, arrays or ``jax.ShapeDtypeStruct``; only shapes are used) lets
        ``zero_stage=3`` detect scanned layer stacks and gather them one layer per scan
        iteration (``DDPConfig.scan_layers``); without it only ``scan_param_patterns`` apply.
        On a multi-axis mesh each param keeps the ``NamedSharding`` it carries over the non-data
        axes (tensor parallelism), or the ``PartitionSpec`` given for it in ``param_specs`` (a
        pytree like ``params``; needed under ``jax.eval_shape`` the first time, as tracers
        carry none).
        """
        self._layout = self._build_layout(params, param_specs, example_batch)
        self._detected = example_batch is not None
        abstract = jax.eval_shape(self._init_fn, params)
        shardings = self._state_shardings(abstract)
        self._shardings = shardings
        return jax.jit(self._init_fn, out_shardings=shardings)(params)

    # ------------------------------------------------------------------ batches
    def shard_batch(self, batch: Any) -> Any:
        """Place a process-local batch on the mesh, split along the leading axis.

        On one process this is the global batch; with several processes each passes its own
        slice and the global batch is their concatenation in process order.
        """
        self._check_batch(batch, local=True)
        sharding = self._sharding(batch_spec(self.config))
        if jax.process_count() == 1:
            return jax.device_put(batch, sharding)

        def put(x: Any) -> Any:
            if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
                data = put(jax.random.key_data(x))  # typed keys travel as their uint32 data
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))

        return jax.tree.map(put, batch)

    def _check_batch(self, batch: Any, local: bool = False) -> None:
        if not getattr(self, "_detected", True):  # once: init got no batch to find stacks
            self._detected = True
            warn_if_undetected(self, batch)
        sig = _batch_signature(batch)
        if not sig:
            raise ValueError(
                "DataParallel.step: the batch has no array leaves; expected a pytree of arrays "
                "whose leading axis is the global batch."
            )
        g, dp = self.config.num_microbatches, self.dp
        div = g * (dp // jax.process_count() if local else dp)
        lead = {s[1][0] if s[1] else None for s in sig}
        if None in lead or len(lead) != 1:
            sized = lead - {None}
            for p, sh, dt in sig:
                if not sh and dt.startswith("key<"):  # _batch_signature's typed-key dtype names
                    size = sized.pop() if len(sized) == 1 else "global_batch"
                    raise ValueError(
                        f"DataParallel.step: batch leaf {p} is a single PRNG key (shape (), "
                        f"dtype {dt}); expected one key per example along the batch's leading "
                        "axis (a scalar has no batch axis to split over the devices). Fix: "
                        f"split it, e.g. jax.random.split(key, {size}), and jax.vmap over the keys "
                        "in loss_fn."
                    )
            raise ValueError(
                "DataParallel.step: every batch leaf must share one leading (batch) axis; got "
                f"shapes {[(p, sh) for p, sh, _ in sig]}. Fix: stack examples along axis 0."
            )
        n = lead.pop()
        assert n is not None
        if n % div or n == 0:
            raise ValueError(
                f"DataParallel.step: the batch's leading dimension is {n}; expected a positive "
                f"multiple of num_microbatches x dp = {g} x "
                f"{div // g} = {div}. Fix: use a global batch of "
                f"{max(div, n // div * div)} (or {(n // div + 1) * div})."
            )
        treedef = jax.tree_util.tree_structure(batch)
        rest = [(p, sh[1:], dt) for p, sh, dt in sig]
        if self._batch_sig is None:
            self._batch_sig = (treedef, rest)
            return
        want_def, want_rest = self._batch_sig
        if treedef != want_def:
            raise ValueError(
                f"DataParallel.step: the batch's tree structure {treedef} differs from the first "
                f"batch's {want_def}. Fix: keep the same keys in every batch."
            )
        for (p, shape, dt), (_, wshape, wdt) in zip(rest, want_rest, strict=True):
            if shape != wshape or dt != wdt:
                raise ValueError(
                    f"DataParallel.step: batch leaf {p} has per-example shape {shape} and dtype "
                    f"{dt}; expected {wshape} and {wdt} as in the first batch. Fix: pad or cast "
                    "the batch (a new shape would also force a recompilation)."
                )

    # ------------------------------------------------------------------ step
    @property
    def step(self) -> _Step:
        """``step(state, batch) -> (state, metrics)``, jitted; has ``.lower(state, batch)``."""
        if self._step is None:
            self.layout  # noqa: B018 - raises a clear error before init
            shardings = self._shardings
            out = (shardings, self._sharding(P()))
            jitted = jax.jit(
                self._step_fn,
                donate_argnums=(0,) if self.donate else (),
                out_shardings=out,
            )
            self._step = _Step(self, jitted)
        return self._step

    def _step_fn(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        cfg, axis = self.config, self.config.data_axis
        if self._multi:  # params split over other mesh axes, or experts (_multiaxis.py)
            grads, metrics = local_step(
                self.loss_fn, self._plan, self.layout, cfg, state.params, batch
            )
            return self._finish(state, grads, metrics)
        local = jax.shard_map(
            functools.partial(
                local_gradients, loss_fn=self.loss_fn, layout=self.layout, config=cfg
            ),
            mesh=self.mesh,
            in_specs=(P(axis) if cfg.shards_params else P(), P(axis)),
            out_specs=(P(axis) if self._sharded else P(), P()),
        )
        grads, metrics = local(state.params, batch)
        return self._finish(state, grads, metrics)

    def _finish(self, state: TrainState, grads: Any, metrics: dict[str, Any]) -> Any:
        cfg = self.config
        target = state.params if state.master is None else state.master
        new_target, opt_state = optimizer_update(
            self.optimizer, grads, metrics["grad_norm"], state.opt_state, target, cfg
        )
        if self._sharded and self._multi:
            params, master = gather(new_target, self._plan, self.layout, cfg), new_target
        elif cfg.shards_params:  # the next step gathers them: just cast the new master shards
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), new_target, state.params)
            master = new_target
        elif self._sharded:
            params = gather_params(new_target, self.layout, cfg, self.mesh, metrics["grad_norm"])
            master = new_target
        elif state.master is None:
            params, master = new_target, None
        else:
            master = new_target
            params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, state.params)
        new = TrainState(step=state.step + 1, params=params, master=master, opt_state=opt_state)
        if cfg.check_for_nan_in_grad:
            # Skip the update when any rank saw a non-finite gradient: the caller gets the last
            # good state back even though the input was donated.
            good = ~jnp.any(metrics["nonfinite_ranks"] > 0)
            new = jax.tree.map(lambda n, o: jnp.where(good, n, o), new, state)
        return new, metrics

    # ------------------------------------------------------------------ export
    def params(self, state: TrainState) -> Any:
        """The full, unsharded params pytree, in the dtypes of the params given to ``init``.

        Values come from the fp32 master weights where there are any (so nothing is lost to
        ``param_dtype`` rounding), otherwise from the working params.
        """
        if state.master is None:
            return state.params
        if self._export is None:  # jit once: eval loops call this every few steps
            self._export = jax.jit(self._export_fn, out_shardings=self._sharding(P()))
        return self._export(state.master)

    def _export_fn(self, master: Any) -> Any:
        layout = self.layout
        if self._sharded and self._multi:
            full = self._plan.from_global_view(layout, master)
        else:
            full = layout.from_global_view(master) if self._sharded else master
        leaves = jax.tree_util.tree_leaves(full)
        cast = [x.astype(s.dtype) for x, s in zip(leaves, layout.slots, strict=True)]
        return jax.tree_util.tree_unflatten(layout.treedef, cast)
