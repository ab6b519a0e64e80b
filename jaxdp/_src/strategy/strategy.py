"""ZeRO strategies: one per row of the ZeRO table, each a small bundle behind one interface.

=====================  =======================  =====================  ===================
strategy               working params           master / opt state     gradient kernel
=====================  =======================  =====================  ===================
:class:`Replicated`    replicated               replicated             all-reduce at end
:class:`ShardedOpt`    replicated (gathered     sharded view           reduce-scatter at
                       after the update)                               end (stage 1) or
                                                                       every micro-batch
                                                                       (stage 2)
:class:`ShardedParams` sharded view (gathered   sharded view           gather in the
                       inside the step)                                differentiated fn
=====================  =======================  =====================  ===================

A strategy is built once by the plan (:func:`jaxdp._src.strategy.plan.build_plan`) from pieces the
plan
chose: two codecs (:mod:`jaxdp._src.forms.codec`: the form of ``TrainState.master`` and of
``TrainState.params``), the gradient kernel (:mod:`jaxdp._src.strategy.kernels`) and the bucket
operations
of the mesh (:mod:`jaxdp._src.comm.nested`). Everything the engine, ``CheckpointManager``,
``jaxdp.aot`` and ``jaxdp-train`` need to know about a stage they ask the strategy:

* the state: :meth:`Strategy.init_state`, :meth:`Strategy.state_shardings`,
  :meth:`Strategy.target`;
* the step: :meth:`Strategy.local_step` (gradients and metrics, in the step's
  ``shard_map``) and :meth:`Strategy.rebuild` (the working params after the update);
* export and checkpoints: :meth:`Strategy.export`, :meth:`Strategy.to_canonical`,
  :meth:`Strategy.from_canonical`, :meth:`Strategy.full_params`;
* reports: :attr:`Strategy.grad_collectives`, :attr:`Strategy.gathers_per_parameter`,
  :meth:`Strategy.bytes_per_step`;
* whether a donated step holds the old params (:attr:`Strategy.holds_params`).

Like an optax ``GradientTransformation`` a strategy holds no arrays: every method is a pure
function of its arguments and the static pieces it was built from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..comm.order import after
from ..core.loss import LossCall, loss_parts
from ..core.state import TrainState
from ..forms.codec import Codec, Offload, StatePolicy
from ..layout.layout import BucketLayout
from ..topology.group import ReductionGroup
from ..topology.sharding import ShardingPlan
from .local import local_gradients
from .spec import StepSpec
from .update import gather_params

__all__ = ["Replicated", "ShardedOpt", "ShardedParams", "Strategy"]


def _cast_like(new: Any, like: Any) -> Any:
    return jax.tree.map(lambda m, p: m.astype(p.dtype), new, like)


class Strategy:
    """The interface every ZeRO strategy implements (module docstring).

    Attributes:
        name: ``"replicated"``, ``"sharded optimizer"`` or ``"sharded params"``.
        spec, layout, sharding, group: what the plan built it from (``spec``:
            :class:`jaxdp._src.strategy.spec.StepSpec`).
        master_codec: the form of ``master`` and the optimizer state (and of the reduced
            gradients the step hands the optimizer).
        state_policy: the optimizer state's storage dtypes
            (:class:`jaxdp._src.forms.codec.StatePolicy`: Adam's moments at
            the config's ``exp_avg_dtype`` / ``exp_avg_sq_dtype``).
        params_codec: the form of the working params between steps.
        has_master: whether ``TrainState.master`` exists (``False`` only at stage 0 with
            params already in the master dtype).
        grad_collectives: HLO opcodes the gradient buckets are reduced with.
        gathers_per_parameter: each parameter is gathered and reduce-scattered on its own,
            XLA combining them: ZeRO-3 (:func:`jaxdp._src.zero3.gather.make_leaf_gather`) and
            stages 1-2
            (:mod:`jaxdp._src.comm.per_param`) with the interleaved layout.
        reduces_per_parameter: each parameter's gradient is reduced by a collective of its
            own, XLA combining them into bucket-sized ones (no bucket pack or unpack): stage 0
            with a ``psum`` on the wire, and wherever ``gathers_per_parameter`` holds.
        params_sharded: the working params are kept sharded between steps (stage 3, and
            stages 1-2 with ``overlap_param_gather``).
        offload: which buckets' master weights and optimizer state live in host memory
            between steps (:class:`jaxdp._src.forms.codec.Offload`), or ``None``.
    """

    name = ""
    gathers_per_parameter = False
    reduces_per_parameter = False
    params_sharded = False

    def __init__(
        self,
        *,
        spec: StepSpec,
        grad_collectives: tuple[str, ...],
        layout: BucketLayout,
        sharding: ShardingPlan,
        group: ReductionGroup,
        optimizer: optax.GradientTransformation,
        state_policy: StatePolicy,
        ops: Any,
        kernel: Callable[..., Any],
        master_codec: Codec,
        params_codec: Codec,
        axis_names: Any,
        offload: Offload | None = None,
    ):
        self.spec, self.layout, self.sharding, self.group = spec, layout, sharding, group
        self.optimizer, self.ops, self.make_kernel = optimizer, ops, kernel
        self.state_policy = state_policy
        self.master_codec, self.params_codec = master_codec, params_codec
        self.axis_names = axis_names  # the step's manual axes
        self.offload = offload
        self.master_dtype = (
            jnp.float64 if any(s.dtype == "float64" for s in layout.slots) else jnp.float32
        )
        self.work_dtypes = [jnp.dtype(spec.param_dtype or s.dtype) for s in layout.slots]
        self.has_master = True
        # the opcode of a bucket's gradient collective (jaxdp.aot labels them by it)
        self.grad_collectives = grad_collectives

    @property
    def holds_params(self) -> bool:
        """Whether a step that donates its state passes the optimizer's target through one
        barrier with the old params and the gradient norm (:func:`jaxdp._src.comm.order.hold`), so
        that
        XLA places no temporaries in the params' buffers and compiles each fusion repeated
        across layers once. Only where the update waits for the norm anyway (one rank;
        clipping) and the params held cost little memory (one rank; sharded params): holding
        replicated params at dp > 1 costs up to their size again at the end of the backward
        pass (BENCHMARKS.md section 13)."""
        return self.group.size == 1 or (self.params_sharded and bool(self.spec.clip_grad))

    # ------------------------------------------------------------------ state
    def _work(self, params: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(params)
        cast = [jnp.asarray(x).astype(d) for x, d in zip(leaves, self.work_dtypes, strict=True)]
        return jax.tree_util.tree_unflatten(self.layout.treedef, cast)

    def init_state(self, params: Any) -> TrainState:
        """Full params -> the strategy's :class:`TrainState` (works under ``eval_shape``)."""
        work = self.params_codec.to_view(self._work(params))
        master = self.master_codec.to_view(params, self.master_dtype) if self.has_master else None
        target = work if master is None else master
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=work,
            master=master,
            opt_state=self.init_opt(target),
        )

    def init_opt(self, target: Any) -> Any:
        """The optimizer's initial state for ``target``, at the policy's storage dtypes."""
        return self.state_policy.store(self.optimizer.init(target))

    def state_shardings(self, abstract: TrainState) -> TrainState:
        """The ``NamedSharding`` of every leaf of an (abstract) state."""
        codec = self.master_codec if self.has_master else self.params_codec
        master = None if abstract.master is None else self.master_codec.shardings(abstract.master)
        opt = codec.opt_shardings(abstract.opt_state)
        if self.offload is not None:  # the state policy: each leaf's memory kind
            if master is not None:
                buckets = self.master_codec.leaf_buckets(abstract.master)
                master = codec.placed(master, buckets, self.offload)
            opt = codec.placed(opt, codec.opt_buckets(abstract.opt_state), self.offload)
        return TrainState(
            step=NamedSharding(self.sharding.mesh, P()),  # type: ignore[arg-type]
            params=self.params_codec.shardings(abstract.params),
            master=master,
            opt_state=opt,
        )

    def work_view_dtypes(self) -> list[Any]:
        """The working dtype of each leaf of the optimizer's target (the master view: one
        leaf per bucket with the megatron layout, else one per parameter)."""
        if not self.has_master:
            return list(self.work_dtypes)
        if self.layout.kind == "megatron":
            return [jnp.dtype(b.dtype) for b in self.layout.buckets]
        return list(self.work_dtypes)

    def target(self, state: TrainState) -> Any:
        """What the optimizer updates: the master weights (or the params without them)."""
        return state.master if self.has_master else state.params

    # ------------------------------------------------------------------ step
    def local_step(
        self,
        loss_fn: Callable[..., Any],
        params: Any,
        batch: Any,
        call: LossCall = LossCall(),  # noqa: B008 - a frozen, hashable default
        model_state: Any = None,
        key: Any = None,
    ) -> tuple[Any, Any, Any]:
        """Reduced gradients (in ``master_codec``'s form), metrics and the synchronised model
        state, in one ``shard_map`` manual over the group's axes (the other axes stay under
        the compiler). ``call``, ``model_state`` and ``key``: see
        :func:`jaxdp._src.strategy.local.local_gradients`."""

        def parts(p: Any, mb: Any) -> Any:
            return loss_parts(loss_fn, self.ops.wire.per_token, p, mb, call)

        def body(p: Any, b: Any, state: Any, k: Any) -> Any:
            kernel = self.make_kernel(parts, self.layout, self.spec, self.ops)
            return local_gradients(
                p,
                b,
                kernel=kernel,
                spec=self.spec,
                wire=self.ops.wire,
                group=self.group,
                call=call,
                model_state=state,
                key=k,
            )

        step = jax.shard_map(
            body,
            mesh=self.sharding.mesh,
            in_specs=(self.params_codec.step_specs(), self.group.batch_spec(), P(), P()),
            out_specs=(self.master_codec.step_specs(), P(), P()),
            axis_names=self.axis_names,
        )
        return step(params, batch, model_state, key)

    def rebuild(self, new_target: Any, params: Any, last: jax.Array) -> tuple[Any, Any]:
        """``(params, master)`` after the update (``params``: the step's input params;
        ``last``: a value every gradient reduction feeds, to order gathers after).

        With one rank, a master leaf in its parameter's working dtype is the working param's
        value too. XLA then wrote the update once and copied it into the other output
        buffer, one copy kernel per leaf. The master goes out as :func:`jaxdp._src.comm.order.after`
        of the norm instead: the same bits, a value of its own that the update's fusion
        writes beside the working param, which brings the kernel launches per step of stages
        1-3 down to about the bare ``jit`` step's (one compile-only GPU, fp32 params;
        BENCHMARKS.md section 12)."""
        work = self._working(new_target, params, last)
        if not self.has_master:
            return work, None
        return work, after(new_target, last) if self.master_apart else new_target

    @property
    def master_apart(self) -> bool:
        """Whether :meth:`rebuild` returns the master as a value of its own: one rank, and a
        master in some parameter's working dtype (where it is that working param's value)."""
        return self.has_master and self.group.size == 1 and self.master_dtype in self.work_dtypes

    def _working(self, new_target: Any, params: Any, last: jax.Array) -> Any:
        """The working params from the updated target (the master where there is one)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ export, checkpoints
    def export(self, master: Any) -> Any:
        """The master weights as whole params in the dtypes ``init`` got."""
        full = jax.tree_util.tree_leaves(self.master_codec.from_view(master))
        cast = [x.astype(s.dtype) for x, s in zip(full, self.layout.slots, strict=True)]
        return jax.tree_util.tree_unflatten(self.layout.treedef, cast)

    def full_params(self, dtype: Any = None) -> Any:
        """Abstract whole params (``ShapeDtypeStruct``), in ``dtype`` or the given dtypes."""
        leaves = [
            jax.ShapeDtypeStruct(ls.shape, dtype or s.dtype)
            for ls, s in zip(self.sharding.leaves, self.layout.slots, strict=True)
        ]
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)

    def to_canonical(self, state: TrainState) -> tuple[Any, Any, Any]:
        """``(params, master or None, opt_state)``, every parameter-shaped leaf in its
        parameter's shape (what a checkpoint stores)."""
        params = self.params_codec.from_view(state.params)
        codec = self.master_codec if self.has_master else self.params_codec
        opt = codec.opt_from_view(state.opt_state, self.target(state))
        master = self.master_codec.from_view(state.master) if self.has_master else None
        return params, master, opt

    def from_canonical(self, step: Any, params: Any, master: Any, opt: Any) -> TrainState:
        """Inverse of :meth:`to_canonical`, from another strategy's checkpoint too. The weights
        of record are ``master`` where the checkpoint has it, else ``params`` (a checkpoint
        written without master weights, whose params are fp32): this strategy's working params
        and master are both cast from them, so restoring a bf16 run into an fp32 one (or the
        reverse) loses nothing the checkpoint held."""
        record = params if master is None else master
        work = self._work(record)
        abstract = jax.eval_shape(self.init_state, work)
        new_master = (
            self.master_codec.to_view(record, self.master_dtype) if self.has_master else None
        )
        codec = self.master_codec if self.has_master else self.params_codec
        opt = codec.opt_to_view(opt, abstract.opt_state)
        opt = jax.tree.map(lambda x, a: x.astype(a.dtype), opt, abstract.opt_state)
        return TrainState(
            step=step, params=self.params_codec.to_view(work), master=new_master, opt_state=opt
        )

    # ------------------------------------------------------------------ reports
    def _bytes(self) -> tuple[float, int, int]:
        """``(ring fraction within the reduction group, gradient bytes, param bytes)``; a
        hierarchical group's ring is the instance."""
        n = self.group.inner_size if self.group.outer_axis else self.group.size
        grad = sum(b.numel * np.dtype(b.grad_dtype).itemsize for b in self.layout.buckets)
        param = sum(b.numel * np.dtype(b.dtype).itemsize for b in self.layout.buckets)
        return (n - 1) / n, grad, param

    def bytes_across_instances(self) -> int:
        """Bytes each rank sends per step across instances (hierarchical groups; 0 when flat):
        its instance's gradient shard all-reduced (``no_shard``) or reduce-scattered
        (``"optim"``, plus the updated params' all-gather back: per micro-batch pass at
        stage 3), with ring collectives."""
        g = self.group
        if g.outer_axis is None:
            return 0
        n, inner = g.outer_size, g.inner_size
        _, grad, param = self._bytes()
        if not g.shard_outer:
            return int(2 * (n - 1) / n * grad / inner)
        gathers = 2 * self.spec.num_microbatches if self.params_sharded else 1
        if self.name == "sharded optimizer" and not self.params_sharded:
            gathers = 1
        return int((n - 1) / n * (grad + gathers * param) / inner)

    def bytes_per_step(self) -> int:
        """Bytes each rank sends per step with ring collectives (within the instance and,
        :meth:`bytes_across_instances`, across instances)."""
        raise NotImplementedError


