"""``python -m jaxdp.train`` / ``jaxdp-train``: train a byte-level GPT with ``DataParallel``.

With no arguments it trains ``jaxdp.models.GPT`` on the Python standard library's own ``.py``
files for a few minutes (8 simulated CPU devices when there is no accelerator) and writes
``runs/jaxdp-train/{metrics.jsonl, loss.png, config.yaml, summary.json, checkpoints/}``.
See ``jaxdp-train --help`` and docs/training.md.

:func:`exposed_communication` reads any ``jax.profiler`` trace (``jaxdp-train --profile``
writes one) and returns, per step, the compute time, the collective time and the part of it
no compute hides.
"""

from ._cli import main as main
from ._meter import MeterSummary, StepMeter, exposed_communication, meter_line, summarize

__all__ = ["MeterSummary", "StepMeter", "exposed_communication", "main", "meter_line", "summarize"]
