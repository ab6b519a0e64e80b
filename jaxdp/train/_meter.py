"""How much of a step's communication the device waits for: the exposed-communication meter.

XLA's latency-hiding scheduler is meant to run each bucket's collective while the backward pass
computes; whether it did is a question about time, not about the program. This module answers it
from a ``jax.profiler`` trace (the ``*.trace.json.gz`` that ``jax.profiler.stop_trace`` writes,
Chrome's trace-event format), per step and per device:

- **compute**: the union of the device's compute intervals (everything that is not a
  collective: kernels, fusions, copies);
- **collective**: the union of its collective intervals;
- **exposed**: the part of the collective union that no compute interval covers: the time the
  device spends only communicating. ``overlapped = 1 - exposed / collective`` (1 when there is
  no collective: nothing is exposed);
- **host gap**: the part of the step's window where the device does nothing at all (waiting
  for the host to launch work: what a pipelined loop on one device loses);
- **wall**: the step's window on the device.

Pure Python (``json`` and ``gzip``): it reads traces from any machine, with or without jax.

Which events are the device's
    A trace with device processes (``/device:GPU:0``...: XLA:GPU) uses their stream threads
    (``Stream #N(...)``: the kernels, copies and memsets CUPTI recorded; the ``XLA Ops`` thread
    where a device has no streams); every such process is one device. A trace without them (XLA:CPU)
    uses the host events that carry an ``hlo_op`` argument, the op thunks the CPU runtime
    records, one device per ``device_ordinal``. Events nested on one thread (a ``while`` thunk
    around its body's ops) count only for their own time outside their children, so a loop
    around a collective does not cover it.

Which events are collectives (:func:`is_collective`)
    An event whose name or ``hlo_op`` argument, lower-cased and without ``-`` and ``_``,
    contains ``nccl`` (NCCL's kernels: ``ncclDevKernel_*``, ``ncclKernel_*``) or one of
    ``allreduce``, ``reducescatter``, ``allgather``, ``alltoall``, ``collectivepermute``,
    ``collectivebroadcast`` (XLA's collective ops and their ``-start``/``-done`` halves), or is
    an HLO ``send``/``recv``. Everything else on a device is compute.

Which events are a step's
    Steps are marked on the host with ``jax.profiler.StepTraceAnnotation(name, step_num=i)``.
    On each device the step's program (the XLA module with the most device time in the trace,
    or the one named by ``module``) runs once per step; one run of it is found from the
    events' ``run_id`` (XLA:CPU) or, where there is none (XLA:GPU), from the program's first
    op, which starts every run. Runs are matched to the steps in order: step ``k`` is the first
    unmatched run that starts after its annotation does. Step ``k``'s window on a device runs
    from the end of run ``k - 1`` to the end of run ``k`` (the first step's from its own start),
    so a device idling between steps counts as the next step's host gap. Every event on the
    device, of any program, is cut to the windows. Without annotations every run is a step.

The figures are per device and averaged over the devices that ran the step. A trace that
starts while the device still runs steps launched before it can match a step to an earlier
run: block on the state before ``jax.profiler.start_trace`` (``jaxdp-train --profile`` does).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import itertools
import json
import os
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = [
    "MeterSummary",
    "StepMeter",
    "exposed_communication",
    "find_trace",
    "is_collective",
    "meter_json",
    "meter_line",
    "meter_markdown",
    "summarize",
]

Interval = tuple[float, float]

_COLLECTIVE_WORDS = (
    "nccl",
    "allreduce",
    "reducescatter",
    "allgather",
    "alltoall",
    "collectivepermute",
    "collectivebroadcast",
)
_SEND_RECV = re.compile(r"^(send|recv)(-done)?(\.\d+)?$")


def is_collective(name: str, hlo_op: str | None = None) -> bool:
    """Whether a device event is communication, from its name and its ``hlo_op`` argument.

    >>> is_collective("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
    True
    >>> is_collective("reduce_scatter.15"), is_collective("all-gather-start.2")
    (True, True)
    >>> is_collective("loop_add_fusion", hlo_op="fusion.3")
    False
    >>> is_collective("void cutlass::Kernel2<...>", hlo_op="all-reduce-start.1")
    True
    """
    for text in (name, hlo_op):
        if not text:
            continue
        low = text.lower()
        squashed = low.replace("-", "").replace("_", "")
        if any(w in squashed for w in _COLLECTIVE_WORDS) or _SEND_RECV.match(low):
            return True
    return False


# ------------------------------------------------------------------ intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: list[Interval] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(disjoint: Sequence[Interval]) -> float:
    return sum(e - s for s, e in disjoint)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(disjoint: Sequence[Interval], lo: float, hi: float) -> list[Interval]:
    return intersect(disjoint, [(lo, hi)]) if hi > lo else []


# ------------------------------------------------------------------ the trace


@dataclasses.dataclass(frozen=True)
class _Op:
    """One device event: where it ran, when (microseconds), what it is."""

    device: str
    thread: Any
    start: float
    end: float
    collective: bool
    module: str | None
    op: str | None
    run: str | None


@dataclasses.dataclass(frozen=True)
class _Mark:
    step: int | None
    start: float
    end: float


def find_trace(path: str) -> str:
    """The newest ``*.trace.json.gz`` (or ``*.trace.json``) at or under ``path``.

    ``path`` may be the file itself, the ``--logdir`` given to ``jax.profiler.start_trace``
    (which writes ``plugins/profile/<run>/<host>.trace.json.gz``) or any folder above it.
    """
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"exposed_communication: {path!r} is neither a trace file nor a folder. Fix: pass "
            "the folder given to jax.profiler.start_trace or its *.trace.json.gz."
        )
    found = [
        p
        for pattern in ("*.trace.json.gz", "*.trace.json")
        for p in glob.glob(os.path.join(path, "**", pattern), recursive=True)
    ]
    if not found:
        raise FileNotFoundError(
            f"exposed_communication: no *.trace.json.gz under {path!r}. Fix: pass the folder "
            "given to jax.profiler.start_trace after jax.profiler.stop_trace has returned."
        )
    return max(found, key=os.path.getmtime)


def _load(path: str) -> list[dict[str, Any]]:
    opener: Any = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def _names(events: list[dict[str, Any]]) -> tuple[dict[Any, str], dict[tuple[Any, Any], str]]:
    procs: dict[Any, str] = {}
    threads: dict[tuple[Any, Any], str] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        name = str(e.get("args", {}).get("name", ""))
        if e.get("name") == "process_name":
            procs[e.get("pid")] = name
        elif e.get("name") == "thread_name":
            threads[(e.get("pid"), e.get("tid"))] = name
    return procs, threads


def _device_threads(
    procs: dict[Any, str], threads: dict[tuple[Any, Any], str]
) -> dict[tuple[Any, Any], str]:
    """``(pid, tid) -> device`` for the device streams of a trace with device processes."""
    out: dict[tuple[Any, Any], str] = {}
    for pid, pname in procs.items():
        if not pname.startswith("/device:"):
            continue
        mine = {tid: n for (p, tid), n in threads.items() if p == pid}
        streams = [t for t, n in mine.items() if "stream" in n.lower()]
        chosen = streams or [t for t, n in mine.items() if n == "XLA Ops"]
        out.update({(pid, t): pname for t in chosen})
    return out


def _parse(events: list[dict[str, Any]]) -> tuple[list[_Op], list[_Mark]]:
    procs, threads = _names(events)
    devices = _device_threads(procs, threads)
    host_pids = {p for p, n in procs.items() if n.startswith("/host:")} or {
        p for p in procs if not procs[p].startswith("/device:")
    }
    ops: list[_Op] = []
    marks: list[_Mark] = []
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        args = e.get("args") or {}
        name = str(e.get("name", ""))
        pid, tid = e.get("pid"), e.get("tid")
        if "step_num" in args and pid in host_pids:
            try:
                step: int | None = int(args["step_num"])
            except (TypeError, ValueError):
                step = None
            marks.append(_Mark(step, start, end))
            continue
        if devices:
            device = devices.get((pid, tid))
        elif "hlo_op" in args and "device_ordinal" in args:
            device = f"/device:CPU:{args['device_ordinal']}"  # XLA:CPU op thunks
        else:
            device = None
        if device is None:
            continue
        hlo_op = args.get("hlo_op")
        ops.append(
            _Op(
                device=device,
                thread=(pid, tid),
                start=start,
                end=end,
                collective=is_collective(name, hlo_op),
                module=args.get("hlo_module"),
                op=hlo_op if hlo_op is not None else name,
                run=args.get("run_id"),
            )
        )
    marks.sort(key=lambda m: m.start)
    return ops, marks


def _self_time(ops: list[_Op]) -> list[tuple[_Op, list[Interval]]]:
    """Each event with its own time: its span less its children's on the same thread."""
    by_thread: dict[Any, list[_Op]] = {}
    for o in ops:
        by_thread.setdefault((o.device, o.thread), []).append(o)
    out: list[tuple[_Op, list[Interval]]] = []
    for group in by_thread.values():
        group.sort(key=lambda o: (o.start, -o.end))
        children: dict[int, list[Interval]] = {}
        stack: list[int] = []
        for i, o in enumerate(group):
            while stack and group[stack[-1]].end <= o.start:
                stack.pop()
            # a child lies inside its parent; an event that only overlaps the top is a sibling
            while stack and o.end > group[stack[-1]].end:
                stack.pop()
            if stack:
                children.setdefault(stack[-1], []).append((o.start, o.end))
            stack.append(i)
        for i, o in enumerate(group):
            inner = union(children.get(i, []))
            own, at = [], o.start
            for s, e in inner:
                if s > at:
                    own.append((at, s))
                at = max(at, e)
            if o.end > at:
                own.append((at, o.end))
            out.append((o, own))
    return out


# ------------------------------------------------------------------ steps


@dataclasses.dataclass(frozen=True)
class StepMeter:
    """One step's time on the devices, in milliseconds, averaged over ``devices``.

    Attributes:
        step: the ``step_num`` of the step's annotation (``None`` without annotations).
        wall_ms: the step's window: from the end of the previous step's program to the end
            of this one's (the first step: from its own start).
        compute_ms: time some compute event runs (the union; concurrent kernels count once).
        collective_ms: time some collective runs (the union).
        exposed_ms: collective time during which no compute runs.
        host_gap_ms: time in the window during which the device runs nothing.
        devices: how many devices ran the step.
    """

    step: int | None
    wall_ms: float
    compute_ms: float
    collective_ms: float
    exposed_ms: float
    host_gap_ms: float
    devices: int

    @property
    def overlapped(self) -> float:
        """The fraction of collective time hidden under compute (1 with no collective)."""
        return 1.0 - self.exposed_ms / self.collective_ms if self.collective_ms > 0 else 1.0


def _main_module(ops: list[_Op], module: str | None) -> str | None:
    totals: dict[str, float] = {}
    for o in ops:
        if o.module is not None:
            totals[o.module] = totals.get(o.module, 0.0) + (o.end - o.start)
    if module is not None:
        named = [m for m in totals if module in m]
        if not named:
            raise ValueError(
                f"exposed_communication: module={module!r} matches no XLA module in the trace; "
                f"it holds {sorted(totals)}. Fix: pass part of one of those names, or None."
            )
        return max(named, key=lambda m: totals[m])
    return max(totals, key=lambda m: totals[m]) if totals else None


def _runs(ops: list[_Op], after: float | None, n_marks: int) -> list[list[_Op]]:
    """One device's runs of the step program, in order: each a list of its events."""
    ops = sorted(ops, key=lambda o: (o.start, -o.end))
    if not ops:
        return []
    if all(o.run is not None for o in ops):
        by_run: dict[str, list[_Op]] = {}
        for o in ops:
            by_run.setdefault(str(o.run), []).append(o)
        return sorted(by_run.values(), key=lambda r: r[0].start)
    # No run ids: every run starts with the program's first op (a run of consecutive events
    # of that op, as one op may launch several kernels).
    first = next((o for o in ops if after is None or o.start >= after), ops[0])
    starts = [
        i
        for i, o in enumerate(ops)
        if o.op == first.op and o.start >= first.start and (i == 0 or ops[i - 1].op != o.op)
    ]
    if n_marks and len(starts) > n_marks and len(starts) % n_marks == 0:
        starts = starts[:: len(starts) // n_marks]  # the first op also runs inside a loop
    bounds = [*starts, len(ops)]
    return [ops[a:b] for a, b in itertools.pairwise(bounds)]


def _match(runs: list[list[_Op]], marks: list[_Mark]) -> list[tuple[int, int | None, list[_Op]]]:
    """``(key, step, run)``: each step's run, the first unmatched one to start after its mark."""
    if not marks:
        return [(k, None, r) for k, r in enumerate(runs)]
    out, i = [], 0
    for k, m in enumerate(marks):
        while i < len(runs) and runs[i][0].start < m.start:
            i += 1
        if i == len(runs):
            break
        out.append((k, m.step, runs[i]))
        i += 1
    return out


def exposed_communication(path: str, *, module: str | None = None) -> list[StepMeter]:
    """Per-step compute, collective, exposed-collective and host-gap time from a trace.

    Args:
        path: a ``*.trace.json.gz`` written by ``jax.profiler``, or a folder above one (the
            newest is read).
        module: part of the name of the XLA module that is the step (default: the module with
            the most device time, which in a training loop is the step).

    Returns:
        One :class:`StepMeter` per step found, in order (see the module docstring for the
        rules). Steps whose program did not run within the trace are left out.
    """
    ops, marks = _parse(_load(find_trace(path)))
    main = _main_module(ops, module)
    per_device: dict[str, list[tuple[_Op, list[Interval]]]] = {}
    for o, own in _self_time(ops):
        per_device.setdefault(o.device, []).append((o, own))
    # step index -> list of per-device figures
    figures: dict[int, list[tuple[float, float, float, float, float]]] = {}
    steps: dict[int, int | None] = {}
    after = marks[0].start if marks else None
    for events in per_device.values():
        prog = [o for o, _ in events if main is None or o.module == main]
        matched = _match(_runs(prog, after, len(marks)), marks)
        if not matched:
            continue
        compute = union(iv for o, own in events if not o.collective for iv in own)
        collective = union(iv for o, own in events if o.collective for iv in own)
        busy = union([*compute, *collective])
        lo = min(o.start for o in matched[0][2])
        for k, step, run in matched:
            hi = max(o.end for o in run)
            c, x = clip(compute, lo, hi), clip(collective, lo, hi)
            exposed = measure(x) - measure(intersect(x, c))
            gap = (hi - lo) - measure(clip(busy, lo, hi))
            figures.setdefault(k, []).append((hi - lo, measure(c), measure(x), exposed, gap))
            steps[k] = step
            lo = hi
    out = []
    for k in sorted(figures):
        rows = figures[k]
        wall, compute, collective, exposed, gap = (
            sum(col) / len(rows) / 1000.0 for col in zip(*rows, strict=True)
        )
        out.append(StepMeter(steps[k], wall, compute, collective, exposed, gap, len(rows)))
    return out


# ------------------------------------------------------------------ summary and reports


@dataclasses.dataclass(frozen=True)
class MeterSummary:
    """Medians over the measured steps (the first left out as warm-up when there are more).

    ``overlapped`` is ``1 - exposed_ms / collective_ms`` of the medians (1 with no
    collective).
    """

    steps: int
    wall_ms: float
    compute_ms: float
    collective_ms: float
    exposed_ms: float
    host_gap_ms: float

    @property
    def overlapped(self) -> float:
        return 1.0 - self.exposed_ms / self.collective_ms if self.collective_ms > 0 else 1.0


def summarize(steps: Sequence[StepMeter]) -> MeterSummary:
    """The median step of ``steps``, the first excluded as warm-up when there are two or more."""
    if not steps:
        raise ValueError(
            "summarize: no steps were measured (the trace holds no run of the step program). "
            "Fix: trace at least one whole step, marked with jax.profiler.StepTraceAnnotation."
        )
    used = list(steps[1:]) if len(steps) > 1 else list(steps)

    def med(field: str) -> float:
        return float(statistics.median(getattr(s, field) for s in used))

    return MeterSummary(
        len(used),
        med("wall_ms"),
        med("compute_ms"),
        med("collective_ms"),
        med("exposed_ms"),
        med("host_gap_ms"),
    )


def meter_line(summary: MeterSummary) -> str:
    """One line for a person: ``collectives 12.3 ms/step, exposed 4.1 ms (67% overlapped), ...``"""
    s = summary
    return (
        f"collectives {s.collective_ms:.3g} ms/step, exposed {s.exposed_ms:.3g} ms "
        f"({100 * s.overlapped:.0f}% overlapped), compute {s.compute_ms:.3g} ms, host gap "
        f"{s.host_gap_ms:.3g} ms, step {s.wall_ms:.3g} ms (median of {s.steps} steps)"
    )


def meter_json(steps: Sequence[StepMeter], trace: str | None = None) -> dict[str, Any]:
    """The meter as JSON: the summary, each step, and the trace it was read from."""
    summary = summarize(steps)
    return {
        "trace": trace,
        "summary": {**dataclasses.asdict(summary), "overlapped": summary.overlapped},
        "steps": [{**dataclasses.asdict(s), "overlapped": s.overlapped} for s in steps],
    }


def meter_markdown(steps: Sequence[StepMeter]) -> str:
    """A markdown table of the steps and their median (times in ms)."""
    rows = [
        "| step | wall | compute | collective | exposed | overlapped | host gap | devices |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in steps:
        rows.append(
            f"| {s.step if s.step is not None else '-'} | {s.wall_ms:.3f} | {s.compute_ms:.3f} "
            f"| {s.collective_ms:.3f} | {s.exposed_ms:.3f} | {100 * s.overlapped:.0f}% "
            f"| {s.host_gap_ms:.3f} | {s.devices} |"
        )
    m = summarize(steps)
    rows.append(
        f"| median | {m.wall_ms:.3f} | {m.compute_ms:.3f} | {m.collective_ms:.3f} "
        f"| {m.exposed_ms:.3f} | {100 * m.overlapped:.0f}% | {m.host_gap_ms:.3f} | |"
    )
    return "\n".join(rows)
