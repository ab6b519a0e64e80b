"""``jaxdp-train`` command line: flags, the run folder, devices and processes, clean errors."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from typing import Any

from ..launch._args import StrictParser
from ._options import ConfigError, RunConfig, apply_set, load_run_config, replace_train
from ._rundir import UsageError, check_out_dir
from ._stop import StopRequested, StopSignals, signal_name

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = StrictParser(
        prog="jaxdp-train",
        description="Train a byte-level GPT with jaxdp's DataParallel (default corpus: the "
        "Python standard library's own .py files; no download).",
    )
    p.add_argument("--config", help="YAML with model:, train:, ddp:, data: sections")
    p.add_argument("--data", help="text file or folder to train on (default: Python's stdlib)")
    p.add_argument("--out", default="runs/jaxdp-train", help="run folder (default: %(default)s)")
    p.add_argument("--steps", type=int, help="train until this step (train.steps)")
    p.add_argument("--resume", action="store_true", help="continue from OUT's latest checkpoint")
    p.add_argument("--overwrite", action="store_true", help="delete the run already in OUT")
    p.add_argument(
        "--devices",
        type=int,
        help="devices to use; on a machine without accelerators, the number of simulated CPU "
        "devices per process (default 8 on one process)",
    )
    p.add_argument("--zero-stage", type=int, help="DDPConfig.zero_stage (0, 1, 2 or 3)")
    p.add_argument("--global-batch", type=int, help="sequences per step over all ranks")
    p.add_argument("--micro-batch", type=int, help="sequences per pass per rank")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a DDPConfig field (zero_stage=2) or model.X / train.X (repeatable)",
    )
    g = p.add_argument_group(
        "multi-process (jax.distributed; under SLURM these come from SLURM_NTASKS, SLURM_PROCID "
        "and the node list)"
    )
    g.add_argument("--coordinator", help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, help="number of processes")
    g.add_argument("--process-id", type=int, help="this process's index")
    g.add_argument(
        "--init-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="give up when not every process has connected within this time (default 300)",
    )
    g.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=100.0,
        metavar="SECONDS",
        help="a process silent for this long is declared dead and the others exit (default 100)",
    )
    g.add_argument(
        "--stop-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="after SIGTERM/SIGINT, exit without a checkpoint if the processes have not "
        "agreed on a step to stop at within this time (default 120)",
    )
    args = p.parse_args(argv)
    for name in ("init_timeout", "heartbeat_timeout", "stop_timeout"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected seconds > 0")
    return args


def _set_simulated_devices(args: argparse.Namespace, multi: bool) -> None:
    """Ask XLA for several CPU devices before jax starts its backend.

    The flag only shapes the CPU platform, so it is harmless where accelerators exist (jax
    then uses them). It is read once, when the first backend starts: later calls do nothing.
    """
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    n = args.devices or (1 if multi else 8)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[001-004,7],gpu2`` -> ``node001``."""
    i = next((k for k, ch in enumerate(nodelist) if ch in ",["), len(nodelist))
    if i == len(nodelist) or nodelist[i] == ",":
        return nodelist[:i]
    prefix, suffix = nodelist[:i], nodelist[i + 1 :]
    j = next((k for k, ch in enumerate(suffix) if ch in ",-]"), len(suffix))
    return prefix + suffix[:j]


def _slurm_processes() -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) from SLURM's environment, or None.

    Derived here rather than by ``jax.distributed.initialize()``'s own detection so that a
    batch script's environment (``SLURM_JOB_NODELIST`` without a step node list) works too and
    the errors can name the address. The rules are jax's: the coordinator is the first host
    of the node list, on port ``JAX_COORDINATOR_PORT`` or ``61440 + SLURM_JOB_ID % 4096``;
    one task (``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS`` = 1) is a one-process run.
    """
    env = os.environ
    if "SLURM_JOB_ID" not in env or "SLURM_PROCID" not in env:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    try:
        n, pid = int(tasks), int(env["SLURM_PROCID"])
        port = int(env.get("JAX_COORDINATOR_PORT") or 61440 + int(env["SLURM_JOB_ID"]) % 4096)
    except ValueError:
        raise UsageError(
            f"SLURM_NTASKS={tasks!r}, SLURM_PROCID={env['SLURM_PROCID']!r}, SLURM_JOB_ID="
            f"{env['SLURM_JOB_ID']!r}: expected integers. Fix: start jaxdp-train with srun."
        ) from None
    if n <= 1:
        return None
    if not nodes:
        raise UsageError(
            f"SLURM_NTASKS={n} but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set, "
            "so the coordinator's host is unknown. Fix: start jaxdp-train with srun, or pass "
            "--coordinator HOST:PORT --num-processes P --process-id I."
        )
    return f"{_first_host(nodes)}:{port}", n, pid


def _process_spec(args: argparse.Namespace) -> tuple[str, int, int, str] | None:
    """(coordinator, num_processes, process_id, where from) of a multi-process run, or None.

    Raises:
        UsageError: some of --coordinator / --num-processes / --process-id are missing.
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
        return args.coordinator, args.num_processes, args.process_id, "flags"
    slurm = _slurm_processes()
    return None if slurm is None else (*slurm, "SLURM")


