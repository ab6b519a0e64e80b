"""jaxdp._src.zero3.scan_gather compiled for 8 compile-only H100s: the per-layer gathers stay in
the loops.

Skips without the ``gpu-aot`` extra. The same structural checks as the CPU test, on the scheduled
GPU program, where the collectives are asynchronous ``*-start``/``*-done`` pairs.
"""

from test_scan_gather import check_structure, sharded_setup


def test_gpu_loops_gather_per_layer(h100):
    f, mixed, xs, (_, _, _, stacked, shards, _) = sharded_setup(True, h100)
    text = f.lower(mixed, xs).compile().as_text()
    assert "all-gather-start" in text and "reduce-scatter-start" in text
    check_structure(text, True, stacked, shards)
