"""``CheckpointManager``: orbax checkpoints of a :class:`TrainState` that reshard on restore.

A checkpoint does not store the engine's sharded layout. It stores the *canonical* state:
the working params, the fp32 master weights and every parameter-shaped leaf of the optimizer
state, each in the shape of its parameter (the ZeRO global view is un-padded and reshaped on
the way out and rebuilt for the new engine on the way in). A checkpoint written by 8 devices at
ZeRO stage 1 therefore restores exactly into 4 devices at stage 2, or stage 0, or another
bucket size: the values are copied, never recomputed.

Writing goes through ``orbax.checkpoint.CheckpointManager``: asynchronous (``save`` returns
once the arrays are copied off the devices) and atomic (orbax writes into a temporary folder
and renames it when complete, so a run killed mid-save leaves the previous checkpoint as the
latest one). Each process writes only the shards it holds.

Beside the arrays a small JSON item records every saved leaf's path, shape and dtype, so that a
checkpoint from another model is refused with the name of the first parameter that differs.

Optimizer-state leaves are saved at the dtype the state holds them in (Adam's moments at
``DDPConfig.exp_avg_dtype`` / ``exp_avg_sq_dtype``) and read back at that dtype, then cast to
the restoring engine's: a bfloat16-moment checkpoint restores exactly into a float32-moment
engine, and a float32 one into a bfloat16 engine rounds to nearest, as the step itself does.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..core.state import TrainState
from ..forms.codec import Owners
from ..strategy.offload import to_device
from ..strategy.spikes import history0
from .engine import DataParallel

__all__ = ["CheckpointManager", "CheckpointMismatchError"]

_FORMAT = 1


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the engine's model or optimizer (names the first difference)."""


def _key(i: int) -> str:
    return f"{i:05d}"


