"""Where a benchmark writes its PNG plot, and how BENCHMARKS.md links to it."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def plot_target(plots: str | None, name: str) -> tuple[str, str]:
    """``(path to write, link for the Markdown)``: ``bench/<name>`` linked relative to the
    repository root by default, or ``<plots>/<name>`` linked by its own path."""
    path = os.path.join(plots or HERE, name)
    return path, (os.path.relpath(path, os.path.dirname(HERE)) if plots is None else path)
