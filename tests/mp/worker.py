"""One process of a 2-process jaxdp run on localhost (gloo collectives on CPU).

Usage: python worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR STAGE [numpy]

With ``numpy`` each process feeds its slice as NumPy float64 arrays (NumPy's default dtype).
"""

import os
import sys

pid, nproc, port, out, stage = sys.argv[1:6]
as_numpy = sys.argv[6:] == ["numpy"]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=int(nproc), process_id=int(pid))

import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from _models import make_batch, mlp_params, mse_loss  # noqa: E402

from jaxdp import DataParallel, DDPConfig  # noqa: E402

engine = DataParallel(
    mse_loss, optax.adam(1e-2), DDPConfig(zero_stage=int(stage), num_microbatches=2)
)
state = engine.init(mlp_params())
per_proc = 32 // int(nproc)
for s in range(3):
    full = make_batch(32, seed=s)
    local = {k: v[int(pid) * per_proc : (int(pid) + 1) * per_proc] for k, v in full.items()}
    if as_numpy:
        local = {k: np.asarray(v, np.float64) for k, v in local.items()}
    state, metrics = engine.step(state, engine.shard_batch(local))
params = engine.params(state)
flat = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(params)])
np.save(os.path.join(out, f"params_{pid}.npy"), flat)
print(f"process {pid}: {jax.device_count()} devices, loss {float(metrics['loss']):.6f}")
jax.distributed.shutdown()
