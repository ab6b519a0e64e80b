"""The engine's pieces for meshes where parameters are split over other axes than the data axis.

:class:`jaxdp.DataParallel` calls these when its :class:`ShardingPlan` is not trivial (some
parameter is split over a non-data axis, e.g. tensor parallelism on a ``data x model`` mesh).
The step's ``shard_map`` is then manual over the data axis only (``axis_names=``), so the
model's own code and sharding annotations run under the compiler unchanged; the bucket work
runs in nested ``shard_map`` regions on the rank-local blocks (:mod:`jaxdp._nested`). On a mesh
where every parameter is replicated over the other axes the engine's 1-D path runs as before.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ._config import DDPConfig
from ._expert import bucket_groups, group_config
from ._layout import BucketLayout
from ._local import local_gradients
from ._nested import NestedOps, PlainOps, gather_params_nested
from ._sharding import ShardingPlan

__all__ = ["check_mesh", "layout_for", "local_step", "read_plan", "state_shardings"]


def check_mesh(mesh: Any, config: DDPConfig) -> None:
    """A ``Mesh`` given to ``DataParallel`` must have ``config.data_axis`` (and
    ``config.expert_axis`` when set)."""
    ea = config.expert_axis
    if ea is not None and config.zero_stage >= 1:
        raise NotImplementedError(
            f"DataParallel: expert_axis={ea!r} with zero_stage={config.zero_stage} is not "
            "implemented yet (expert buffers would need their own ZeRO shard over the "
            "expert-data-parallel group); expected zero_stage=0. Fix: use zero_stage=0 with "
            "expert parallelism."
        )
    if ea is not None and not (isinstance(mesh, Mesh) and ea in mesh.axis_names):
        axes = dict(mesh.shape) if isinstance(mesh, Mesh) else "the default 1-D data mesh"
        raise ValueError(
            f"DataParallel: DDPConfig.expert_axis={ea!r} but the mesh is {axes}; expected a "
            f"mesh with axes {config.data_axis!r} and {ea!r}. Fix: pass mesh=jax.make_mesh("
            f"(2, 4), ({config.data_axis!r}, {ea!r})) or drop expert_axis."
        )
    if isinstance(mesh, Mesh) and config.data_axis not in mesh.axis_names:
        raise ValueError(
            f"DataParallel: the mesh has axes {dict(mesh.shape)}; expected one named "
            f"{config.data_axis!r} (DDPConfig.data_axis) to run data parallelism over. Fix: "
            f"build the mesh with a {config.data_axis!r} axis (e.g. jax.make_mesh((4, 2), "
            f"({config.data_axis!r}, 'model'))) or set DDPConfig(data_axis=<one of "
            f"{tuple(mesh.axis_names)}>)."
        )


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def read_plan(
    params: Any, mesh: Any, config: DDPConfig, param_specs: Any, previous: ShardingPlan | None
) -> ShardingPlan:
    """The params' non-data shardings. Under ``jax.eval_shape`` (tracer leaves carry no
    sharding) the plan of a previous ``init`` is reused unless ``param_specs`` is given."""
    if (
        param_specs is None
        and previous is not None
        and any(_is_tracer(x) for x in jax.tree_util.tree_leaves(params))
    ):
        param_specs = [ls.pspec for ls in previous.leaves]
        treedef = jax.tree_util.tree_structure(params)
        param_specs = jax.tree_util.tree_unflatten(treedef, param_specs)
    plan = ShardingPlan.from_params(
        params,
        mesh,
        config.data_axis,
        param_specs,
        expert_axis=config.expert_axis,
        expert_patterns=config.expert_param_patterns,
    )
    if not plan.trivial and config.zero_stage >= 1 and config.bucket_layout == "megatron":
        raise NotImplementedError(
            "DataParallel: bucket_layout='megatron' with parameters split over "
            f"{plan.auto_axes} is not implemented; expected bucket_layout='interleaved' (the "
            "default) on a multi-axis mesh. Fix: drop bucket_layout='megatron'."
        )
    return plan


def layout_for(plan: ShardingPlan, params: Any, config: DDPConfig, dp: int) -> BucketLayout:
    """The bucket layout of the rank-local blocks (the params themselves on a 1-D mesh)."""
    if plan.trivial:
        return BucketLayout.from_params(params, config, dp)
    return BucketLayout.from_params(
        plan.local_params(params), config, dp, shard_axes=plan.buffer_keys()
    )


def _slot_paths(layout: BucketLayout) -> list[tuple[Any, ...]]:
    dummy = jax.tree_util.tree_unflatten(layout.treedef, list(range(len(layout.slots))))
    return [tuple(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]]


def _match(
    path: tuple[Any, ...],
    shape: tuple[int, ...],
    paths: list[tuple[Any, ...]],
    shapes: list[tuple[int, ...]],
) -> int | None:
    """Index of the parameter whose key path ends ``path`` and whose shape is ``shape``."""
    for i, (kp, sh) in enumerate(zip(paths, shapes, strict=True)):
        if len(kp) and tuple(path[-len(kp) :]) == kp and tuple(shape) == tuple(sh):
            return i
    return None


def state_shardings(
    plan: ShardingPlan, layout: BucketLayout, abstract: Any, sharded: bool, state_cls: Any
) -> Any:
    """``NamedSharding`` of every state leaf: params keep their specs; master and optimizer
    state are split like their parameter (stage 0) or like its ZeRO view (stages >= 1).
    Optimizer-state leaves are matched to parameters by key-path suffix and shape; others
    (step counts) are replicated."""
    rep = plan.sharding(P())
    paths = _slot_paths(layout)
    param_sh = [plan.sharding(s) for s in plan.param_specs()]
    if sharded:
        target_sh = [plan.sharding(s) for s in plan.view_specs()]
        target_shapes = plan.view_shapes(layout)
    else:
        target_sh, target_shapes = param_sh, [ls.shape for ls in plan.leaves]

    def by_param(path: Any, x: Any) -> Any:
        i = _match(tuple(path), tuple(x.shape), paths, target_shapes)
        return rep if i is None else target_sh[i]

    params = jax.tree_util.tree_unflatten(layout.treedef, param_sh)
    master = None
    if abstract.master is not None:
        master = jax.tree_util.tree_unflatten(layout.treedef, target_sh)
    opt = jax.tree_util.tree_map_with_path(by_param, abstract.opt_state)
    return state_cls(step=rep, params=params, master=master, opt_state=opt)


def dense_dp(mesh: Any, config: DDPConfig) -> int:
    """Size of the dense data-parallel group: the data axis, times the expert axis if any."""
    n = int(mesh.shape[config.data_axis])
    return n * int(mesh.shape[config.expert_axis]) if config.expert_axis else n


def batch_spec(config: DDPConfig) -> P:
    """How a global batch is split: over the data axis, and the expert axis if any."""
    if config.expert_axis is None:
        return P(config.data_axis)
    return P((config.data_axis, config.expert_axis))


def local_step(
    loss_fn: Any, plan: ShardingPlan, layout: BucketLayout, config: DDPConfig, params: Any, batch
) -> tuple[Any, dict[str, Any]]:
    """Reduced gradients and metrics, ``shard_map`` manual over the data (and expert) axis
    only; the other axes stay under the compiler."""
    sharded = config.zero_stage >= 1
    cfg, groups = config, None
    if plan.expert_axis is not None:
        groups = bucket_groups(layout, config, plan.mesh)
        cfg = group_config(config, plan.manual_axes)  # loss, token and NaN sums: dense group
    if plan.auto_axes:
        ops: PlainOps = NestedOps(layout, cfg, plan, groups)
    else:
        ops = PlainOps(layout, cfg, plan, groups)
    manual = plan.manual_axes
    param_specs = jax.tree_util.tree_unflatten(
        layout.treedef, [ls.spec_over(manual) for ls in plan.leaves]
    )
    if sharded:
        grad_specs = jax.tree_util.tree_unflatten(
            layout.treedef,
            [P(None, config.data_axis) if ls.axes else P(config.data_axis) for ls in plan.leaves],
        )
    else:
        grad_specs = param_specs
    body = functools.partial(local_gradients, loss_fn=loss_fn, layout=layout, config=cfg, ops=ops)
    local = jax.shard_map(
        body,
        mesh=plan.mesh,
        in_specs=(param_specs, batch_spec(config)),
        out_specs=(grad_specs, P()),
        axis_names=set(manual),
    )
    return local(params, batch)


def gather(view: Any, plan: ShardingPlan, layout: BucketLayout, config: DDPConfig) -> Any:
    """Stages >= 1: the working params from the sharded master view."""
    return gather_params_nested(view, layout, config, plan)
