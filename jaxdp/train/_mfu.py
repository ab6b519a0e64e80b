"""Model FLOPs utilisation of the main job: the GPT's training FLOPs per token and the peak
dense bf16 throughput of the device it runs on."""

from __future__ import annotations

from ..models.gpt import GPTConfig

__all__ = ["PEAK_BF16_TFLOPS", "mfu", "peak_tflops", "train_flops_per_token"]

#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device kind, from the vendors' data
#: sheets; matched as a substring of ``jax.Device.device_kind`` (longest name first).
PEAK_BF16_TFLOPS: dict[str, float] = {
    "GH200": 989.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of ``device_kind`` (e.g. ``"NVIDIA H100 80GB HBM3"``), or ``None``
    for a device not in :data:`PEAK_BF16_TFLOPS` (CPUs).

    Example:
        >>> peak_tflops("NVIDIA H100 80GB HBM3"), peak_tflops("cpu")
        (989.0, None)
    """
    for name in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if name in device_kind:
            return PEAK_BF16_TFLOPS[name]
    return None


def train_flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """Forward + backward FLOPs per token: ``6 N`` for the weights plus ``12 L T d`` for the
    attention scores and context (the PaLM / MaxText convention, counting the full ``T x T``
    attention even though it is causal).

    Example:
        >>> train_flops_per_token(GPTConfig(layers=2, width=64, heads=2, context=32), 1000)
        55152.0
    """
    return 6.0 * n_params + 12.0 * cfg.layers * cfg.context * cfg.width


def mfu(
    tokens_per_s: float, flops_per_token: float, devices: int, device_kind: str
) -> float | None:
    """``tokens/s x FLOPs/token / (devices x peak)``, or ``None`` where the peak is unknown."""
    peak = peak_tflops(device_kind)
    if peak is None or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (devices * peak * 1e12)
