"""``jaxdp-train --profile N``: trace N steps with ``jax.profiler`` and meter their communication.

The traced steps start with the run's third (the first compiles, the second may still warm
caches up) and the meter leaves the first traced one out of its medians. The loop blocks on the
state once before the trace starts, so the device has no earlier step in flight, and once after
the last traced step; in between it runs as it always does (the host may run ahead of the
device), so the host gaps measured are the loop's own. Each process traces its own devices:
``OUT/profile/`` on one process, ``OUT/profile/process-<i>/`` on several, each with its
``meter.json`` (:mod:`jaxdp.train._meter`); process 0 prints its line.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax

from ._meter import exposed_communication, find_trace, meter_json, meter_line, summarize

__all__ = ["StepProfiler", "profile_dir"]


def profile_dir(out: str) -> str:
    """Where this process writes its trace and ``meter.json``."""
    base = os.path.join(out, "profile")
    if jax.process_count() > 1:
        return os.path.join(base, f"process-{jax.process_index()}")
    return base


class StepProfiler:
    """Traces steps ``first..last`` of a loop over ``start + 1..steps`` (none when ``n`` is
    ``None`` or the run has no step after its compiling one)."""

    def __init__(self, out: str, n: int | None, start: int, steps: int):
        self.dir = profile_dir(out)
        self.first = min(start + 3, steps)
        self.last = min(self.first + (n or 0) - 1, steps)
        self.enabled = n is not None and self.first >= start + 2
        self.tracing = False
        self.summary: dict[str, Any] | None = None
        self.line: str | None = None
        self.error: str | None = None
        self._overhead = 0.0  # seconds spent starting, stopping and metering, not yet taken

    def step(self, step: int, state: Any) -> contextlib.AbstractContextManager[Any]:
        """Enter around one step's host work: starts the trace at the first traced step and
        marks every traced step with ``jax.profiler.StepTraceAnnotation``."""
        if not self.enabled or not self.first <= step <= self.last:
            return contextlib.nullcontext()
        if step == self.first:
            jax.block_until_ready(state)  # no earlier step in flight on the device
            t0 = time.perf_counter()
            os.makedirs(self.dir, exist_ok=True)
            # Python's own calls left out: tracing them slows the host, and host gaps are
            # one of the things measured.
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0
            jax.profiler.start_trace(self.dir, profiler_options=options)
            self.tracing = True
            self._overhead += time.perf_counter() - t0
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after(self, step: int, state: Any) -> None:
        """Call after each step: stops the trace and meters it after the last traced step."""
        if self.tracing and step >= self.last:
            jax.block_until_ready(state)  # waiting for the traced steps is training time
            t0 = time.perf_counter()
            self.stop()
            self._overhead += time.perf_counter() - t0

    def take_overhead(self) -> float:
        """Seconds spent starting, stopping and metering the trace since the last call (left
        out of the step times; the waits for the device before and after are not)."""
        t, self._overhead = self._overhead, 0.0
        return t

    def stop(self) -> None:
        """Stop the trace (also when the loop ends early) and write ``meter.json``."""
        if not self.tracing:
            return
        self.tracing = False
        jax.profiler.stop_trace()
        try:
            trace = find_trace(self.dir)
            steps = exposed_communication(trace)
            report = meter_json(steps, trace=os.path.relpath(trace, self.dir))
        except (OSError, ValueError) as e:
            self.error = f"--profile: the trace in {self.dir} could not be metered: {e}"
            return
        with open(os.path.join(self.dir, "meter.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
        self.summary = report["summary"]
        self.line = meter_line(summarize(steps))
