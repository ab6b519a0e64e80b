"""Quiet start-up on machines without a GPU when a CUDA plugin is installed.

With ``jax-cuda12-plugin`` installed (jaxdp's ``gpu-aot`` extra, for compile-only GPU
devices) on a machine without an NVIDIA driver, ``import jax`` and the registration of jax's
PJRT plugins (at the first array creation) print CUDA loader lines, and the first backend start
prints a ``Jax plugin configuration error`` traceback before falling back to the CPU. Nothing is
wrong, but it buries real output. :func:`prepare_jax` runs before jaxdp imports jax: when no
NVIDIA driver is present it sets ``JAX_PLATFORMS=cpu`` unless the user chose a platform (the
plugin stays usable for device-less compilation, see :mod:`jaxdp.aot`), and imports jax and
registers the plugins with those known lines dropped; anything else printed meanwhile is
replayed, and all of it if the import fails. On a machine with a GPU nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
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


#: The start-up lines a CUDA plugin prints on a machine without an NVIDIA driver (each copy of
#: absl in jaxlib and the plugin logs them once): nothing is wrong, and they are all it prints.
_NO_GPU_NOISE = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, "
    r"GPU will not be used\."
)


@contextlib.contextmanager
def _stderr_filtered(noise: re.Pattern[str]) -> Iterator[None]:
    """Hold back what C++ code writes to file descriptor 2, then replay every line that is not
    ``noise``; replay all of it if the body raises."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # no real stderr (e.g. some notebooks)
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), fd)
        failed = False
        try:
            yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().decode(errors="replace").splitlines(keepends=True)
            kept = [x for x in lines if failed or not noise.fullmatch(x.rstrip("\r\n"))]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def prepare_jax() -> None:
    """Import jax quietly, on the CPU platform unless chosen otherwise, when a CUDA plugin has
    no GPU to use.

    Sets ``JAX_PLATFORMS=cpu`` if it is unset, then imports jax and registers its PJRT plugins
    (which jax would otherwise do at the first array creation) with the CUDA plugin's
    no-driver start-up lines dropped (:data:`_NO_GPU_NOISE`); anything else they print is
    replayed. Does nothing if jax is already imported, no CUDA plugin is installed, or an
    NVIDIA driver is present.
    """
    if "jax" in sys.modules:
        return
    if not cuda_plugin_available() or gpu_driver_present():
        return
    if not os.environ.get("JAX_PLATFORMS"):  # a platform the user chose is kept
        os.environ["JAX_PLATFORMS"] = "cpu"
    with _stderr_filtered(_NO_GPU_NOISE):
        import jax  # noqa: F401
        from jax._src import xla_bridge

        # Private but stable since jax 0.4; without it the plugin's lines come at the first
        # array creation instead (nothing else changes).
        discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
        if discover is not None:
            discover()
