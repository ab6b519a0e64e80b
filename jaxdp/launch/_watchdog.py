"""Hang watchdogs: end a run in which no process has made progress for ``--hang-timeout`` s.

A data-parallel job advances in lockstep: when one process stops (frozen by SIGSTOP or a
debugger, spinning in Python, wedged in a collective or a filesystem call), every other process
soon blocks in the step's collectives, and the job burns its allocation doing nothing. Each
training process reports its progress (:mod:`._progress`); a watchdog that sees no report from
any process for the timeout dumps the Python stacks, names the process that is behind and at
which step, and ends the run with exit status :data:`HANG_STATUS`.

**Under** ``python -m jaxdp.launch`` (:class:`LauncherWatch`) the launcher polls every
process's progress file. On a hang it sends each process SIGUSR1 (``jaxdp-train`` registers
``faulthandler`` for it: every thread's Python stack goes to the process's log) and SIGCONT
(a stopped process must run to dump and to die), waits :data:`DUMP_SECONDS`, then SIGKILLs the
process groups. This works whatever state a process is in, stopped included: the launcher is a
separate process.

**Without a launcher** (SLURM, mpirun, Kubernetes, SkyPilot start ``jaxdp-train`` directly),
each process runs :class:`InProcessWatchdog`, a thread that fires when its own process has made
no progress for the timeout: it prints what it knows (its own step, and the last step every
other process published in jax's coordination service), dumps its own stacks and exits at once
(:data:`HANG_STATUS`, no ``jax.distributed.shutdown()``). A thread runs while the main thread
is blocked in a collective or busy in Python. Limits: a *stopped* process runs no thread; its
peers then block in the next collective and their watchdogs fire, and jax's coordination service
(``--heartbeat-timeout``) also ends the processes of a job whose member stopped heart-beating.
The stopped process itself is left to the cluster launcher, which ends a job when a task fails
(``srun --kill-on-bad-exit=1``, a JobSet's failure policy, SkyPilot). A C call that holds the
GIL forever keeps the thread from running too; its peers' watchdogs fire instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from typing import Any

from ._progress import Report, describe, read_report

__all__ = [
    "DUMP_SECONDS",
    "HANG_STATUS",
    "InProcessWatchdog",
    "LauncherWatch",
    "process_state",
    "register_stack_dump",
]

#: Exit status of a run ended by a hang watchdog (as coreutils' ``timeout``).
HANG_STATUS = 124
#: Seconds the launcher leaves the processes to write their stacks before it kills them.
DUMP_SECONDS = 3.0
_KV_PREFIX = "jaxdp/progress/"


def register_stack_dump() -> Any:
    """SIGUSR1 makes this process write every thread's Python stack to stderr (``kill -USR1
    PID``); returns a function that restores the previous state. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or 2, all_threads=True)
    return lambda: faulthandler.unregister(signal.SIGUSR1)


def process_state(pid: int) -> str:
    """The state letter of ``/proc/PID/stat`` (``T``: stopped, ``R`` running, ``S`` sleeping),
    or ``""`` where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _catches(pid: int, sig: int) -> bool:
    """Whether ``pid`` has a handler for ``sig`` (else SIGUSR1 would kill it, e.g. while it is
    still importing). True where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return True


def _behind(reports: dict[int, Report | None], stopped: set[int]) -> list[int]:
    """The processes that are behind: the stopped ones, else those that got least far."""
    if stopped:
        return sorted(stopped)
    known = {i: r for i, r in reports.items() if r is not None}
    if not known:
        return sorted(reports)
    least = min(r.key() for r in known.values())
    missing = [i for i, r in reports.items() if r is None]
    return sorted(missing or [i for i, r in known.items() if r.key() == least])


def _since(r: Report | None) -> str:
    if r is None:
        return "its start (no report yet)"
    return "setup" if r.phase == "setup" else f"step {r.step}"


