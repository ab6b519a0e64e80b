"""Two processes x 4 CPU devices on localhost (jax.distributed + gloo) match one device."""

import os
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from _models import make_batch, mlp_params, mse_loss, reference_train

WORKER = os.path.join(os.path.dirname(__file__), "mp", "worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(argvs, timeout=240):
    """Run ``python ARGV`` once per entry, concurrently (no XLA_FLAGS/JAX_PLATFORMS inherited),
    and return their outputs; fails the test on a timeout or a non-zero exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for argv in argvs
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-process run timed out")
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


@pytest.mark.parametrize(
    ("stage", "feed"), [(0, "jax"), (1, "jax"), (1, "numpy")], ids=["0", "1", "1-numpy-f64"]
)
def test_two_processes_match_reference(tmp_path, stage, feed):
    """``numpy``: each process's slice is NumPy float64, which ``shard_batch`` places as the
    float32 the step expects (its signature records the canonical dtype)."""
    port = free_port()
    extra = ["numpy"] if feed == "numpy" else []
    outs = run_workers(
        [[WORKER, str(i), "2", str(port), str(tmp_path), str(stage), *extra] for i in (0, 1)]
    )
    for out in outs:
        assert "8 devices" in out, out[-3000:]
    ref, _ = reference_train(
        mse_loss, optax.adam(1e-2), mlp_params(), [make_batch(32, seed=s) for s in range(3)]
    )
    want = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(ref)])
    for i in range(2):
        got = np.load(tmp_path / f"params_{i}.npy")
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-6
