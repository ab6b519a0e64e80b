"""Test setup: 8 simulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", False)

# Many tests compile the same program (an engine and its reference on the same model and
# config): a persistent compilation cache private to this test session serves the repeats
# (about a fifth of the suite's time). Set through jax.config, not JAX_COMPILATION_CACHE_DIR,
# so that the scripts the tests start as subprocesses compile as a user's run would. Under
# pytest-xdist the workers share the controller's (its path reaches them in
# JAXDP_TESTS_XLA_CACHE, which only this file reads); the controller, or a plain run, made it
# and removes it at exit.
_XLA_CACHE = os.environ.get("JAXDP_TESTS_XLA_CACHE", "")
if not _XLA_CACHE:
    _XLA_CACHE = os.environ["JAXDP_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="jaxdp-tests-xla-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", _XLA_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    # Programs compiled for compile-only H100s are written to the cache too, but a client with
    # no devices cannot load one back: jax warns and compiles it again, as without the cache.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error reading persistent compilation cache entry:UserWarning"
    )


def pytest_report_header(config):
    return f"jax {jax.__version__}, {jax.device_count()} devices ({jax.devices()[0].platform})"


# Helper scripts run as subprocesses, not test modules (--doctest-modules would import them).
collect_ignore = ["mp", "_models.py", "_fp32_property.py", "_gpt_nn.py", "_transformer.py"]


@pytest.fixture(scope="session")
def h100():
    """8 compile-only H100 devices as a 1-D ``data`` mesh, or a skip without the gpu-aot extra."""
    from jaxdp._src.platform.platform import cuda_plugin_available

    if not cuda_plugin_available():
        pytest.skip("needs the gpu-aot extra: pip install 'jaxdp[gpu-aot]'")
    from jaxdp.aot import h100_mesh

    try:
        return h100_mesh(8)
    except RuntimeError as e:  # e.g. a plugin/jaxlib version mismatch
        pytest.skip(f"no compile-only H100 topology: {e}")
