"""Quiet start-up on machines without a GPU when a CUDA plugin is installed.

With ``jax-cuda12-plugin`` installed (jaxdp's ``gpu-aot`` extra, for compile-only H100
devices) on a machine without an NVIDIA driver, ``import jax`` prints CUDA loader lines and the
first backend start prints a ``Jax plugin configuration error`` traceback before falling back
to the CPU. Nothing is wrong, but it buries real output. :func:`prepare_jax` runs before jaxdp
imports jax: when no NVIDIA driver is present and the user has not chosen a platform, it sets
``JAX_PLATFORMS=cpu`` (the plugin stays usable for device-less compilation, see
:mod:`jaxdp.aot`) and imports jax with the C++ loader's start-up lines held back; they are
replayed if the import fails. A user who sets ``JAX_PLATFORMS`` keeps full control; on a
machine with a GPU nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["cuda_plugin_available", "gpu_driver_present", "prepare_jax"]

_DRIVER_PATHS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def gpu_driver_present() -> bool:
    """Whether this machine exposes an NVIDIA driver (device node or kernel module)."""
    return any(os.path.exists(p) for p in _DRIVER_PATHS)


def cuda_plugin_available() -> bool:
    """Whether jax's CUDA PJRT plugin (``jax_plugins.xla_cuda12``, the ``gpu-aot`` extra) is
    installed. ``False`` (not an exception) when the ``jax_plugins`` namespace package itself is
    missing, where ``importlib.util.find_spec`` raises ``ModuleNotFoundError``."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _stderr_held() -> Iterator[None]:
    """Hold back what C++ code writes to file descriptor 2; replay it if the body raises."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. some notebooks)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        except BaseException:
            os.dup2(saved, fd)
            tmp.seek(0)
            sys.stderr.write(tmp.read().decode(errors="replace"))
            raise
        finally:
            os.dup2(saved, fd)
            os.close(saved)


def prepare_jax() -> None:
    """Choose the CPU platform and import jax quietly when a CUDA plugin has no GPU to use.

    Does nothing if jax is already imported, ``JAX_PLATFORMS`` is set, no CUDA plugin is
    installed, or an NVIDIA driver is present.
    """
    if "jax" in sys.modules or os.environ.get("JAX_PLATFORMS"):
        return
    if not cuda_plugin_available() or gpu_driver_present():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    with _stderr_held():
        import jax  # noqa: F401
