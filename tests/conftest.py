"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

jax.config.update("jax_enable_x64", False)


def pytest_report_header(config):
    return f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})"


# Helper scripts run as subprocesses, not test modules (--doctest-modules would import them).
collect_ignore = ["mp", "_models.py", "_fp32_property.py", "_gpt_nn.py", "_transformer.py"]


@pytest.fixture(scope="session")
def h100():
    """8 compile-only H100 devices as a 1-D ``data`` mesh, or a skip without the gpu-aot extra."""
    from jaxdp._platform import cuda_plugin_available

    if not cuda_plugin_available():
        pytest.skip("needs the gpu-aot extra: pip install 'jaxdp[gpu-aot]'")
    from jaxdp.aot import h100_mesh

    try:
        return h100_mesh(8)
    except RuntimeError as e:  # e.g. a plugin/jaxlib version mismatch
        pytest.skip(f"no compile-only H100 topology: {e}")