def _leaf_paths(tree: Any) -> list[str]:
    return [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _first_difference(got: list[Any], want: list[Any]) -> str:
    """The first ``(path, shape)`` entry where ``got`` and ``want`` differ, for an error message."""
    return next(
        (f"{g} vs expected {e}" for g, e in zip(got, want) if g != e),
        f"{len(got)} leaves vs expected {len(want)}",
    )


class CheckpointManager:
    """Save and restore a :class:`TrainState` of ``engine``, resharding on restore.

    Args:
        directory: folder of the checkpoints (one sub-folder per step; created if missing).
        engine: the :class:`DataParallel` whose states are saved and restored. It must have
            been initialised (``engine.init(params)``, or ``jax.eval_shape(engine.init,
            params)`` when the state will come from a checkpoint anyway).
        max_to_keep: how many of the newest checkpoints to keep (older ones are deleted).

    Example:
        >>> import tempfile, jax.numpy as jnp, optax
        >>> from jaxdp import CheckpointManager, DataParallel, DDPConfig
        >>> def loss_fn(p, b):
        ...     return jnp.mean((b["x"] @ p["w"]) ** 2)
        >>> dp = DataParallel(loss_fn, optax.adam(1e-2), DDPConfig(zero_stage=1))
        >>> state = dp.init({"w": jnp.ones((4, 3))})
        >>> ckpt = CheckpointManager(tempfile.mkdtemp(), dp)
        >>> ckpt.save(0, state)
        >>> ckpt.wait_until_finished()
        >>> ckpt.latest_step(), dp.params(ckpt.restore())["w"].shape
        (0, (4, 3))
        >>> ckpt.close()
    """

    def __init__(self, directory: str | os.PathLike[str], engine: DataParallel, *, max_to_keep=3):
        if not isinstance(engine, DataParallel):
            raise TypeError(
                f"CheckpointManager: engine is a {type(engine).__name__}; expected a "
                "jaxdp.DataParallel. Fix: CheckpointManager(directory, engine)."
            )
        if not isinstance(max_to_keep, int) or isinstance(max_to_keep, bool) or max_to_keep < 1:
            raise ValueError(
                f"CheckpointManager: max_to_keep={max_to_keep!r}; expected an int >= 1. "
                "Fix: e.g. max_to_keep=3."
            )
        engine.layout  # noqa: B018 - a clear error when the engine was never initialised
        self.engine = engine
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True
        )
        self._mngr = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "meta")
        )
        self._to_canonical: Any = None
        self._from_canonical: Any = None

    # ------------------------------------------------------------------ queries
    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None when there is none."""
        self._mngr.reload()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of every complete checkpoint, oldest first."""
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def wait_until_finished(self) -> None:
        """Block until every pending asynchronous save is on disk."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's background threads."""
        self._mngr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ canonical form
    @property
    def _strategy(self) -> Any:
        return self.engine.plan.strategy

    def _param_paths(self) -> list[str]:
        return _leaf_paths(self._strategy.full_params())

    def _canonical_opt_abstract(self) -> Any:
        """The optimizer state's structure over param-shaped (not view-shaped) weights."""
        return jax.eval_shape(self.engine.optimizer.init, self._strategy.full_params(jnp.float32))

    def _canonical_fn(self, state: TrainState) -> dict[str, Any]:
        # An offloaded master and optimizer state (DDPConfig.optimizer_cpu_offload) are read
        # on the device, where the canonical form is computed.
        sh = self.engine.state_shardings
        state = state._replace(
            master=jax.tree.map(to_device, state.master, sh.master),
            opt_state=jax.tree.map(to_device, state.opt_state, sh.opt_state),
        )
        params, master, opt = self._strategy.to_canonical(state)
        out: dict[str, Any] = {
            "step": state.step,
            "params": _as_dict(params),
            "opt_state": _as_dict(opt),
        }
        if master is not None:
            out["master"] = _as_dict(master)
        if state.model_state is not None:
            out["model_state"] = _as_dict(state.model_state)
        if state.rng is not None:
            out["rng"] = jax.random.key_data(state.rng)  # typed keys are stored as their data
        if state.grad_history is not None:  # check_for_large_grads: per-bucket norms
            out["grad_history"] = {"norms": state.grad_history[0], "count": state.grad_history[1]}
        return out

    def _with_extras(self, abstract: TrainState) -> TrainState:
        """``abstract`` with the engine's (abstract) model state and key."""
        eng = self.engine.abstract_state
        return abstract._replace(
            model_state=eng.model_state, rng=eng.rng, grad_history=eng.grad_history
        )

    def _meta(self, canonical: Any, opt_paths: list[str], rng_impl: str | None) -> dict[str, Any]:
        full = jax.tree_util.tree_leaves(self._strategy.full_params())
        return {
            "format": _FORMAT,
            "params": [
                [p, list(x.shape), jnp.dtype(x.dtype).name]
                for p, x in zip(self._param_paths(), full, strict=True)
            ],
            "has_master": "master" in canonical,
            "model_state": None
            if "model_state" not in canonical
            else [
                [p, list(x.shape), jnp.dtype(x.dtype).name]
                for p, x in zip(
                    _leaf_paths(self.engine.abstract_state.model_state),
                    canonical["model_state"].values(),
                    strict=True,
                )
            ],
            "rng": rng_impl,
            "grad_history": None
            if "grad_history" not in canonical
            else list(canonical["grad_history"]["norms"].shape),
            "opt_state": [
                [p, list(x.shape), str(x.dtype)]
                for p, x in zip(opt_paths, canonical["opt_state"].values(), strict=True)
            ],
        }

    def _canonical_shardings(self, abstract: Any) -> Any:
        """Split each canonical array over the data axis where it divides evenly (each process
        then writes and reads only its part), replicate the rest. A parameter-shaped array
        (params, master, the optimizer's moments) keeps its parameter's split over the other
        mesh axes (tensor parallelism) and takes the data axis on its first free dimension:
        moving a model-split weight to a data split of the same dimension would make XLA
        gather the whole weight on every device ("involuntary full rematerialization")."""
        mesh, dp, group = self.engine.mesh, self.engine.dp, self.engine.group
        # the data axis; a hierarchical mesh's two axes together (every data rank)
        axis = group.manual_axes if group.outer_axis else self.engine.config.data_axis

        def spec(x: Any, model: Any = None) -> NamedSharding:
            entries = [None if e == axis else e for e in (model or ())]
            entries += [None] * (x.ndim - len(entries))
            if not any(entries):  # unsplit: the first axis, where it divides
                split = x.ndim >= 1 and x.shape[0] % dp == 0
                return NamedSharding(mesh, P(axis) if split else P())
            free = [d for d, e in enumerate(entries) if e is None and x.shape[d] % dp == 0]
            if free:
                entries[free[0]] = axis
            return NamedSharding(mesh, P(*entries))

        out = jax.tree.map(spec, abstract)
        specs = self.engine.plan.sharding.param_specs()
        if not any(any(sp) for sp in specs):  # a 1-D mesh: nothing is split over other axes
            return out
        for name in ("params", "master"):
            if name in abstract:
                out[name] = {k: spec(x, specs[int(k)]) for k, x in abstract[name].items()}
        # Optimizer-state leaves, by the parameter they belong to (on its own shape).
        shapes = [abstract["params"][_key(i)].shape for i in range(len(specs))]
        key_paths = self._strategy.params_codec.key_paths
        opt_paths = jax.tree_util.tree_flatten_with_path(self._canonical_opt_abstract())[0]
        owner = Owners(key_paths, shapes)
        for j, (path, _) in enumerate(opt_paths):
            x = abstract["opt_state"][_key(j)]
            i = owner(path, x.shape)
            if i is not None:
                out["opt_state"][_key(j)] = spec(x, specs[i])
        return out

    # ------------------------------------------------------------------ save
    def save(self, step: int, state: TrainState) -> None:
        """Start saving ``state`` as checkpoint ``step`` (asynchronous; see
        :meth:`wait_until_finished`). Every process must call it."""
        if not isinstance(state, TrainState):
            raise TypeError(
                f"CheckpointManager.save: state is a {type(state).__name__}; expected the "
                "jaxdp.TrainState returned by engine.init / engine.step."
            )
        if self._to_canonical is None:
            abstract = jax.eval_shape(self._canonical_fn, state)
            self._to_canonical = jax.jit(
                self._canonical_fn, out_shardings=self._canonical_shardings(abstract)
            )
        canonical = self._to_canonical(state)
        opt_paths = _leaf_paths(self._canonical_opt_abstract())
        impl = None if state.rng is None else str(jax.random.key_impl(state.rng))
        meta = self._meta(canonical, opt_paths, impl)
        self._mngr.save(
            int(step),
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(canonical), meta=ocp.args.JsonSave(meta)
            ),
        )

    # ------------------------------------------------------------------ restore
    def restore(self, step: int | None = None) -> TrainState:
        """Load checkpoint ``step`` (default: the latest) into the engine's devices, ZeRO
        stage and bucket layout.

        Raises:
            FileNotFoundError: there is no such checkpoint.
            CheckpointMismatchError: the checkpoint holds another model (names the first
                parameter whose path or shape differs) or another optimizer.
        """
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(
                    f"CheckpointManager.restore: no checkpoint in {self.directory}. Fix: train "
                    "without restoring, or point the manager at the run's checkpoints folder."
                )
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"CheckpointManager.restore: step={step} is not in {self.directory} "
                f"(steps: {steps}). Fix: pass one of those, or step=None for the latest."
            )
        meta = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        where = os.path.join(self.directory, str(step))
        target = self._target(meta, where)
        abstract = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
            target,
            self._canonical_shardings(target),
        )
        loaded = self._mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
        )["state"]
        if self._from_canonical is None:
            shardings = self.engine.state_shardings
            self._from_canonical = jax.jit(
                self._from_canonical_fn,
                out_shardings=(shardings._replace(rng=None), NamedSharding(self.engine.mesh, P())),
            )
        state, key_data = self._from_canonical(loaded)
        if key_data is None:
            return state
        return state._replace(rng=jax.random.wrap_key_data(key_data, impl=meta["rng"]))

    def _target(self, meta: dict[str, Any], where: str) -> dict[str, Any]:
        """The canonical tree this engine expects, checked against the checkpoint's metadata."""
        if meta.get("format") != _FORMAT:
            raise CheckpointMismatchError(
                f"CheckpointManager.restore: {where} has format {meta.get('format')!r}; "
                f"expected {_FORMAT}. Fix: restore it with the jaxdp version that wrote it."
            )
        saved = {p: (tuple(s), d) for p, s, d in meta["params"]}
        full = self._strategy.full_params()
        want = {
            p: (tuple(x.shape), jnp.dtype(x.dtype).name)
            for p, x in zip(self._param_paths(), jax.tree_util.tree_leaves(full), strict=True)
        }
        for p, (shape, _) in want.items():
            if p not in saved:
                raise CheckpointMismatchError(
                    f"CheckpointManager.restore: parameter {p} (shape {shape}) is not in the "
                    f"checkpoint {where}, which holds {sorted(saved)[:6]}... Fix: restore a "
                    "checkpoint of this model, or train from scratch (another --out folder)."
                )
            if saved[p][0] != shape:
                raise CheckpointMismatchError(
                    f"CheckpointManager.restore: parameter {p} has shape {saved[p][0]} in the "
                    f"checkpoint {where} but {shape} in this model. Fix: build the model with the "
                    "configuration the checkpoint was trained with, or train from scratch."
                )
        extra = sorted(set(saved) - set(want))
        if extra:
            raise CheckpointMismatchError(
                f"CheckpointManager.restore: the checkpoint {where} holds parameter {extra[0]} "
                f"(shape {saved[extra[0]][0]}), which this model does not have. Fix: build the "
                "model the checkpoint was trained with, or train from scratch."
            )
        abstract = self._with_extras(jax.eval_shape(self._strategy.init_state, full))
        canonical = jax.eval_shape(self._canonical_fn, abstract)
        self._check_extras(meta, canonical, where)
        opt_paths = _leaf_paths(self._canonical_opt_abstract())
        got = [(p, tuple(s)) for p, s, _ in meta["opt_state"]]
        exp = [(p, tuple(x.shape)) for p, x in zip(opt_paths, canonical["opt_state"].values())]
        if got != exp:
            diff = _first_difference(got, exp)
            raise CheckpointMismatchError(
                f"CheckpointManager.restore: the optimizer state in {where} does not match this "
                f"engine's optimizer (first difference: {diff}). Fix: use the optimizer the "
                "checkpoint was trained with."
            )
        # Read the weights of record exactly as they were written: the params in their saved
        # dtype, the master (if any) in fp32 or wider; Strategy.from_canonical casts them to
        # this engine's dtypes (an fp32 run's params into a bf16 run's master, say).
        dtypes = [jnp.dtype(d) for _, _, d in meta["params"]]
        canonical["params"] = {
            _key(i): jax.ShapeDtypeStruct(canonical["params"][_key(i)].shape, dt)
            for i, dt in enumerate(dtypes)
        }
        if meta["has_master"]:
            canonical["master"] = {
                k: jax.ShapeDtypeStruct(x.shape, jnp.promote_types(x.dtype, jnp.float32))
                for k, x in canonical["params"].items()
            }
        else:
            canonical.pop("master", None)
        # The optimizer state too (Adam's moments at DDPConfig.exp_avg_dtype / exp_avg_sq_dtype
        # when saved): Strategy.from_canonical casts each leaf to this engine's dtype, exactly
        # from bfloat16 to float32, rounded to nearest the other way.
        canonical["opt_state"] = {
            k: _saved_float(x, saved)
            for (k, x), (_, _, saved) in zip(
                canonical["opt_state"].items(), meta["opt_state"], strict=True
            )
        }
        # The gradient-norm history follows the checkpoint (whatever this engine keeps): read
        # as saved, kept where its buckets are this layout's, else started afresh.
        saved_history = meta.get("grad_history")
        canonical.pop("grad_history", None)
        if saved_history is not None:
            canonical["grad_history"] = {
                "norms": jax.ShapeDtypeStruct(tuple(saved_history), jnp.float32),
                "count": jax.ShapeDtypeStruct((), jnp.int32),
            }
        return canonical

    def _check_extras(self, meta: dict[str, Any], canonical: dict[str, Any], where: str) -> None:
        """The checkpoint's model state and key against the engine's (``canonical``)."""
        saved = meta.get("model_state")
        if (saved is None) != ("model_state" not in canonical):
            has = "holds a model_state" if saved is not None else "holds no model_state"
            fix = (
                "dp.init(params, model_state=...) with the model's state (e.g. batch_stats)"
                if saved is not None
                else "init the engine without model_state, or restore a checkpoint of a run "
                "that had one"
            )
            raise CheckpointMismatchError(
                f"CheckpointManager.restore: the checkpoint {where} {has} but the engine was "
                f"initialised {'without' if saved is not None else 'with'} one. Fix: {fix}."
            )
        if saved is not None:
            paths = _leaf_paths(self.engine.abstract_state.model_state)
            want = [
                [p, list(x.shape)]
                for p, x in zip(paths, canonical["model_state"].values(), strict=True)
            ]
            got = [[p, list(sh)] for p, sh, _ in saved]
            if got != want:
                diff = _first_difference(got, want)
                raise CheckpointMismatchError(
                    f"CheckpointManager.restore: the model_state in {where} does not match the "
                    f"engine's (first difference: {diff}). Fix: build the model the checkpoint "
                    "was trained with."
                )
        if (meta.get("rng") is None) != ("rng" not in canonical):
            raise CheckpointMismatchError(
                f"CheckpointManager.restore: the checkpoint {where} "
                f"{'holds a PRNG key' if meta.get('rng') else 'holds no PRNG key'} but the "
                f"engine was initialised {'without' if meta.get('rng') else 'with'} rng=. Fix: "
                "init the engine the way the checkpointed run was (dp.init(params, rng=key) "
                "for a model with dropout), so that the key stream continues or is not invented."
            )

    def _from_canonical_fn(self, c: dict[str, Any]) -> tuple[TrainState, Any]:
        treedef = self.engine.layout.treedef
        params = _from_dict(c["params"], treedef)
        master = _from_dict(c["master"], treedef) if "master" in c else None
        opt_def = jax.tree_util.tree_structure(self._canonical_opt_abstract())
        opt = jax.tree_util.tree_unflatten(opt_def, list(c["opt_state"].values()))
        state = self._strategy.from_canonical(c["step"], params, master, opt)
        if "model_state" in c:
            ms_def = jax.tree_util.tree_structure(self.engine.abstract_state.model_state)
            state = state._replace(model_state=_from_dict(c["model_state"], ms_def))
        want = self.engine.abstract_state.grad_history
        if want is not None:  # another layout's buckets (or none saved): start afresh
            saved: Any = c.get("grad_history")
            history = history0(want[0].shape[0])
            if saved is not None and saved["norms"].shape == want[0].shape:
                history = (saved["norms"], saved["count"])
            state = state._replace(grad_history=history)
        return state, c.get("rng")


def _saved_float(x: Any, saved: str) -> Any:
    """``x`` (abstract) at the floating dtype ``saved`` it was written in; ``x`` itself when
    either is not floating (counts, keys: read as this engine has them)."""
    floating = jnp.issubdtype(x.dtype, jnp.floating)
    if not floating or saved not in ("float64", "float32", "bfloat16", "float16"):
        return x
    return jax.ShapeDtypeStruct(x.shape, jnp.dtype(saved))


def _as_dict(tree: Any) -> dict[str, Any]:
    return {_key(i): x for i, x in enumerate(jax.tree.leaves(tree))}


def _from_dict(d: dict[str, Any], treedef: Any) -> Any:
    return jax.tree_util.tree_unflatten(treedef, [d[k] for k in sorted(d)])
