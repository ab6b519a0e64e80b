"""Parsing of the text of a scheduled XLA (HLO) program, for :mod:`jaxdp.aot._report`.

Splits the text of a compiled module into computations and their instructions (name, result
shape, opcode, operands, attributes) in schedule order, reads the dtype and element count of
every array in a shape, and classifies instructions: collectives (a ``-start``/``-done`` pair, a
synchronous op, or a generic ``async-start`` that wraps one) and GEMMs (``dot``, convolutions,
cuBLAS/cuDNN custom calls and GEMM fusions).
"""

from __future__ import annotations

import dataclasses
import math
import re

#: Collective opcodes (as they appear in HLO, before any ``-start``/``-done`` suffix).
COLLECTIVE_KINDS = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_GEMM_MARKERS = ("gemm", "matmul", "cublas", "cudnn$conv", "__cudnn")
_DTYPE_BYTES = {
    **dict.fromkeys(("pred", "s4", "u4", "s8", "u8", "f4e2m1fn", "f8e8m0fnu"), 1),
    **dict.fromkeys(("f8e4m3fn", "f8e5m2", "f8e4m3", "f8e4m3fnuz", "f8e5m2fnuz", "f8e3m4"), 1),
    **dict.fromkeys(("bf16", "f16", "s16", "u16"), 2),
    **dict.fromkeys(("f32", "s32", "u32"), 4),
    **dict.fromkeys(("f64", "s64", "u64", "c64"), 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.attrs)
        return m.group(1) if m else ""


def _arrays(shape: str) -> list[tuple[str, int]]:
    """``(dtype, elements)`` of every array in an HLO shape string (tuples flattened)."""
    return [
        (dt, math.prod(int(d) for d in dims.split(",") if d) if dims else 1)
        for dt, dims in _ARRAY.findall(shape)
        if dt in _DTYPE_BYTES
    ]


def _split_shape(rest: str) -> tuple[str, str]:
    """Split ``"<shape> <opcode>(...)..."`` into the shape and the remainder."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :]
    return rest, ""


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.groups()
    shape, tail = _split_shape(rest.strip())
    om = _OPCODE.match(tail)
    if not om:
        return None
    opcode = om.group(1)
    depth, i = 1, om.end()
    while i < len(tail) and depth:
        depth += tail[i] == "("
        depth -= tail[i] == ")"
        i += 1
    args = tail[om.end() : i - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return _Instr(name, shape, opcode, operands, tail[i:])


def _computations(text: str) -> tuple[str, list[tuple[str, bool, list[_Instr]]]]:
    module = ""
    comps: list[tuple[str, bool, list[_Instr]]] = []
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if line.startswith("HloModule"):
            module = line.split()[1].rstrip(",")
            continue
        if current is None:
            h = _HEADER.match(line)
            if h and not line.startswith(" "):
                current = []
                comps.append((h.group(2), bool(h.group(1)), current))
            continue
        if line.startswith("}"):
            current = None
            continue
        ins = _parse_instr(line)
        if ins is not None:
            current.append(ins)
    return module, comps


def _base_kind(opcode: str) -> tuple[str | None, str]:
    for suffix in ("-start", "-done", "-update"):
        if opcode.endswith(suffix):
            base = opcode[: -len(suffix)]
            if base in COLLECTIVE_KINDS:
                return base, suffix
    if opcode in COLLECTIVE_KINDS:
        return opcode, ""
    return None, ""


def _is_gemm(ins: _Instr) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode == "custom-call":
        m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        return m is not None and any(k in m.group(1).lower() for k in _GEMM_MARKERS)
    if ins.opcode == "fusion" and "kind=kCustom" in ins.attrs:
        cfg = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', ins.attrs)
        kind = cfg.group(1).lower() if cfg else ins.name.lower()
        return any(k in kind for k in _GEMM_MARKERS)
    return False


def _async_inner_kind(ins: _Instr, comps: dict[str, list[_Instr]]) -> str | None:
    """Kind of the collective wrapped by a generic ``async-start`` (``calls=``), if any."""
    m = _CALLS.search(ins.attrs)
    if not m or m.group(1) not in comps:
        return None
    for inner in comps[m.group(1)]:
        kind, _ = _base_kind(inner.opcode)
        if kind:
            return kind
    return None
