"""Model FLOPs utilisation of the main job: the GPT's training FLOPs per token and the peak
dense bf16 throughput of the device it runs on."""

from __future__ import annotations

from ..models.gpt import GPTConfig

__all__ = ["PEAK_BF16_TFLOPS", "mfu", "peak_tflops", "train_flops_per_token"]

#: Dense bf16 tensor-core peak (TFLOP/s, no sparsity) by device kind, from the vendors' data
#: sheets; matched, in lower case, as a substring of ``jax.Device.device_kind`` lower-cased
#: (longest name first).
PEAK_BF16_TFLOPS: dict[str, float] = {
    "gh200": 989.0,
    "h200": 989.0,
    "h100 pcie": 756.0,
    "h100": 989.0,
    "b200": 2250.0,
    "a100": 312.0,
    "l40s": 362.0,
    "a10g": 70.0,
    "l4": 121.0,
}


def peak_tflops(device_kind: str) -> float | None:
    """The dense bf16 peak of ``device_kind`` (e.g. ``"NVIDIA A100-SXM4-80GB"``), or ``None``
    for a device not in :data:`PEAK_BF16_TFLOPS` (CPUs).

    Example:
        >>> peak_tflops("NVIDIA A100-SXM4-80GB"), peak_tflops("cpu")
        (312.0, None)
    """
    kind = device_kind.lower()
    for name in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if name in kind:
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
