"""``schedule_report``: the collectives of a scheduled XLA program and what overlaps them.

An optimized XLA module is *scheduled* (``is_scheduled=true``): the textual order of the
instructions in each computation is the order in which they run on the device's compute stream.
On GPU an asynchronous collective appears as a ``*-start`` / ``*-done`` pair; the compute ops
(fusions, GEMM custom calls, loops) scheduled between the two are what the communication can
overlap with. Zero compute ops between them means exposed communication. A collective without a
``-start``/``-done`` pair is synchronous.

The report is structural: it says what *may* run concurrently, not how long anything takes (that
needs a profile of a real run).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from ._hlo import (
    _CALLS,
    _DTYPE_BYTES,
    _arrays,
    _async_inner_kind,
    _base_kind,
    _computations,
    _Instr,
    _is_gemm,
)
from ._hlo import COLLECTIVE_KINDS as COLLECTIVE_KINDS  # re-export: defined here before the split

__all__ = ["Collective", "ScheduleReport", "schedule_report"]

#: Opcodes counted as compute when they sit between a start and its done.
COMPUTE_OPS = frozenset(
    {"fusion", "custom-call", "dot", "convolution", "while", "conditional", "call"}
)
#: JAX names the ops of a backward pass ``.../transpose(jvp(...))/...``.
_BACKWARD_MARK = "transpose("


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a scheduled program.

    Attributes:
        kind: the collective's opcode without suffix, e.g. ``"reduce-scatter"``.
        name: HLO name of the ``-start`` instruction (async) or of the op (sync).
        computation: name of the computation that holds it (``entry`` tells if it is ENTRY).
        entry: whether that computation is the program's ENTRY (not a loop body).
        is_async: a ``-start``/``-done`` pair (GPU async collective) or a synchronous op.
        dtypes: the dtype(s) on the wire (of the operands), e.g. ``("f32",)``.
        operands: number of arrays moved; more than one means XLA combined several collectives.
        elements: elements of the full buffer (the larger of input and output: a reduce-scatter's
            input, an all-gather's output).
        bytes: bytes of the full buffer.
        in_shapes: the operand shapes, e.g. ``("f32[525312]",)``.
        out_shapes: the result shapes.
        compute_between: compute ops (``COMPUTE_OPS``) scheduled between start and done; 0 for
            a synchronous collective.
        gemms_between: how many of those are GEMMs (GEMM fusions or cuBLAS/cuDNN custom calls).
        backward_between: how many of those come from a backward pass (JAX names them
            ``transpose(jvp(...))`` in the ops' metadata).
        start_index: position of the start (or the op) in its computation's schedule.
        done_index: position of the done (equal to ``start_index`` when synchronous).
        group_size: ranks per replica group (every form XLA prints), or 0 where the op does
            not say (a generic ``async-start``'s wrapped collective).
    """

    kind: str
    name: str
    computation: str
    entry: bool
    is_async: bool
    dtypes: tuple[str, ...]
    operands: int
    elements: int
    bytes: int
    in_shapes: tuple[str, ...]
    out_shapes: tuple[str, ...]
    compute_between: int
    gemms_between: int
    backward_between: int
    start_index: int
    done_index: int
    group_size: int = 0

    @property
    def dtype(self) -> str:
        """The wire dtype(s) as one string, e.g. ``"bf16"`` or ``"bf16,f32"``."""
        return ",".join(self.dtypes)

    @property
    def overlapped(self) -> bool:
        """Whether any compute op is scheduled between its start and its done."""
        return self.compute_between > 0


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """Every collective of a scheduled program, in schedule order per computation.

    Attributes:
        collectives: the collectives, ENTRY first, each computation in schedule order.
        module: the ``HloModule`` name.

    Example:
        >>> text = '''HloModule m, is_scheduled=true
        ... ENTRY %main (p: f32[1024]) -> f32[1024] {
        ...   %p = f32[1024]{0} parameter(0)
        ...   %ars = f32[1024]{0} all-reduce-start(%p), replica_groups={{0,1}}, to_apply=%add
        ...   %f = f32[1024]{0} fusion(%p), kind=kLoop, calls=%fused
        ...   ROOT %ard = f32[1024]{0} all-reduce-done(%ars)
        ... }'''
        >>> r = schedule_report(text)
        >>> c = r.collectives[0]
        >>> c.kind, c.dtype, c.bytes, c.compute_between
        ('all-reduce', 'f32', 4096, 1)
    """

    collectives: tuple[Collective, ...]
    module: str = ""

    def of_kind(self, *kinds: str) -> tuple[Collective, ...]:
        """The collectives whose ``kind`` is one of ``kinds``."""
        return tuple(c for c in self.collectives if c.kind in kinds)

    @property
    def async_collectives(self) -> tuple[Collective, ...]:
        """The ``-start``/``-done`` pairs."""
        return tuple(c for c in self.collectives if c.is_async)

    @property
    def sync_collectives(self) -> tuple[Collective, ...]:
        """The synchronous collectives."""
        return tuple(c for c in self.collectives if not c.is_async)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per collective (for printing, CSV or JSON)."""
        return [
            {
                "kind": c.kind,
                "async": c.is_async,
                "dtype": c.dtype,
                "operands": c.operands,
                "elements": c.elements,
                "bytes": c.bytes,
                "compute_between": c.compute_between,
                "gemms_between": c.gemms_between,
                "backward_between": c.backward_between,
                "computation": "ENTRY" if c.entry else c.computation,
                "name": c.name,
            }
            for c in self.collectives
        ]

    def table(self, title: str | None = None, roles: Sequence[str] | None = None) -> Any:
        """The report as a ``rich.table.Table``; ``roles`` adds a column of labels.

        Columns: wire dtype, arrays moved (``ops`` > 1: combined by XLA), elements and bytes of
        the full buffer, and the compute ops, GEMMs and backward-pass ops scheduled between the
        start and the done ("-" for synchronous collectives).
        """
        from rich.table import Table

        t = Table(title=title or f"collectives of {self.module or 'the program'}")
        for col, just in (
            ("#", "right"),
            ("kind", "left"),
            ("mode", "left"),
            ("dtype", "left"),
            ("ops", "right"),
            ("elements", "right"),
            ("bytes", "right"),
            ("compute", "right"),
            ("GEMMs", "right"),
            ("bwd", "right"),
            ("where", "left"),
        ):
            t.add_column(col, justify=just)  # type: ignore[arg-type]
        if roles is not None:
            t.add_column("role")
        for i, c in enumerate(self.collectives):
            extra = [] if roles is None else [roles[i]]
            t.add_row(
                str(i),
                c.kind,
                "async" if c.is_async else "sync",
                c.dtype,
                str(c.operands),
                f"{c.elements:,}",
                _human_bytes(c.bytes),
                str(c.compute_between) if c.is_async else "-",
                str(c.gemms_between) if c.is_async else "-",
                str(c.backward_between) if c.is_async else "-",
                "ENTRY" if c.entry else c.computation,
                *extra,
            )
        return t

    def __str__(self) -> str:
        head = (
            f"{'#':>3} {'kind':<20} {'mode':<5} {'dtype':<9} {'ops':>3} {'elements':>12} "
            f"{'bytes':>10} {'compute':>7} {'GEMMs':>5} {'bwd':>4}  where"
        )
        lines = [head]
        for i, c in enumerate(self.collectives):
            between = (
                (str(c.compute_between), str(c.gemms_between), str(c.backward_between))
                if c.is_async
                else ("-", "-", "-")
            )
            lines.append(
                f"{i:>3} {c.kind:<20} {'async' if c.is_async else 'sync':<5} {c.dtype:<9} "
                f"{c.operands:>3} {c.elements:>12,} {_human_bytes(c.bytes):>10} "
                f"{between[0]:>7} {between[1]:>5} {between[2]:>4}  "
                f"{'ENTRY' if c.entry else c.computation}"
            )
        return "\n".join(lines)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=|mesh\[[^\]]*\][^{]*\{[^}]*\})")


def replica_group_size(attrs: str) -> int:
    """Ranks per replica group of a collective's HLO attributes: ``{{0,1,..},..}``, the iota
    form ``[groups,size]<=[..]``, or the mesh form ``mesh['a'=4,'b'=2] ... {'a'}`` (the
    product of the named axes); 0 where none is printed."""
    m = _GROUPS.search(attrs)
    if m is None:
        return 0
    g = m.group(1)
    if g.startswith("{{"):
        return len([v for v in g[2:].split("}")[0].split(",") if v])
    if g.startswith("["):
        return int(g[1:].split("]")[0].split(",")[-1])
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", g))
    named = re.findall(r"'(\w+)'", g.rsplit("{", 1)[1])
    return math.prod(int(sizes[a]) for a in named if a in sizes)


def _collective(
    kind: str,
    start: _Instr,
    done: _Instr | None,
    body: Sequence[_Instr],
    shapes: dict[str, str],
    comp: str,
    entry: bool,
    si: int,
    di: int,
) -> Collective:
    ins = [a for op in start.operands for a in _arrays(shapes.get(op, ""))]
    out = _arrays((done or start).shape)
    if not ins:  # operands defined elsewhere: fall back to the start's own shape
        ins = out
    between = [b for b in body[si + 1 : di] if b.opcode in COMPUTE_OPS]
    n_in = sum(e for _, e in ins)
    n_out = sum(e for _, e in out)
    b_in = sum(e * _DTYPE_BYTES[d] for d, e in ins)
    b_out = sum(e * _DTYPE_BYTES[d] for d, e in out)
    in_shapes = tuple(shapes.get(op, "?") for op in start.operands)
    return Collective(
        kind=kind,
        name=start.name,
        computation=comp,
        entry=entry,
        is_async=done is not None,
        dtypes=tuple(sorted({d for d, _ in ins})),
        operands=len(ins),
        elements=max(n_in, n_out),
        bytes=max(b_in, b_out),
        in_shapes=in_shapes,
        out_shapes=((done or start).shape,),
        compute_between=len(between),
        gemms_between=sum(_is_gemm(b) for b in between),
        backward_between=sum(_BACKWARD_MARK in b.op_name for b in between),
        start_index=si,
        done_index=di,
        group_size=replica_group_size(start.attrs),
    )


def schedule_report(compiled: str | Any) -> ScheduleReport:
    """Parse a scheduled (compiled) XLA program and report its collectives.

    For every asynchronous collective (a ``*-start``/``*-done`` pair, or a generic
    ``async-start`` wrapping a collective) the report gives its kind, wire dtype, size and the
    number of compute ops (fusions, GEMM custom calls, loops, calls) scheduled between the start
    and the done; synchronous collectives are listed too, with nothing between.

    Args:
        compiled: the text of a compiled executable, ``jitted.lower(...).compile().as_text()``,
            or the ``Compiled`` object itself.

    Returns:
        A :class:`ScheduleReport`.

    Raises:
        ValueError: ``compiled`` is not the text of a scheduled HLO module (e.g. it is the
            StableHLO of ``lower(...).as_text()``).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from jax.sharding import PartitionSpec as P
        >>> from jaxdp import make_mesh
        >>> mesh = make_mesh()
        >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x * 2, "data"), mesh=mesh,
        ...                           in_specs=P("data"), out_specs=P()))
        >>> r = schedule_report(f.lower(jnp.ones(8 * jax.device_count())).compile())
        >>> [(c.kind, c.dtype, c.elements) for c in r.collectives]  # CPU: synchronous
        [('all-reduce', 'f32', 8)]
    """
    text = compiled.as_text() if hasattr(compiled, "as_text") else compiled
    if not isinstance(text, str):
        raise TypeError(
            f"schedule_report: compiled is a {type(compiled).__name__}; expected the str of "
            "jitted.lower(...).compile().as_text() or the Compiled object. Fix: pass "
            "lowered.compile()."
        )
    head = text.lstrip()[:200]
    if not head.startswith("HloModule"):
        what = "StableHLO (lower(...).as_text())" if "module @" in head else repr(head[:40])
        raise ValueError(
            f"schedule_report: compiled starts with {what}; expected the text of a compiled, "
            "scheduled XLA program ('HloModule ..., is_scheduled=true'). Fix: pass "
            "jitted.lower(...).compile().as_text()."
        )
    if "is_scheduled=true" not in text.splitlines()[0]:
        raise ValueError(
            "schedule_report: the HLO module is not scheduled (no is_scheduled=true in its "
            "header), so its instruction order says nothing about overlap. Fix: pass the text of "
            "lower(...).compile(), not an unoptimized HLO dump."
        )
    module, comps = _computations(text)
    by_name = {name: body for name, _, body in comps}
    out: list[Collective] = []
    # The bodies of generic async ops are reported at their async-start, not on their own.
    wrapped = {
        m.group(1)
        for _, _, body in comps
        for i in body
        if i.opcode == "async-start" and (m := _CALLS.search(i.attrs))
    }
    order = sorted(comps, key=lambda c: not c[1])  # ENTRY first
    for comp, entry, body in order:
        if comp in wrapped:
            continue
        shapes = {i.name: i.shape for i in body}
        dones = {}
        for k, ins in enumerate(body):
            if ins.opcode.endswith("-done") and ins.operands:
                dones[ins.operands[0]] = k
        for k, ins in enumerate(body):
            kind, suffix = _base_kind(ins.opcode)
            if kind is None and ins.opcode == "async-start":
                kind, suffix = _async_inner_kind(ins, by_name), "-start"
            if kind is None or suffix in ("-done", "-update"):
                continue
            di = dones.get(ins.name) if suffix == "-start" else None
            if di is None:  # synchronous, or a done in another computation: no overlap claim
                out.append(_collective(kind, ins, None, body, shapes, comp, entry, k, k))
            else:
                out.append(_collective(kind, ins, body[di], body, shapes, comp, entry, k, di))
    return ScheduleReport(collectives=tuple(out), module=module)
