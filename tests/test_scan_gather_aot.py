"""jaxdp._scan_gather compiled for 8 compile-only H100s: the per-layer gathers stay in the loops.

Skips without the ``gpu-aot`` extra. The same structural checks as the CPU test, on the scheduled
GPU program, where the collectives are asynchronous ``*-start``/``*-done`` pairs.
"""

import importlib.util

import pytest
from test_scan_gather import check_structure, sharded_setup

from jaxdp.aot import h100_mesh

HAVE_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None


def test_gpu_loops_gather_per_layer():
    if not HAVE_PLUGIN:
        pytest.skip("needs the gpu-aot extra: pip install 'jaxdp[gpu-aot]'")
    try:
        mesh = h100_mesh(8)
    except RuntimeError as e:
        pytest.skip(f"no compile-only H100 topology: {e}")
    f, mixed, xs, (_, _, _, stacked, shards, _) = sharded_setup(True, mesh)
    text = f.lower(mixed, xs).compile().as_text()
    assert "all-gather-start" in text and "reduce-scatter-start" in text
    check_structure(text, True, stacked, shards)