class LauncherWatch:
    """The launcher's view of every process's progress file (see the module docstring).

    Args:
        paths: the progress file of each process.
        timeout: seconds without a report from any live process that make a hang.
    """

    def __init__(self, paths: list[str], timeout: float):
        self.paths, self.timeout = paths, timeout
        now = time.monotonic()
        self.reports: list[Report | None] = [None] * len(paths)
        self._raw: list[bytes | None] = [None] * len(paths)
        self.changed = [now] * len(paths)

    def poll(self, alive: list[bool]) -> bool:
        """Read the files; True when no live process has reported for ``timeout`` s."""
        now = time.monotonic()
        for i, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    raw = f.read()
            except OSError:
                raw = None
            if raw != self._raw[i]:
                self._raw[i], self.changed[i] = raw, now
                self.reports[i] = read_report(path) if raw else None
        live = [t for t, a in zip(self.changed, alive, strict=True) if a]
        return bool(live) and now - max(live) > self.timeout

    def message(self, pids: list[int], alive: list[bool]) -> str:
        """Which process is behind, and where every live process is."""
        now = time.monotonic()
        live = [i for i, a in enumerate(alive) if a]
        stopped = {i for i in live if process_state(pids[i]) in ("T", "t")}
        behind = _behind({i: self.reports[i] for i in live}, stopped)
        lines = [
            f"hang: no process made progress for {self.timeout:g} s (--hang-timeout "
            f"{self.timeout:g})."
        ]
        for i in behind:
            r = self.reports[i]
            why = " It is stopped (SIGSTOP, a debugger or job control)." if i in stopped else ""
            lines.append(
                f"process {i} (pid {pids[i]}) made no progress since {_since(r)}: last report "
                f"{describe(r) if r else 'none'}, {now - self.changed[i]:.0f} s ago.{why}"
            )
        if len(behind) == len(live) and not stopped and len(live) > 1:
            lines.append(
                "Every process got equally far: a collective that never completes, or the same "
                "slow or stuck code path in all of them (see the stacks)."
            )
        others = [i for i in live if i not in behind]
        for i in others:
            r = self.reports[i]
            lines.append(
                f"process {i} (pid {pids[i]}): last report {describe(r) if r else 'none'}, "
                f"{now - self.changed[i]:.0f} s ago."
            )
        return "\n".join(lines)


def dump_and_kill(procs: list[Any], pids: list[int], say: Any) -> None:
    """SIGUSR1 (stack dump) to the live processes that handle it, SIGCONT to every process
    group, :data:`DUMP_SECONDS` for the dumps, then SIGKILL to the groups; waits for them."""
    live = [q for q in procs if q.poll() is None]
    say(
        f"dumping the Python stacks of processes {[pids.index(q.pid) for q in live]} to their "
        f"logs; killing them in {DUMP_SECONDS:g} s"
    )
    for q in live:
        if _catches(q.pid, signal.SIGUSR1):
            with contextlib.suppress(ProcessLookupError):
                os.kill(q.pid, signal.SIGUSR1)
    for q in live:
        signal_group(q, signal.SIGCONT)
    deadline = time.monotonic() + DUMP_SECONDS
    while any(q.poll() is None for q in live) and time.monotonic() < deadline:
        time.sleep(0.1)
    for q in live:
        signal_group(q, signal.SIGKILL)
    for q in procs:
        q.wait()


def signal_group(q: Any, sig: int) -> None:
    """``sig`` to the process group ``q`` leads (the launcher's children lead their own), or to
    ``q`` alone where it leads none; nothing once ``q`` is gone."""
    try:
        if os.getpgid(q.pid) == q.pid:
            os.killpg(q.pid, sig)
            return
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(ProcessLookupError):
        if q.poll() is None:
            q.send_signal(sig)


