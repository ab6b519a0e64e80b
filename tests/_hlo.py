"""Reading compiled HLO text in tests, through jaxdp.aot's own parser."""

from __future__ import annotations

from jaxdp.aot._hlo import _computations, _Instr


def written_concatenations(text: str) -> list[_Instr]:
    """The ``concatenate`` instructions of a compiled program that write their result: every one
    but those inside a fused computation whose result (its last instruction) is a reduction
    (the gradient norm's sums over a few gradients at a time, jaxdp._src.comm.nested.square_sums:
    XLA
    fuses the concatenation into the reduction that reads it, which writes a scalar or a row of
    partial sums)."""
    out = []
    for _, _, instrs in _computations(text)[1]:
        if instrs and instrs[-1].opcode == "reduce":
            continue
        out += [i for i in instrs if i.opcode == "concatenate"]
    return out
