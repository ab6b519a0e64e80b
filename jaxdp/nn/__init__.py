"""Layers whose weight gradients can be fused into jaxdp's fp32 accumulator.

``Dense`` and ``DenseGeneral`` (flax linen) and ``Linear`` (flax nnx) are drop-ins for flax's
layers. With ``DDPConfig(gradient_accumulation_fusion=True)`` the engine differentiates their
kernels as fp32 and they compute the weight gradient as ``dot(x, dy, preferred_element_type=
float32)`` from bf16 operands, straight into the fp32 accumulator; otherwise they are flax's
layers. See :mod:`jaxdp._src.core.fusion` for the mechanism.
"""

from .._src.core.fusion import fused_matmul as fused_matmul
from .._src.core.fusion import fused_value_and_grad as fused_value_and_grad
from .._src.core.fusion import fusion_dtype as fusion_dtype
from ._dense import Dense as Dense
from ._dense import DenseGeneral as DenseGeneral
from ._dense import Linear as Linear

__all__ = [
    "Dense",
    "DenseGeneral",
    "Linear",
    "fused_matmul",
    "fused_value_and_grad",
    "fusion_dtype",
]
