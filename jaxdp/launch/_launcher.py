"""``python -m jaxdp.launch --nproc P -- <jaxdp-train args>``: P training processes on this host.

Each process is ``python -m jaxdp.train <args> --coordinator 127.0.0.1:PORT --num-processes P
--process-id I`` with its own share of the devices: on a machine without accelerators each gets
``--devices-per-process`` simulated CPU devices (default ``8 // P``, so the run has 8 devices
as a one-process run does), and the processes talk through ``jax.distributed`` with gloo CPU
collectives. Process 0's output is shown; the others write ``OUT/logs/process_I.log`` (shown
if they fail). The child PIDs are printed at the start.

Signals and failures:

- SIGTERM / SIGINT to the launcher is forwarded to every process: they stop at the same step,
  checkpoint it and exit 0 (``--resume`` continues); a second signal is forwarded too and ends
  them at once.
- If a process dies or fails, the launcher names it and its exit status, sends SIGTERM to the
  others and exits with that status.
- Processes still running ``--grace`` seconds after a forwarded signal or a failure are killed
  (SIGKILL, to their process groups, after a SIGCONT for stopped ones). The processes are killed
  too if the launcher itself dies (Linux: parent-death signal), and they run in their own process
  group, so a Ctrl-C in the terminal reaches them only once, through the launcher.
- Hangs (``--hang-timeout``, default 600 s; 0: off): each process reports its step to
  ``OUT/logs/progress_I``; when no process has reported for that long, the launcher names the
  process that is behind and its step, has every process write its Python stacks to its log,
  kills them all and exits with status 124 (see ``_watchdog.py`` and docs/launching.md).

Example::

    python -m jaxdp.launch --nproc 2 -- --steps 50 --out runs/two-procs
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from ._args import StrictParser
from ._progress import ENV_FILE
from ._watchdog import HANG_STATUS, LauncherWatch, dump_and_kill, signal_group

__all__ = ["DEFAULT_HANG_TIMEOUT", "main", "stop_processes"]

#: Default ``--hang-timeout`` of the launcher and of jaxdp-train: a wide margin over a first
#: step's compilation and a checkpoint save (seconds to tens of seconds in BENCHMARKS.md), and
#: the NCCL termination timeout marin runs with (600 s).
DEFAULT_HANG_TIMEOUT = 600.0

_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _out_dir(train_args: list[str]) -> str:
    for i, a in enumerate(train_args):
        if a == "--out" and i + 1 < len(train_args):
            return train_args[i + 1]
        if a.startswith("--out="):
            return a.split("=", 1)[1]
    return "runs/jaxdp-train"


def _child_setup(parent: int) -> Any:
    """``preexec_fn`` of each process: its own process group, and death with the launcher."""

    def setup() -> None:
        os.setpgid(0, 0)
        if sys.platform.startswith("linux"):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os._exit(1)

    return setup


def describe(returncode: int) -> str:
    """``exit status 1`` / ``killed by SIGKILL``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit status {returncode}"


def _status(returncode: int) -> int:
    """The launcher's exit status for a process's: a signal N becomes 128 + N (as a shell)."""
    return 128 - returncode if returncode < 0 else returncode


