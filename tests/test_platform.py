"""Start-up on a machine without a GPU but with the CUDA plugin (the gpu-aot extra) installed."""

import os
import subprocess
import sys

import pytest

from jaxdp._platform import _cuda_plugin_installed, gpu_driver_present

needs_plugin_without_gpu = pytest.mark.skipif(
    not _cuda_plugin_installed() or gpu_driver_present(),
    reason="needs the CUDA plugin installed on a machine without an NVIDIA driver",
)

PROBE = "import jaxdp, jax, os; print(jax.devices()[0].platform, os.environ.get('JAX_PLATFORMS'))"


def run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@needs_plugin_without_gpu
def test_import_picks_cpu_without_a_traceback():
    proc = run({})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cpu", "cpu"]
    assert "Traceback" not in proc.stderr
    assert "plugin configuration error" not in proc.stderr


@needs_plugin_without_gpu
def test_a_platform_the_user_set_is_kept():
    proc = run({"JAX_PLATFORMS": "cpu,cuda"})
    assert proc.stdout.split()[-1] == "cpu,cuda"
