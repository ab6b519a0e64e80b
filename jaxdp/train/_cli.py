"""``jaxdp-train`` command line: flags, the run folder, devices and processes, clean errors."""

from __future__ import annotations

import argparse
import os
import sys

from ._options import ConfigError, RunConfig, apply_set, load_run_config, replace_train
from ._rundir import UsageError, check_out_dir

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
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
    g = p.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator", help="HOST:PORT of process 0")
    g.add_argument("--num-processes", type=int, help="number of processes")
    g.add_argument("--process-id", type=int, help="this process's index")
    return p.parse_args(argv)


def _set_simulated_devices(args: argparse.Namespace) -> None:
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
    n = args.devices or (8 if not (args.coordinator or args.num_processes) else 1)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _init_distributed(args: argparse.Namespace) -> None:
    import jax

    explicit = args.coordinator or args.num_processes or args.process_id is not None
    auto = any(k in os.environ for k in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"))
    if not (explicit or auto):
        return
    if explicit and not (args.coordinator and args.num_processes and args.process_id is not None):
        raise UsageError(
            f"--coordinator={args.coordinator} --num-processes={args.num_processes} "
            f"--process-id={args.process_id}: a multi-process run needs all three. Fix: e.g. "
            "--coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0, or use "
            "python -m jaxdp.launch --nproc 2 -- ..."
        )
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        # CPU collectives between processes need gloo (harmless when accelerators are used).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        jax.distributed.initialize(
            args.coordinator, num_processes=args.num_processes, process_id=args.process_id
        )
    else:  # SLURM / Open MPI: jax reads the cluster from the environment
        jax.distributed.initialize()


def resolve_config(args: argparse.Namespace) -> RunConfig:
    """Defaults <- --config (or OUT/config.yaml on --resume) <- --set <- flags."""
    path = args.config
    saved = os.path.join(args.out, "config.yaml")
    if args.resume and path is None and os.path.exists(saved):
        path = saved
    cfg = load_run_config(path)
    cfg = apply_set(cfg, args.set)
    if args.zero_stage is not None:
        cfg = apply_set(cfg, [f"zero_stage={args.zero_stage}"])
    if args.data is not None:
        cfg = RunConfig(cfg.model, cfg.train, cfg.ddp, data=args.data)
    return replace_train(
        cfg, steps=args.steps, global_batch=args.global_batch, micro_batch=args.micro_batch
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``jaxdp-train`` / ``python -m jaxdp.train``; returns the exit status."""
    args = parse_args(argv)
    _set_simulated_devices(args)
    from .._checkpoint import CheckpointMismatchError
    from ._data import CorpusError

    setup_errors: tuple[type[BaseException], ...] = (
        UsageError,
        ConfigError,
        CorpusError,
        CheckpointMismatchError,
    )
    try:
        cfg = resolve_config(args)
        check_out_dir(args)
        _init_distributed(args)
        from ._loop import Trainer

        trainer = Trainer(cfg, args)
    except setup_errors as e:
        print(f"jaxdp-train: error: {e}", file=sys.stderr)
        return 2
    trainer.run()
    return 0