class InProcessWatchdog:
    """The watchdog thread of a ``jaxdp-train`` process started without ``jaxdp.launch``.

    Fires when ``progress`` has not changed for ``timeout`` seconds: prints who is behind
    (from the reports every process publishes in jax's coordination service, when it runs),
    dumps this process's Python stacks to stderr and exits with :data:`HANG_STATUS` at once.

    Args:
        progress: this process's :class:`~._progress.Progress`.
        timeout: seconds without a report.
        exit: called with the status instead of ``os._exit`` (tests).
        stream: the file the message and the stacks go to (default: stderr).
    """

    def __init__(self, progress: Any, timeout: float, *, exit: Any = None, stream: Any = None):
        self.progress, self.timeout = progress, timeout
        self._exit = exit or os._exit
        self._stream = stream
        self._stop = threading.Event()
        self._published: Report | None = None
        self._pending = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxdp-hang", daemon=True)
        self._publisher = threading.Thread(target=self._publish, name="jaxdp-progress", daemon=True)
        self.poll_s = min(max(timeout / 20, 0.2), 5.0)

    def __enter__(self) -> InProcessWatchdog:
        self._thread.start()
        self._publisher.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._pending.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ coordination service
    @staticmethod
    def _distributed() -> Any:
        """jax's distributed state once connected, else None. Read without calling jax's API:
        this thread must never start a backend (the main thread may be starting one)."""
        if "jax" not in sys.modules:
            return None
        from jax._src import distributed

        state = distributed.global_state
        return state if state.client is not None and state.process_id is not None else None

    def _client(self) -> Any:
        state = self._distributed()
        return None if state is None else state.client

    def _publish(self) -> None:
        """Its own thread: a call into the coordination service can block (its host stopped)."""
        while not self._stop.is_set():
            self._pending.wait()
            self._pending.clear()
            state, r = self._distributed(), self.progress.last
            if state is None or r == self._published or self._stop.is_set():
                continue
            with contextlib.suppress(Exception):
                key = f"{_KV_PREFIX}{state.process_id}"
                state.client.key_value_set(key, f"{r.step} {r.phase}", allow_overwrite=True)
                self._published = r

    def peers(self, timeout: float) -> dict[int, Report] | None:
        """Every process's last published report, or None (no service, or no answer)."""
        client = self._client()
        if client is None:
            return None
        found: list[dict[int, Report]] = []

        def ask() -> None:
            with contextlib.suppress(Exception):
                got = {}
                for key, value in client.key_value_dir_get(_KV_PREFIX):
                    step, phase = value.split()
                    got[int(key.rsplit("/", 1)[1])] = Report(int(step), phase)
                found.append(got)

        t = threading.Thread(target=ask, daemon=True)
        t.start()
        t.join(timeout)
        return found[0] if found else None

    # ------------------------------------------------------------------ the watch
    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._pending.set()
            idle = time.monotonic() - self.progress.changed
            if idle > self.timeout:
                try:
                    self.fire(idle)
                finally:
                    self._exit(HANG_STATUS)
                return

    def fire(self, idle: float) -> None:
        me, n = 0, 1
        state = self._distributed()
        if state is not None:
            me, n = state.process_id, state.num_processes
        r = self.progress.last
        lines = [
            f"jaxdp-train: hang: process {me} of {n} made no progress since {_since(r)} for "
            f"{idle:.0f} s (--hang-timeout {self.timeout:g}); it is {describe(r)}."
        ]
        if n > 1:
            peers = self.peers(min(10.0, self.timeout))
            if peers is None:
                lines.append(
                    "jaxdp-train: the coordination service did not answer within 10 s (process "
                    "0 hosts it: is process 0 stopped or gone?)."
                )
            else:
                peers[me] = r
                reports: dict[int, Report | None] = {i: peers.get(i) for i in range(n)}
                behind = _behind(reports, set())
                where = "; ".join(
                    f"process {i}: {describe(p) if p else 'no report'}" for i, p in reports.items()
                )
                lines.append(
                    f"jaxdp-train: last reports in the coordination service: {where}. Behind: "
                    + ", ".join(f"process {i} (since {_since(reports[i])})" for i in behind)
                    + "."
                )
        lines.append(
            f"jaxdp-train: this process's Python stacks follow; exiting with status "
            f"{HANG_STATUS} without waiting for the others."
        )
        err = self._stream or sys.__stderr__
        with contextlib.suppress(Exception):
            if err is not None:
                print("\n".join(lines), file=err, flush=True)
                faulthandler.dump_traceback(file=err, all_threads=True)
                err.flush()
