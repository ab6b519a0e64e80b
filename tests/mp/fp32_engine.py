"""DataParallel's FP32-accumulation property at device counts beyond the in-process 8.

Usage: python fp32_engine.py MAX_DP OUT_JSON DP[,DP...]
Runs every mode of ``_fp32_property.ENGINE_MODES`` on a mesh over the first DP of MAX_DP
simulated CPU devices and writes {mode/dp/G: [exact fraction, max ulps]}.
"""

import json
import os
import sys

max_dp, out_path, dps = sys.argv[1:4]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max_dp}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _fp32_property import ENGINE_MODES, engine_reduced_gradient  # noqa: E402

from jaxdp.testing import bf16_rounding_report as rounding_report  # noqa: E402

results = {}
for dp in (int(d) for d in dps.split(",")):
    for mode, (_, gs) in ENGINE_MODES.items():
        for g in gs:
            grad, x = engine_reduced_gradient(mode, dp, g, n=4096, devices=jax.devices()[:dp])
            results[f"{mode}/{dp}/{g}"] = rounding_report(grad, x)
            print(mode, dp, g, results[f"{mode}/{dp}/{g}"], flush=True)
with open(out_path, "w") as f:
    json.dump(results, f)
