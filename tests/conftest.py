"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_enable_x64", False)


def pytest_report_header(config):
    return f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})"


# Helper scripts run as subprocesses, not test modules (--doctest-modules would import them).
collect_ignore = ["mp", "_models.py", "_fp32_property.py", "_gpt_nn.py", "_transformer.py"]
