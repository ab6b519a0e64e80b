"""Start-up on a machine without a GPU but with the CUDA plugin (the gpu-aot extra) installed."""

import os
import subprocess
import sys

import pytest

from jaxdp._src.platform.platform import cuda_plugin_available, gpu_driver_present

needs_plugin_without_gpu = pytest.mark.skipif(
    not cuda_plugin_available() or gpu_driver_present(),
    reason="needs the CUDA plugin installed on a machine without an NVIDIA driver",
)

PROBE = (
    "import jaxdp, jax, jax.numpy as jnp, os; jnp.zeros(3); "  # the first array starts a backend
    "print(jax.devices()[0].platform, os.environ.get('JAX_PLATFORMS'))"
)
NOISE = ("cudart_stub", "absl::InitializeLog", "Could not find cuda drivers")


def run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )


@needs_plugin_without_gpu
@pytest.mark.parametrize("platforms", [None, "cpu"])
def test_import_picks_cpu_without_a_traceback_or_cuda_lines(platforms):
    proc = run({} if platforms is None else {"JAX_PLATFORMS": platforms})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["cpu", "cpu"]
    assert proc.stderr == "", proc.stderr[-2000:]  # neither a traceback nor the CUDA lines


@needs_plugin_without_gpu
def test_a_platform_the_user_set_is_kept():
    proc = run({"JAX_PLATFORMS": "cpu,cuda"})
    assert proc.stdout.split()[-1] == "cpu,cuda"


@needs_plugin_without_gpu
def test_real_plugin_errors_are_still_shown():
    proc = run({"JAX_PLATFORMS": "cuda"})  # asks for the GPU this machine lacks
    assert proc.returncode != 0
    assert "Jax plugin configuration error" in proc.stderr
    assert "RuntimeError: Unable to load CUDA. Is it installed?" in proc.stderr
    assert not any(n in proc.stderr for n in NOISE)


def test_held_stderr_drops_only_the_known_lines(capfd):
    from jaxdp._src.platform.platform import _NO_GPU_NOISE, _stderr_filtered

    noise = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1795526264.996097    3429 cudart_stub.cc:31] Could not find cuda drivers "
        "on your machine, GPU will not be used.\n"
    )
    fd = sys.stderr.fileno()  # 2, or capfd's file: what C++ code writes to
    with _stderr_filtered(_NO_GPU_NOISE):
        os.write(fd, (noise + "E0000 something real\n").encode())
    assert capfd.readouterr().err == "E0000 something real\n"
    with pytest.raises(ImportError), _stderr_filtered(_NO_GPU_NOISE):
        os.write(fd, noise.encode())
        raise ImportError("boom")
    assert capfd.readouterr().err == noise  # everything, when the import fails


# Without the gpu-aot extra the namespace package ``jax_plugins`` itself is missing, and
# ``importlib.util.find_spec("jax_plugins.xla_cuda12")`` raises instead of returning None.
BLOCK_JAX_PLUGINS = """
import sys

class _NoJaxPlugins:
    def find_spec(self, name, path=None, target=None):
        if name == "jax_plugins" or name.startswith("jax_plugins."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoJaxPlugins())
"""

HINT = "pip install 'jaxdp[gpu-aot]'"


def test_missing_jax_plugins_package_is_not_installed(monkeypatch):
    import importlib.util

    from jaxdp.aot import h100_topology

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.startswith("jax_plugins"):
            raise ModuleNotFoundError("No module named 'jax_plugins'", name="jax_plugins")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert cuda_plugin_available() is False
    with pytest.raises(ImportError, match=r"the CUDA PJRT plugin is not installed") as info:
        h100_topology(8)
    assert HINT in str(info.value)


def test_aot_cli_without_the_extra_prints_the_install_hint():
    code = BLOCK_JAX_PLUGINS + "from jaxdp.aot.__main__ import main; sys.exit(main([]))"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())  # rich wraps long lines
    assert "No module named" not in out
    assert "the CUDA PJRT plugin is not installed" in out and HINT in out
