"""Progress reports: where each training process is (step and phase), for the hang watchdogs.

The training loop calls :meth:`Progress.report` when it enters a phase: ``setup`` (before the
first step: connecting, building, restoring), ``step`` N (dispatching and running step N; the
first one includes compiling it), ``eval`` and ``checkpoint`` after step N, ``finished`` N
(between steps), and ``end`` (the sample, the summary and the final barrier). Under
``python -m jaxdp.launch`` each report is also written to ``OUT/logs/progress_I`` (the path comes
in ``JAXDP_PROGRESS_FILE``): one fixed-size line rewritten in place (``pwrite`` at offset 0, a
few microseconds), which the launcher polls. A report costs two or three system calls per step.
"""

from __future__ import annotations

import os
import time
from typing import NamedTuple

__all__ = ["ENV_FILE", "PHASES", "Progress", "Report", "describe", "read_report"]

#: The launcher names each process's progress file in this variable.
ENV_FILE = "JAXDP_PROGRESS_FILE"
#: Phases in the order a step goes through them (for "which process is behind").
PHASES = ("setup", "step", "eval", "checkpoint", "finished", "end")
_RANK = {p: i for i, p in enumerate(PHASES)}
_RECORD = 64  # bytes per record, newline included


class Report(NamedTuple):
    """One progress report: ``phase`` of ``step``."""

    step: int
    phase: str

    def key(self) -> tuple[int, int]:
        """Orders reports by how far a process got (setup < step N < ... < finished N)."""
        if self.phase == "setup":
            return (-1, 0)
        return (self.step, _RANK.get(self.phase, 0))


def describe(r: Report) -> str:
    """``in step 11`` / ``after step 10`` / ``saving the checkpoint of step 10`` ..."""
    return {
        "setup": "in setup (before step 1: connecting, building the model, restoring)",
        "step": f"in step {r.step}" + (" (includes compiling it)" if r.step == 1 else ""),
        "eval": f"in the validation loss after step {r.step}",
        "checkpoint": f"saving the checkpoint of step {r.step}",
        "finished": f"after step {r.step} (step {r.step + 1} not started)",
        "end": f"finishing the run after step {r.step} (sample, summary, final barrier)",
    }.get(r.phase, f"{r.phase} {r.step}")


class Progress:
    """This process's latest report, kept in memory (for the in-process watchdog) and, when
    ``path`` is given, in a file (for the launcher).

    Attributes:
        last: the latest :class:`Report`.
        changed: ``time.monotonic()`` of the latest report.
    """

    def __init__(self, path: str | None = None):
        self.last = Report(0, "setup")
        self.changed = time.monotonic()
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._write()

    def report(self, step: int, phase: str) -> None:
        self.last = Report(step, phase)
        self.changed = time.monotonic()
        if self._fd is not None:
            self._write()

    def _write(self) -> None:
        assert self._fd is not None
        text = f"{self.last.step} {self.last.phase} {time.time():.3f} {os.getpid()}"
        os.pwrite(self._fd, (text.ljust(_RECORD - 1) + "\n").encode(), 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_report(path: str) -> Report | None:
    """The report in a progress file, or None (not written yet, or read while being written)."""
    try:
        with open(path, "rb") as f:
            words = f.read(_RECORD).decode(errors="replace").split()
        return Report(int(words[0]), words[1]) if len(words) >= 2 else None
    except (OSError, ValueError):
        return None
