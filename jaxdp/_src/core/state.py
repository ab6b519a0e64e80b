"""``TrainState``: the pytree a :class:`jaxdp.DataParallel` step takes and returns."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

__all__ = ["TrainState"]


class TrainState(NamedTuple):
    """The training state, a pytree of globally sharded arrays.

    What ``params`` and ``master`` look like is the engine's ZeRO strategy's choice
    (:attr:`jaxdp.DataParallel.plan`; docs/how-a-step-works.md):

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
            per scan iteration. On a mesh with tensor-parallel axes a parameter split over
            them is viewed as ``[blocks, padded block]``, sharded ``P(model axes, data_axis)``.
            Always the cast of ``master`` to the working dtype.
        master: fp32 master weights. ``None`` at stage 0 when the params are already fp32;
            replicated params-shaped tree at stage 0; at stages >= 1 the layout's sharded view
            (interleaved: each parameter flattened and zero-padded to a multiple of dp,
            sharded over the data axis).
        opt_state: the optax state of ``master`` (or of ``params`` when ``master`` is None),
            sharded like it.
        model_state: the non-trainable state given to ``DataParallel.init(params,
            model_state=...)`` (linen's ``batch_stats`` and other mutable collections, nnx's
            ``BatchStat`` and other non-``Param`` state), replicated, as of the end of the last
            step (combined over the ranks by the config's ``model_state_sync``); ``None`` when
            ``init`` got none.
        rng: the run's typed PRNG key given to ``init(params, rng=...)``, or ``None``. It does
            not change: step ``s`` draws from ``fold_in(rng, s)``, so a restored state continues
            the same key stream.
        grad_history: with ``check_for_large_grads``, ``(float32[buckets, 100], int32 count)``:
            the last 100 gradient norms of each bucket (``jaxdp._src.strategy.spikes``),
            replicated and checkpointed; ``None`` otherwise.
    """

    step: jax.Array
    params: Any
    master: Any
    opt_state: Any
    model_state: Any = None
    rng: Any = None
    grad_history: Any = None
