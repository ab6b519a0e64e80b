"""``memory_report``: a compiled step's per-device memory against the ZeRO formula, and the
weights whose GEMM widths XLA pads.

The numbers are XLA's buffer assignment for the compiled program
(``compiled.memory_analysis()``): nothing runs. The formula is the ZeRO paper's with bf16
params and gradients and Adam's fp32 master, m and v (GUIDE.md section 4); what else a step
holds (activations, in-flight buckets, an fp32 accumulator with micro-batches) is measured
against it in BENCHMARKS.md section 4.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from .. import DataParallel
from .._src.platform.gemm_padding import UnalignedWeight, padding_note, unaligned

__all__ = ["MemoryReport", "memory_report", "zero_formula_bytes"]

_PAD = re.compile(r"= (?:bf16|f16|f32|f64)\[([\d,]+)\]\S* pad\(")


def zero_formula_bytes(stage: int, num_params: int, dp: int) -> float:
    """Bytes per device of the ZeRO paper's formula: bf16 params and gradients (2 + 2 bytes
    per param), Adam's fp32 master, m and v (12 bytes), the latter sharded over ``dp`` ranks
    from stage 1, the gradients from stage 2, the params at stage 3.

    >>> [zero_formula_bytes(s, 8, 8) for s in (0, 1, 2, 3)]
    [128.0, 44.0, 30.0, 16.0]
    """
    psi, n = float(num_params), dp
    return {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[
        stage
    ]


def padded_weights(text: str, weights: tuple[UnalignedWeight, ...]) -> int:
    """How many of ``weights`` the compiled program ``text`` pads: a ``pad`` whose result is
    the weight (or its transpose) widened on one side.

    >>> ws = unaligned([("w", (724, 724), "bfloat16"), ("v", (700, 700), "bfloat16")])
    >>> padded_weights("%p = bf16[768,724]{1,0} pad(%w, %z), padding=0_44x0_0", ws)
    1
    """
    pads = {tuple(int(d) for d in m.split(",")) for m in _PAD.findall(text)}
    pads = {p for p in pads if len(p) == 2}

    def widened(r: int, c: int) -> bool:
        return any(
            (x == r and y > c) or (y == c and x > r) or (x == c and y > r) or (y == r and x > c)
            for x, y in pads
        )

    count = 0
    for u in weights:
        count += widened(u.shape[0], math.prod(u.shape[1:]))  # the Dense view [in, out]
    return count


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory of a compiled step.

    Attributes:
        num_params: Ψ, the model's parameter count.
        dp: data-parallel ranks.
        stage: the ZeRO stage.
        argument_bytes, output_bytes, alias_bytes, temp_bytes: ``memory_analysis()``'s.
        unaligned: the weights with a GEMM width off XLA's grid (64 bf16 elements).
        padded: how many of them XLA padded in this program (``None``: not read).
    """

    num_params: int
    dp: int
    stage: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    unaligned: tuple[UnalignedWeight, ...] = ()
    padded: int | None = None

    @property
    def total_bytes(self) -> int:
        """Argument + output - aliased + temp: the donated state counted once."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def formula_bytes(self) -> float:
        """:func:`zero_formula_bytes` of this stage."""
        return zero_formula_bytes(self.stage, self.num_params, self.dp)

    @property
    def padding(self) -> str:
        """The line on the weights XLA pads ("widths 724 are padded by XLA: +2.1 B/param;
        multiples of 64 avoid it"), or ``""``."""
        return padding_note(self.unaligned, self.num_params, self.padded)

    def lines(self) -> list[str]:
        """The report: bytes per parameter, and the padding line when there is one."""
        psi = max(self.num_params, 1)
        out = [
            f"memory per device: arguments {self.argument_bytes / psi:.2f} B/param, temp "
            f"{self.temp_bytes / psi:.2f}, total {self.total_bytes / psi:.2f} (ZeRO formula, "
            f"stage {self.stage}, N = {self.dp}: {self.formula_bytes / psi:.2f} B/param)"
        ]
        return out + ([self.padding] if self.padding else [])

    def __str__(self) -> str:
        return "\n".join(self.lines())


def memory_report(compiled: Any, dp: DataParallel) -> MemoryReport:
    """The per-device memory of ``compiled`` (``compile_step(dp, ...)``) and the weights of
    ``dp``'s model whose GEMM widths XLA pads.

    XLA:GPU pads a GEMM's contraction width to a multiple of 64 bf16 elements (32 fp32) when
    it splits that GEMM's contraction, which it does for GEMMs with few rows; plain ``jit``
    then keeps a padded copy of each such weight from the forward to the backward pass, and
    jaxdp's stages 0-2 keep it out of the forward (BENCHMARKS.md section 4).

    Example (needs the ``gpu-aot`` extra)::

        compiled = aot.compile_step(dp, params, batch)
        print(aot.memory_report(compiled, dp))
    """
    if not isinstance(dp, DataParallel):
        raise TypeError(
            f"memory_report: dp is a {type(dp).__name__}; expected the jaxdp.DataParallel the "
            "step was compiled from. Fix: memory_report(compile_step(dp, params, batch), dp)."
        )
    layout = dp.layout
    work = [(s.path, s.shape, layout.buckets[s.bucket].dtype) for s in layout.slots]
    weights = unaligned(work)
    ma = compiled.memory_analysis()
    padded = padded_weights(compiled.as_text(), weights) if weights else None
    return MemoryReport(
        num_params=sum(s.size for s in layout.slots),
        dp=dp.dp,
        stage=dp.config.zero_stage,
        argument_bytes=int(ma.argument_size_in_bytes),
        output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes),
        temp_bytes=int(ma.temp_size_in_bytes),
        unaligned=weights,
        padded=padded,
    )
