"""jaxdp-train's processes: which job this process belongs to (flags or the environment),
``jax.distributed.initialize`` with bounded waits, XLA's NCCL termination timeout, and the exit
of one process of several after an error."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from typing import Any

from ..launch._cluster import Cluster, ClusterError, detect_cluster
from ._rundir import UsageError

__all__ = ["arm_nccl_timeout", "exit_multi_process", "init_distributed", "process_spec"]


def process_spec(args: argparse.Namespace) -> Cluster | None:
    """The multi-process job this process belongs to (flags, else the environment), or None.

    Raises:
        UsageError: some of --coordinator / --num-processes / --process-id are missing, or the
            environment's launch variables are partial or contradict each other.
    """
    explicit = args.coordinator or args.num_processes or args.process_id is not None
    if explicit:
        if not (args.coordinator and args.num_processes and args.process_id is not None):
            raise UsageError(
                f"--coordinator={args.coordinator} --num-processes={args.num_processes} "
                f"--process-id={args.process_id}: a multi-process run needs all three. Fix: e.g. "
                "--coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0, or use "
                "python -m jaxdp.launch --nproc 2 -- ..."
            )
        if args.num_processes == 1:
            return None
        return Cluster(args.coordinator, args.num_processes, args.process_id, None, "flags")
    try:
        return detect_cluster()
    except ClusterError as e:
        raise UsageError(str(e)) from None


def arm_nccl_timeout(seconds: float) -> None:
    """``--xla_gpu_nccl_termination_timeout_seconds``: a collective stuck that long fails with
    an error instead of waiting forever (XLA's default: -1, off). Added to ``XLA_FLAGS``
    before the backend starts, where a GPU may be used, the installed jaxlib has the flag
    (jaxdp's flag table) and ``XLA_FLAGS`` does not set it already."""
    from .._src.platform.xla_flag_table import flag_available

    name = "xla_gpu_nccl_termination_timeout_seconds"
    flags = os.environ.get("XLA_FLAGS", "")
    if seconds <= 0 or name in flags or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        return
    if flag_available(name):
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={max(int(seconds), 1)}".strip()


def init_distributed(args: argparse.Namespace, spec: Cluster | None) -> None:
    """``jax.distributed.initialize`` with bounded waits and errors that name the address.

    jax aborts the process (a C++ fatal error) when connecting times out, so a watchdog fires
    just before, prints what went wrong and how to fix it, and exits with status 1.
    """
    import jax

    if spec is None:
        return
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        # CPU collectives between processes need gloo (harmless when accelerators are used).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # jax's preemption notifier installs a C++ SIGTERM handler that only records the notice;
    # jaxdp-train handles SIGTERM itself (_stop.py), so the signal must reach Python.
    jax.config.update("jax_enable_preemption_service", False)
    timeouts: dict[str, Any] = {
        "initialization_timeout": int(args.init_timeout) + 5,  # the watchdog fires first
        "heartbeat_timeout_seconds": max(int(args.heartbeat_timeout), 1),
        # At exit every process waits for the others; a dead one must not keep it for long.
        "shutdown_timeout_seconds": max(int(args.heartbeat_timeout), 1),
    }
    address, n, pid, ids, source = spec
    watchdog = threading.Timer(
        args.init_timeout, _init_timed_out, (address, n, pid, source, args.init_timeout)
    )
    watchdog.daemon = True
    watchdog.start()
    # Every argument is given (jaxdp.launch.detect_cluster read the environment), so jax must
    # not read a cluster's environment again (under SLURM it would restrict every launcher
    # child to the device SLURM_LOCALID).
    try:
        jax.distributed.initialize(
            address,
            num_processes=n,
            process_id=pid,
            local_device_ids=list(ids) if ids is not None else None,
            cluster_detection_method="deactivate",
            **timeouts,
        )
    finally:
        watchdog.cancel()


def _init_timed_out(address: str, n: int, pid: int, source: str, timeout: float) -> None:
    """Runs in the watchdog thread: explain, then exit (jax would abort soon after)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        up = True
    except (OSError, ValueError):
        up = False
    slurm = source == "SLURM"
    env = source != "flags"
    where = f"from {source}'s environment" if env else "from --coordinator"
    start_all = (
        f"run jaxdp-train through srun so that all {n} tasks start (SLURM_NTASKS={n})"
        if slurm
        else f"start all {n} processes of the job ({source})"
        if env
        else f"start all {n} processes (--process-id 0..{n - 1}) with --coordinator {address}"
    )
    if pid == 0:
        what = (
            f"process 0 of {n} runs the coordinator at {address} ({where}) but not every "
            f"process connected within --init-timeout {timeout:g} s. Fix: {start_all}, or "
            "raise --init-timeout"
        )
    elif up:
        what = (
            f"process {pid} of {n} reached the coordinator at {address} ({where}) but not "
            f"every process connected within --init-timeout {timeout:g} s. Fix: {start_all}, "
            "or raise --init-timeout"
        )
    else:
        what = (
            f"process {pid} of {n} could not reach the coordinator at {address} ({where}) "
            f"within --init-timeout {timeout:g} s: nothing answers there. Fix: start process 0 "
            "too (it opens that port), check that HOST:PORT is process 0's host and a free "
            "port that no firewall blocks"
            + (" (or set JAX_COORDINATOR_PORT)" if env else "")
            + ", or raise --init-timeout"
        )
    print(f"jaxdp-train: error: {what}.", file=sys.stderr, flush=True)
    os._exit(1)


def exit_multi_process(e: Exception, args: argparse.Namespace) -> None:
    """An error in one process of several: say so (naming the processes that are gone when
    a collective failed) and exit at once with status 1.

    Waiting for the others at exit (jax's shutdown barrier) would only delay the end: a
    collective whose peer died fails, and the peers of a process that exits see it fail.
    """
    import traceback

    import jax

    traceback.print_exc()
    n, me = jax.process_count(), jax.process_index()
    cause = "an error in this process; the others stop when their next collective fails"
    if isinstance(e, jax.errors.JaxRuntimeError):
        gone = _processes_gone(n, min(args.heartbeat_timeout, 15.0))
        if gone:
            cause = f"a collective failed because process(es) {gone} stopped (see their logs)"
        else:
            cause = "a collective failed (another process has probably died; see its log)"
    first = (str(e).strip().splitlines() or [""])[0][:300]
    print(
        f"jaxdp-train: error: process {me} of {n}: {type(e).__name__}: {first}\n"
        f"jaxdp-train: {cause}; exiting without waiting for the others.",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _processes_gone(n: int, timeout: float) -> list[int] | None:
    """The processes the coordination service no longer sees, or None when it cannot say
    within ``timeout`` seconds (it waits for every live process to ask)."""
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return None
    found: list[list[int]] = []

    def ask() -> None:
        try:
            live = client.get_live_nodes(list(range(n)))
        except Exception:  # the coordinator is gone too
            return
        found.append([i for i in range(n) if i not in live])

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout)
    return found[0] if found else None
