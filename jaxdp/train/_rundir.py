"""The run folder ``OUT``: what a run writes there, the checks before it is touched, and
``--overwrite``. (Its own module so that ``_cli`` and ``_loop`` import it, not each other.)"""

from __future__ import annotations

import argparse
import os
import shutil

__all__ = ["RUN_FILES", "UsageError", "check_out_dir", "clear_run"]

RUN_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "loss.png",
    "summary.json",
    "checkpoints",
    "profile",
)


class UsageError(ValueError):
    """A bad command line or run folder: printed as one line, no traceback."""


def check_out_dir(args: argparse.Namespace) -> None:
    """Refuse an OUT that holds a run unless --resume or --overwrite (nothing is touched)."""
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other. Fix: pass only one.")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: is a file; expected a folder. Fix: another --out.")
    held = [f for f in RUN_FILES if os.path.exists(os.path.join(args.out, f))]
    if args.resume and not os.path.isdir(os.path.join(args.out, "checkpoints")):
        raise UsageError(
            f"--resume: {args.out} holds no checkpoints/ folder, so there is nothing to resume. "
            "Fix: drop --resume to start a run, or pass the --out of the run to continue."
        )
    if held and not (args.resume or args.overwrite):
        raise UsageError(
            f"--out {args.out} already holds a run ({', '.join(held)}). Fix: pass --resume to "
            "continue it, --overwrite to replace it, or another --out."
        )


def clear_run(out: str) -> None:
    """--overwrite: remove only what a run writes (never other files in OUT)."""
    for f in RUN_FILES:
        p = os.path.join(out, f)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
