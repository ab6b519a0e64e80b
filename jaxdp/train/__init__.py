"""``python -m jaxdp.train`` / ``jaxdp-train``: train a byte-level GPT with ``DataParallel``.

With no arguments it trains ``jaxdp.models.GPT`` on the Python standard library's own ``.py``
files for a few minutes (8 simulated CPU devices when there is no accelerator) and writes
``runs/jaxdp-train/{metrics.jsonl, loss.png, config.yaml, summary.json, checkpoints/}``.
See ``jaxdp-train --help`` and docs/training.md.
"""

from ._cli import main as main

__all__ = ["main"]
