"""Reading compiled HLO text in tests."""

from __future__ import annotations

import re


def _computations(text: str) -> list[str]:
    return re.split(r"\n(?=%?\S+ \(.*\) -> )", text)


def written_concatenations(text: str) -> list[str]:
    """The ``concatenate`` instructions of a compiled program that write their result: every one
    but those inside a fused computation whose result is a reduction (the gradient norm's sums
    over a few gradients at a time, jaxdp._nested.square_sums: XLA fuses the concatenation into
    the reduction that reads it, which writes a scalar or a row of partial sums)."""
    out = []
    for comp in _computations(text):
        if "concatenate(" not in comp:
            continue
        if re.search(r"ROOT \S+ = \w+\[\d*\]\S* reduce\(", comp):
            continue
        out += [line.strip() for line in comp.split("\n") if " concatenate(" in line]
    return out