def stop_processes(
    procs: list[subprocess.Popen[Any]], grace: float, sig: int = signal.SIGTERM
) -> list[int]:
    """Send ``sig`` to the live processes (to their process groups, after a SIGCONT), wait up to
    ``grace`` seconds, SIGKILL the rest.

    Returns the indices of the processes that had to be killed.
    """
    for q in procs:
        if q.poll() is None:
            signal_group(q, signal.SIGCONT)  # a stopped process acts on no other signal
            signal_group(q, sig)
    deadline = time.monotonic() + grace
    while any(q.poll() is None for q in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = [i for i, q in enumerate(procs) if q.poll() is None]
    for i in killed:
        signal_group(procs[i], signal.SIGKILL)
    for q in procs:
        q.wait()
    return killed


def _send(q: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        q.send_signal(sig)  # does nothing once the process has been waited for


def main(argv: list[str] | None = None) -> int:
    """Start the processes, wait for them, return the first failure's exit status (or 0)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    ours, train_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    p = StrictParser(
        prog="python -m jaxdp.launch",
        description=(__doc__ or "").split("\n")[0],
        unknown_hint="jaxdp-train's arguments go after '--': python -m jaxdp.launch --nproc 2 "
        "-- --steps 50",
    )
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--devices-per-process", type=int, help="simulated CPU devices per process")
    p.add_argument("--port", type=int, help="coordinator port (default: a free one)")
    p.add_argument(
        "--grace",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="after forwarding a signal or after a process failed, kill (SIGKILL) the "
        "processes still running after this long (default 60)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT,
        metavar="SECONDS",
        help="when no process has made progress (started or finished a step) for this long, "
        "dump every process's Python stacks to its log, name the process that is behind, kill "
        f"them all and exit {HANG_STATUS} (default {DEFAULT_HANG_TIMEOUT:g}; 0: off)",
    )
    args = p.parse_args(ours)
    if args.nproc < 1:
        p.error(f"--nproc {args.nproc}: expected a positive number of processes, e.g. --nproc 2")
    if args.hang_timeout < 0:
        p.error(f"--hang-timeout {args.hang_timeout:g}: expected seconds >= 0 (0: off)")
    theirs = ("--coordinator", "--num-processes", "--process-id", "--hang-timeout")
    bad = [a for a in train_args if a.split("=")[0] in theirs]
    if bad:
        p.error(
            f"{bad[0]} is set by the launcher; remove it from the training arguments"
            + (" (pass --hang-timeout before '--')" if bad[0].startswith("--hang") else "")
        )
    per = args.devices_per_process or max(8 // args.nproc, 1)
    port = args.port or _free_port()
    logs = os.path.join(_out_dir(train_args), "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={per}"])
    progress = [os.path.join(logs, f"progress_{i}") for i in range(args.nproc)]
    for path in progress:  # a previous run's reports are not this run's progress
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    watch = LauncherWatch(progress, args.hang_timeout) if args.hang_timeout > 0 else None
    procs: list[subprocess.Popen[bytes]] = []
    files: list[Any] = []
    received: list[int] = []  # signals forwarded to the processes
    stop_by = [float("inf")]  # when processes still running get SIGKILL

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        stop_by[0] = min(stop_by[0], time.monotonic() + args.grace)
        for q in procs:
            if q.poll() is None:
                _send(q, signum)

    def say(text: str) -> None:
        print(f"jaxdp.launch: {text}", file=sys.stderr, flush=True)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    status = 0
    try:
        for i in range(args.nproc):
            if received:  # stopped while starting: start no more
                break
            cmd = [
                sys.executable, "-m", "jaxdp.train", *train_args,
                "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", str(args.nproc),
                "--process-id", str(i),
                "--hang-timeout", f"{args.hang_timeout:g}",
            ]  # fmt: skip
            out: Any = None
            if i > 0:
                out = open(os.path.join(logs, f"process_{i}.log"), "w")  # noqa: SIM115 - kept
            files.append(out)
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**env, ENV_FILE: progress[i]},
                    stdout=out,
                    stderr=None if out is None else subprocess.STDOUT,
                    preexec_fn=_child_setup(os.getpid()),
                )
            )
        pids = [q.pid for q in procs]
        started = ", ".join(f"process {i} pid {pid}" for i, pid in enumerate(pids))
        say(f"{started} (logs in {logs})")
        failed: int | None = None
        hung = False
        while any(q.poll() is None for q in procs):
            failed = next((i for i, q in enumerate(procs) if q.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > stop_by[0]:
                break
            if watch is not None and not received:
                alive = [q.poll() is None for q in procs]
                if len(procs) == args.nproc and watch.poll(alive):
                    hung = True
                    say(watch.message(pids, alive))
                    break
            time.sleep(0.1)
        if hung:
            status = HANG_STATUS
            dump_and_kill(procs, pids, say)
            killed: list[int] = []
        else:
            if failed is None:
                failed = next((i for i, q in enumerate(procs) if q.poll() not in (None, 0)), None)
            if failed is not None:
                code = procs[failed].returncode
                status = _status(code)
                say(f"process {failed} (pid {pids[failed]}) {describe(code)}; stopping the others")
                grace = max(stop_by[0] - time.monotonic(), 0.0) if received else args.grace
                killed = stop_processes(procs, grace)
            else:
                killed = stop_processes(procs, 0.0)  # after --grace: the ones still running
                status = next((_status(q.returncode) for q in procs if q.returncode), 0)
        if killed:
            names = ", ".join(f"process {i} (pid {procs[i].pid})" for i in killed)
            say(
                f"killed {names}: still running {args.grace:g} s after "
                + ("the signal" if received else "the failure")
            )
            status = status or _status(procs[killed[0]].returncode)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for q in procs:  # an exception above (e.g. a failed start): leave nothing behind
            if q.poll() is None:
                signal_group(q, signal.SIGCONT)
                signal_group(q, signal.SIGKILL)
                q.wait()
        for f in files:
            if f is not None:
                f.close()
    if status:
        for i, q in enumerate(procs):
            print(
                f"jaxdp.launch: process {i} (pid {q.pid}): {describe(q.returncode)}",
                file=sys.stderr,
            )
        for i in range(1, len(procs)):
            path = os.path.join(logs, f"process_{i}.log")
            with open(path, errors="replace") as f:
                tail = f.read()[-(6000 if hung else 2000) :]
            print(f"--- process {i} ({path}), last lines:\n{tail}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
