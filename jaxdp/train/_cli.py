"""``jaxdp-train`` command line: flags, the run folder, devices and processes, clean errors."""

from __future__ import annotations

import argparse
import os
import sys

from ..launch._args import StrictParser
from ..launch._cluster import Cluster
from ..launch._launcher import DEFAULT_HANG_TIMEOUT
from ..launch._progress import ENV_FILE, Progress
from ..launch._watchdog import InProcessWatchdog, register_stack_dump
from ._options import ConfigError, RunConfig, apply_set, load_run_config, replace_train
from ._processes import arm_nccl_timeout, exit_multi_process, init_distributed, process_spec
from ._rundir import UsageError, check_out_dir
from ._stop import StopRequested, StopSignals, signal_name

__all__ = ["main", "parse_args"]

#: Steps traced by a bare ``--profile`` (jaxdp/train/_profile.py).
DEFAULT_PROFILE_STEPS = 5


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
        "--profile",
        type=int,
        nargs="?",
        const=DEFAULT_PROFILE_STEPS,
        metavar="N",
        help="trace N steps from the third (default %(const)s) with jax.profiler and write "
        "OUT/profile/meter.json: per-step compute, collective and exposed-collective time "
        "(docs/training.md)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a DDPConfig field (zero_stage=2) or model.X / train.X (repeatable)",
    )
    g = p.add_argument_group(
        "multi-process (jax.distributed; without these flags they come from the environment of "
        "SLURM, Open MPI, Kubernetes, SkyPilot, MaxText's or jax's conventions: "
        "docs/launching.md)"
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
    g.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULT_HANG_TIMEOUT,
        metavar="SECONDS",
        help="when this process has made no progress (started or finished a step) for this "
        "long, print where every process is, dump its Python stacks and exit 124; also XLA's "
        "NCCL termination timeout on GPUs. Under python -m jaxdp.launch the launcher watches "
        f"instead (default {DEFAULT_HANG_TIMEOUT:g}; 0: off)",
    )
    args = p.parse_args(argv)
    if args.profile is not None and args.profile < 1:
        p.error(f"--profile {args.profile}: expected a number of steps >= 1 (or no number)")
    if args.hang_timeout < 0:
        p.error(f"--hang-timeout {args.hang_timeout:g}: expected seconds >= 0 (0: off)")
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
    could not connect, or an error in one of several processes; 2: bad input; 124: no progress
    for ``--hang-timeout`` seconds; 128 + signal: a signal before the first step (nothing
    saved). After a failure in a multi-process run the process exits at once, without waiting
    for the others in ``jax.distributed.shutdown()``.
    """
    args = parse_args(argv)
    try:
        spec = process_spec(args)
    except UsageError as e:
        print(f"jaxdp-train: error: {e}", file=sys.stderr)
        return 2
    _set_simulated_devices(args, multi=spec is not None)
    arm_nccl_timeout(args.hang_timeout)
    # Under jaxdp.launch the launcher watches every process's progress file; otherwise a
    # thread in each process watches its own progress (launch/_watchdog.py).
    progress = Progress(os.environ.get(ENV_FILE))
    watched = args.hang_timeout > 0 and not os.environ.get(ENV_FILE)
    watchdog = InProcessWatchdog(progress, args.hang_timeout) if watched else None
    restore_dump = register_stack_dump()
    try:
        if watchdog is not None:
            with watchdog:
                status = _run(args, spec, progress)
        else:
            status = _run(args, spec, progress)
    finally:
        restore_dump()
        progress.close()
    import jax

    if jax.distributed.is_initialized():
        if status == 0:
            jax.distributed.shutdown()  # a clean end: leave together
        else:  # a failure: waiting for the others at the shutdown barrier would only delay
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    return status


def _run(args: argparse.Namespace, spec: Cluster | None, progress: Progress) -> int:
    from .. import CheckpointMismatchError
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
                init_distributed(args, spec)
                from ._loop import Trainer

                trainer = Trainer(cfg, args, signals, progress=progress)
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
            exit_multi_process(e, args)
            raise  # not reached