def _init_distributed(args: argparse.Namespace, spec: tuple[str, int, int, str] | None) -> None:
    """``jax.distributed.initialize`` with bounded waits and errors that name the address.

    jax aborts the process (a C++ fatal error) when connecting times out, so a watchdog fires
    just before, prints what went wrong and how to fix it, and exits with status 1.
    """
    import jax

    ompi = spec is None and "OMPI_COMM_WORLD_SIZE" in os.environ
    if spec is None and not ompi:
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
    if ompi:  # jax reads Open MPI's environment itself
        jax.distributed.initialize(**timeouts)
        return
    assert spec is not None
    address, n, pid, source = spec
    watchdog = threading.Timer(
        args.init_timeout, _init_timed_out, (address, n, pid, source, args.init_timeout)
    )
    watchdog.daemon = True
    watchdog.start()
    # With explicit flags jax must not also read a cluster's environment (under SLURM it would
    # restrict every launcher child to the device SLURM_LOCALID); under SLURM it picks each
    # task's device as jax.distributed.initialize() always has.
    detect = None if source == "SLURM" else "deactivate"
    try:
        jax.distributed.initialize(
            address,
            num_processes=n,
            process_id=pid,
            cluster_detection_method=detect,
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
    where = "from SLURM's environment" if slurm else "from --coordinator"
    start_all = (
        f"run jaxdp-train through srun so that all {n} tasks start (SLURM_NTASKS={n})"
        if slurm
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
            + (" (or set JAX_COORDINATOR_PORT)" if slurm else "")
            + ", or raise --init-timeout"
        )
    print(f"jaxdp-train: error: {what}.", file=sys.stderr, flush=True)
    os._exit(1)


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults <- --config (or OUT/config.yaml on --resume) <- --set <- flags."""
    path = args.config
    saved = os.path.join(args.out, "config.yaml")
    if args.resume and path is None and os.path.exists(saved):
        path = saved
    cfg = load_run_config(path)
    cfg = apply_set(cfg, args.set)
    if args.zero_stage is not None:
        try:  # reported against the flag typed, not as a --set
            ddp = cfg.ddp.replace(zero_stage=args.zero_stage)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--zero-stage {args.zero_stage}: {e}") from None
        cfg = RunConfig(cfg.model, cfg.train, ddp, data=cfg.data)
    if args.data is not None:
        cfg = RunConfig(cfg.model, cfg.train, cfg.ddp, data=args.data)
    return replace_train(
        cfg, steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch
    )


def _latest_checkpoint(out: str) -> int | None:
    """The newest complete checkpoint's step in OUT, read from the folder names (orbax renames
    a finished step's folder to the bare number), without starting jax."""
    try:
        steps = [int(d) for d in os.listdir(os.path.join(out, "checkpoints")) if d.isdigit()]
    except OSError:
        return None
    return max(steps, default=None)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxdp-train`` / ``python -m jaxdp.train``; returns the exit status.

    0: trained to the last step, stopped by SIGTERM / SIGINT with a checkpoint of the step
    every process stopped at, or ``--resume`` of a run already at ``--steps``; 1: the processes
    could not connect; 2: bad input; 128 + signal: a signal before the first step (nothing
    saved).
    """
    args = parse_args(argv)
    try:
        spec = _process_spec(args)
    except UsageError as e:
        print(f"jaxdp-train: error: {e}", file=sys.stderr)
        return 2
    _set_simulated_devices(args, multi=spec is not None)
    from .._src.engine.checkpoint import CheckpointMismatchError
    from ._data import CorpusError

    setup_errors: tuple[type[BaseException], ...] = (
        UsageError,
        ConfigError,
        CorpusError,
        CheckpointMismatchError,
    )
    with StopSignals(args.stop_timeout) as signals:
        try:
            try:
                cfg = resolve_config(args)
                check_out_dir(args)
                at = _latest_checkpoint(args.out) if args.resume else None
                if at is not None and at >= cfg.train.steps:
                    steps = cfg.train.steps
                    where = "= --steps" if at == steps else f"past --steps {steps}"
                    print(
                        f"jaxdp-train: nothing to do: the run is at step {at} {where} (--out "
                        f"{args.out}). Fix: pass a larger --steps to train further.",
                        flush=True,
                    )
                    return 0
                _init_distributed(args, spec)
                from ._loop import Trainer

                trainer = Trainer(cfg, args, signals)
            except setup_errors as e:
                print(f"jaxdp-train: error: {e}", file=sys.stderr)
                return 2
            return trainer.run()
        except StopRequested as e:
            print(
                f"jaxdp-train: stopped by {signal_name(e.signum)} before the first step; "
                "nothing saved",
                file=sys.stderr,
                flush=True,
            )
            return 128 + e.signum
        except Exception as e:
            import jax

            if not jax.distributed.is_initialized():
                raise
            _exit_multi_process(e, args)
            raise  # not reached


def _exit_multi_process(e: Exception, args: argparse.Namespace) -> None:
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
