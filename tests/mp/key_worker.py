"""One process of a 2-process run whose batch holds per-example typed PRNG keys.

Usage: python key_worker.py PROCESS_ID PORT OUT_DIR
"""

import os
import sys

pid, port, out = sys.argv[1:4]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=int(pid))

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _models import mlp_params  # noqa: E402
from test_prng_batch import dropout_loss, key_batches  # noqa: E402

from jaxdp import DataParallel, DDPConfig  # noqa: E402

dp = DataParallel(dropout_loss, optax.sgd(0.1), DDPConfig(zero_stage=1, num_microbatches=2))
state = dp.init(mlp_params())
for full in key_batches():
    local = jax.tree.map(lambda v: v[int(pid) * 16 : (int(pid) + 1) * 16], full)
    batch = dp.shard_batch(local)  # keys travel as their uint32 data, then are wrapped again
    assert batch["key"].dtype == full["key"].dtype and batch["key"].shape == (32,)
    state, metrics = dp.step(state, batch)
flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(dp.params(state))])
np.save(os.path.join(out, f"params_{pid}.npy"), flat)
print(f"process {pid}: {jax.device_count()} devices, loss {float(metrics['loss']):.6f}")
jax.distributed.shutdown()
