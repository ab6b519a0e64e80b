"""A single-device reference of :class:`jaxdp.DataParallel`'s step, for numerical tests.

:class:`Reference` runs the computation the engine distributes, on one device, with no
buckets, shards or collectives: the global batch is cut into ``dp`` rank slices and each into
``G`` micro-batches exactly as the engine cuts it; each rank's micro-batches run in order
(``loss_fn`` gets the same ``model_state`` and the same keys the engine hands that rank), the
ranks run side by side under ``jax.vmap`` with the data axis bound (so
``nn.BatchNorm(axis_name="data")`` synchronises as in the engine); the gradient is the fp32
mean over ranks and micro-batches (or over tokens), clipped by the global norm, and applied by
the same optax optimizer to fp32 master weights. The model state is combined over the ranks
as ``DDPConfig.model_state_sync`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .. import DDPConfig
from .._src.core.loss import LossCall, check_init_inputs, loss_parts

__all__ = ["Reference", "ReferenceState"]


class ReferenceState(NamedTuple):
    """The reference's training state (plain, unsharded pytrees).

    Attributes:
        step: completed steps (a Python int).
        master: the fp32 master params (float64 where the params are float64).
        opt_state: the optax state of ``master``.
        model_state: the model state, or ``None``.
        rng: the run's typed key, or ``None``.
        dtypes: the dtype of each param leaf as given to ``init`` (a pytree like ``master``).
    """

    step: int
    master: Any
    opt_state: Any
    model_state: Any
    rng: Any
    dtypes: Any


class Reference:
    """``DataParallel``'s step on one device (module docstring), for ``dp`` simulated ranks.

    Args:
        loss_fn, optimizer, config: as given to :class:`jaxdp.DataParallel`. Only
            ``num_microbatches``, ``param_dtype``, ``clip_grad``, ``calculate_per_token_loss``,
            ``model_state_sync`` and ``data_axis`` matter: the reference has no buckets.
        dp: the number of data-parallel ranks to simulate (the engine's ``dp``).

    Example:
        >>> import jax, jax.numpy as jnp, optax
        >>> from jaxdp import DDPConfig
        >>> from jaxdp.testing import Reference
        >>> def loss_fn(p, b):
        ...     return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
        >>> ref = Reference(loss_fn, optax.sgd(0.1), DDPConfig(num_microbatches=2), dp=4)
        >>> state = ref.init({"w": jnp.zeros((3, 1))})
        >>> batch = {"x": jnp.ones((16, 3)), "y": jnp.ones((16, 1))}
        >>> state, metrics = ref.step(state, batch)
        >>> round(float(metrics["loss"]), 3), metrics["grads"]["w"].shape
        (1.0, (3, 1))
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        config: DDPConfig,
        *,
        dp: int,
    ):
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(
                f"Reference: dp={dp!r}; expected a positive int, the engine's number of "
                "data-parallel ranks. Fix: Reference(..., dp=engine.dp)."
            )
        self.loss_fn, self.optimizer, self.config, self.dp = loss_fn, optimizer, config, dp
        self._call = LossCall()
        self._step = jax.jit(self._step_fn, static_argnums=6)

    def init(self, params: Any, *, model_state: Any = None, rng: Any = None) -> ReferenceState:
        """The reference state for ``params`` (and, as for ``DataParallel.init``, the
        ``model_state`` and ``rng`` that decide which keywords ``loss_fn`` gets)."""
        model_state, rng, self._call = check_init_inputs(model_state, rng)
        self._step = jax.jit(self._step_fn, static_argnums=6)  # the call is static: trace again
        wide = any(jnp.result_type(x) == jnp.float64 for x in jax.tree.leaves(params))
        master_dt = jnp.float64 if wide else jnp.float32
        master = jax.tree.map(lambda x: jnp.asarray(x, master_dt), params)
        dtypes = jax.tree.map(lambda x: jnp.result_type(x), params)
        return ReferenceState(0, master, self.optimizer.init(master), model_state, rng, dtypes)

    def restart(self, state: ReferenceState, engine: Any, engine_state: Any) -> ReferenceState:
        """``state`` continued from the engine's params, model state and step count (its own
        optimizer state and key are kept): the next :meth:`step` computes the gradient at the
        engine's own params, so each step's comparison measures that step's error alone.

        Over several steps the two trajectories part by rounding, which is harmless for a
        smooth model but not for one with kinks (ReLU, max-pooling, clipping): a
        pre-activation within rounding of a kink lands on different sides, and the two
        gradients differ by that example's whole contribution. Restarting before each step
        keeps the comparison at one point (``assert_matches_reference(..., batch=batch)``
        does this for the gradient).

        Example:
            >>> import jax.numpy as jnp, optax
            >>> from jaxdp import DataParallel, DDPConfig
            >>> from jaxdp.testing import Reference
            >>> def loss_fn(p, b):
            ...     return jnp.mean(jnp.maximum(b["x"] @ p["w"], 0.0))
            >>> dp = DataParallel(loss_fn, optax.sgd(0.1), DDPConfig())
            >>> ref = Reference(loss_fn, optax.sgd(0.1), DDPConfig(), dp=dp.dp)
            >>> state = dp.init({"w": jnp.ones((2, 1))})
            >>> ref_state = ref.restart(ref.init({"w": jnp.zeros((2, 1))}), dp, state)
            >>> ref.params(ref_state)["w"].ravel().tolist(), ref_state.step
            ([1.0, 1.0], 0)
        """
        step = int(jax.device_get(engine_state.step))
        # copies on this host: the engine's arrays live on its mesh (and may be donated)
        params = jax.device_get(engine.params(engine_state))
        master = jax.tree.map(lambda p, m: jnp.asarray(p, m.dtype), params, state.master)
        ms = engine.model_state(engine_state)
        if ms is not None:
            ms = jax.tree.map(jnp.asarray, jax.device_get(ms))
        return state._replace(step=step, master=master, model_state=ms)

    def params(self, state: ReferenceState) -> Any:
        """The params in the dtypes ``init`` got (as ``DataParallel.params``)."""
        return jax.tree.map(lambda m, d: m.astype(d), state.master, state.dtypes)

    def step(self, state: ReferenceState, batch: Any) -> tuple[ReferenceState, dict[str, Any]]:
        """One step on the global ``batch``. ``metrics`` has the engine's ``loss``,
        ``grad_norm`` (and ``aux``, ``num_tokens``), plus ``grads``: the reduced fp32 gradient
        the optimizer got (before clipping), shaped like the params."""
        n = {x.shape[0] for x in jax.tree.leaves(batch)}
        div = self.dp * self.config.num_microbatches
        if len(n) != 1 or n.pop() % div:
            raise ValueError(
                "Reference.step: every batch leaf must lead with one global batch size, a "
                f"multiple of dp x num_microbatches = {div}."
            )
        master, opt, ms, metrics = self._step(
            state.master,
            state.opt_state,
            state.model_state,
            state.rng,
            state.step,
            batch,
            tuple(jnp.dtype(d).name for d in jax.tree.leaves(state.dtypes)),
        )
        new = ReferenceState(state.step + 1, master, opt, ms, state.rng, state.dtypes)
        return new, metrics

    def _step_fn(
        self, master: Any, opt: Any, ms: Any, rng: Any, step: Any, batch: Any, dtypes: Any
    ) -> Any:
        cfg, dp, call = self.config, self.dp, self._call
        g = cfg.num_microbatches
        leaves, treedef = jax.tree.flatten(master)
        work = jax.tree.unflatten(
            treedef,
            [m.astype(cfg.param_dtype or d) for m, d in zip(leaves, dtypes, strict=True)],
        )
        # [dp, G, per micro-batch, ...]: rank r holds slice r, micro-batch m its m-th part
        ranks = jax.tree.map(
            lambda x: x.reshape(dp, g, x.shape[0] // (dp * g), *x.shape[1:]), batch
        )
        key = jax.random.fold_in(rng, step) if call.rng else None

        def parts(p: Any, mb: Any) -> Any:
            return loss_parts(self.loss_fn, cfg.calculate_per_token_loss, p, mb, call)

        grad_fn = jax.value_and_grad(parts, has_aux=True)

        def rank(r: Any, rb: Any, state: Any) -> Any:
            total, loss, ntok, aux_sum = None, 0.0, 0.0, None
            for m in range(g):  # in order, as the engine's micro-batch loop
                mb = jax.tree.map(lambda x, m=m: x[m], rb)
                k = None if key is None else jax.random.fold_in(key, r * g + m)
                (lval, (nt, aux, new)), grads = grad_fn(work, call.bind(mb, state, k))
                grads = jax.tree.map(lambda x: x.astype(jnp.float32), grads)
                total = grads if total is None else jax.tree.map(jnp.add, total, grads)
                loss, ntok = loss + lval.astype(jnp.float32), ntok + nt
                if aux is not None:
                    aux = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), aux)
                    aux_sum = aux if aux_sum is None else jax.tree.map(jnp.add, aux_sum, aux)
                state = new if call.model_state else state
            return total, loss, ntok, aux_sum, state

        # the state is an argument (not a closure) so that nnx Variables are made in here
        if isinstance(cfg.data_axis, tuple):  # two levels: ranks as [instances, per instance]
            n = max(cfg.num_distributed_optimizer_instances, 1)
            if dp % n:
                raise ValueError(
                    f"Reference: data_axis={cfg.data_axis} with dp={dp} and "
                    f"num_distributed_optimizer_instances={n}; expected a divisor of dp. Fix: "
                    "set num_distributed_optimizer_instances to the mesh's outer size."
                )
            outer, inner = cfg.data_axis
            nested = jax.vmap(
                jax.vmap(rank, in_axes=(0, 0, None), axis_name=inner),
                in_axes=(0, 0, None),
                axis_name=outer,
            )
            split = jax.tree.map(lambda x: x.reshape(n, dp // n, *x.shape[1:]), ranks)
            per_rank = nested(jnp.arange(dp).reshape(n, dp // n), split, ms)
            per_rank = jax.tree.map(lambda x: x.reshape(dp, *x.shape[2:]), per_rank)
        else:
            per_rank = jax.vmap(rank, in_axes=(0, 0, None), axis_name=cfg.data_axis)(
                jnp.arange(dp), ranks, ms
            )
        total, loss, ntok, aux_sum, states = per_rank
        grads = jax.tree.map(lambda x: jnp.sum(x, 0), total)
        metrics: dict[str, Any] = {}
        if cfg.calculate_per_token_loss:
            tokens = jnp.sum(ntok)
            inv = 1.0 / jnp.maximum(tokens, 1.0)
            grads = jax.tree.map(lambda x: x * inv, grads)
            metrics["loss"], metrics["num_tokens"] = jnp.sum(loss) * inv, tokens
        else:
            grads = jax.tree.map(lambda x: x / (dp * g), grads)
            metrics["loss"] = jnp.sum(loss) / (dp * g)
        if aux_sum is not None:
            metrics["aux"] = jax.tree.map(lambda a: jnp.sum(a, 0) / (dp * g), aux_sum)
        norm = optax.tree.norm(grads)
        metrics["grad_norm"], metrics["grads"] = norm, grads
        upd = jax.tree.map(lambda x, t: x.astype(t.dtype), grads, master)
        if cfg.clip_grad is not None:
            coef = jnp.minimum(1.0, cfg.clip_grad / (norm + 1e-6))
            upd = jax.tree.map(lambda x: x * coef.astype(x.dtype), upd)
        updates, opt = self.optimizer.update(upd, opt, master)
        master = optax.apply_updates(master, updates)
        return master, opt, _combine(states, cfg), metrics


def _combine(states: Any, config: DDPConfig) -> Any:
    """The ranks' model states (stacked on axis 0) combined as the engine combines them."""
    if states is None:
        return None

    def one(x: jax.Array) -> jax.Array:
        if config.model_state_sync == "mean" and jnp.issubdtype(x.dtype, jnp.inexact):
            return jnp.mean(x.astype(jnp.float32), 0).astype(x.dtype)
        return x[0]

    return jax.tree.map(one, states)