class Replicated(Strategy):
    """Stage 0: everything replicated over the data axis; one all-reduce per bucket (or per
    parameter, combined by XLA: :class:`jaxdp._src.comm.per_param.AllReduceOps`)."""

    name = "replicated"

    def __init__(self, *, per_parameter: bool, **kw: Any):
        super().__init__(**kw)
        self.reduces_per_parameter = per_parameter
        self.has_master = any(d != self.master_dtype for d in self.work_dtypes)
        self.grad_collectives = ("all-reduce",)

    def _working(self, new_target: Any, params: Any, last: jax.Array) -> Any:
        return _cast_like(new_target, params) if self.has_master else new_target

    def bytes_per_step(self) -> int:
        frac, grad, _ = self._bytes()
        return int(2 * grad * frac)


class ShardedOpt(Strategy):
    """Stages 1-2: master weights and optimizer state sharded over the data axis; gradients
    reduce-scattered once (stage 1) or every micro-batch (stage 2); the working params
    gathered after the update (or, with ``overlap_param_gather``, kept sharded and gathered
    at the start of the next step). ``gathers_globally``: that gather is the partitioner's
    (:meth:`_gather_global`), not a ``shard_map`` of its own."""

    name = "sharded optimizer"

    def __init__(
        self,
        *,
        scatters_per_step: int,
        params_sharded: bool,
        per_parameter: bool,
        gathers_globally: bool = False,
        **kw: Any,
    ):
        super().__init__(**kw)
        self.scatters = scatters_per_step
        self.params_sharded = params_sharded
        self.gathers_per_parameter = self.reduces_per_parameter = per_parameter
        self.gathers_globally = gathers_globally

    def _gather(self, new: Any, params: Any, last: jax.Array) -> Any:
        if self.gathers_globally:
            return self._gather_global(new)
        return gather_params(new, last, self.master_codec, self.params_codec, self.ops)

    def _gather_global(self, new: Any) -> Any:
        """Each new master shard cast to its working dtype and constrained to be replicated:
        the partitioner gathers it (one all-gather per parameter, which XLA combines as it
        does jaxdp's own, :func:`jaxdp._src.comm.per_param.gather_leaves`), and the padding is
        sliced
        off and the shape restored on the whole array. Where the layout's views are one flat
        array per parameter and every parameter is whole on each device (the plan's
        ``gathers_globally``), this is the same program without a second ``shard_map``, whose
        cost in Shardy and the SPMD partitioner grows with the square of its operands
        (BENCHMARKS.md section 7)."""
        replicated = NamedSharding(self.sharding.mesh, P())
        leaves = jax.tree_util.tree_leaves(new)
        work = [
            jax.lax.with_sharding_constraint(x.astype(d), replicated)
            for x, d in zip(leaves, self.work_dtypes, strict=True)
        ]
        return self.layout.from_global_view(work)

    def _working(self, new_target: Any, params: Any, last: jax.Array) -> Any:
        # overlap_param_gather: the next step gathers them; just cast the new master shards
        if self.params_sharded:
            return _cast_like(new_target, params)
        return self._gather(new_target, params, last)

    def bytes_per_step(self) -> int:
        frac, grad, param = self._bytes()
        return int((self.scatters * grad + param) * frac) + self.bytes_across_instances()


class ShardedParams(Strategy):
    """Stage 3: working params sharded too, gathered bucket by bucket (or layer by layer)
    inside every micro-batch's forward and backward pass."""

    name = "sharded params"
    params_sharded = True

    def __init__(self, *, per_parameter: bool, **kw: Any):
        super().__init__(**kw)
        self.gathers_per_parameter = self.reduces_per_parameter = per_parameter

    def _working(self, new_target: Any, params: Any, last: jax.Array) -> Any:
        return _cast_like(new_target, params)

    def bytes_per_step(self) -> int:
        frac, grad, param = self._bytes()
        g = self.spec.num_microbatches
        return int((g * grad + 2 * g * param) * frac) + self.bytes_across_instances()
