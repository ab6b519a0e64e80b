"""What a step does around its collectives, decided by the plan: the typed values the
strategy, its kernel and the per-device body are built from (the collectives' own spec is
:class:`jaxdp._src.comm.wire.Wire`)."""

from __future__ import annotations

import dataclasses

__all__ = ["StepSpec"]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """The step's settings below the plan.

    Attributes:
        num_microbatches: ``G``, micro-batches accumulated per step.
        param_dtype: the params' working dtype (``None``: their own).
        clip_grad: the global-norm clip (``None``: off).
        model_state_sync: how ranks' model states combine: ``"mean"`` or ``"broadcast"``.
        fusion: gradient-accumulation fusion of :mod:`jaxdp.nn` layers.
        grad_norm_skip_threshold: skip the update above this global norm or a non-finite one
            (:mod:`jaxdp._src.strategy.spikes`; ``None``: off).
        check_for_large_grads: skip the update when a bucket's norm jumps (same module).
        fence_backward: differentiate the loss under
            :func:`jaxdp._src.platform.gemm_padding.backward_fence` (stages 0-2 with a weight
            whose GEMM widths XLA may pad): the same values, but XLA cannot build the backward
            pass's padded weight copies in the forward pass and keep them alive in between.

    Example:
        >>> StepSpec(num_microbatches=4).num_microbatches
        4
    """

    num_microbatches: int = 1
    param_dtype: str | None = None
    clip_grad: float | None = None
    model_state_sync: str = "mean"
    fusion: bool = False
    grad_norm_skip_threshold: float | None = None
    check_for_large_grads: bool = False
    fence_backward: bool = False

    @property
    def checks_spikes(self) -> bool:
        """Whether the step may skip its update for an abnormal gradient."""
        return self.grad_norm_skip_threshold is not None or self.check_for_large_grads
