"""Compile-only GPU devices, for compiling multi-GPU programs on a machine without GPUs.

With the ``gpu-aot`` extra (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt`` at the jaxlib version)
``jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`` builds devices that
XLA can compile for but not run on. The GPU they describe comes from a ``GpuTargetConfigProto``;
jaxdp ships one for the H100 SXM (``h100_sxm.txtpb`` in this package, written from NVIDIA's
public specifications).
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
from typing import Any

import jax
from jax.sharding import Mesh

from .. import make_mesh
from .._src.platform.platform import cuda_plugin_available

__all__ = ["target_config", "h100_topology", "h100_mesh", "TARGET_CONFIGS"]

#: Target configs shipped with jaxdp: name -> file in this package.
TARGET_CONFIGS = {"h100_sxm": "h100_sxm.txtpb"}


def target_config(name: str = "h100_sxm") -> str:
    """The text of a GPU target config shipped with jaxdp (``GpuTargetConfigProto`` format).

    Example:
        >>> "core_count: 132" in target_config("h100_sxm")
        True
    """
    if name not in TARGET_CONFIGS:
        raise ValueError(
            f"target_config: name={name!r}; expected one of {sorted(TARGET_CONFIGS)}. Fix: use "
            "'h100_sxm', or pass your own GpuTargetConfigProto text as target_config_text=."
        )
    res = importlib.resources.files(__package__).joinpath(TARGET_CONFIGS[name])
    return res.read_text(encoding="utf-8")


def _plugin_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"h100_topology: {name}={value!r}; expected a positive int. Fix: e.g. n=8 GPUs per "
            "host, hosts=1."
        )
    return value


def h100_topology(
    n: int = 8, *, hosts: int = 1, target_config_text: str | None = None
) -> list[jax.Device]:
    """``hosts * n`` compile-only GPU devices (``n`` per host), for device-less compilation.

    The devices belong to no backend that can run code: use them in a :class:`Mesh`, lower and
    ``.compile()`` (``.as_text()`` is the scheduled GPU program); never execute. The current
    process needs no GPU; on a machine without one, set ``JAX_PLATFORMS=cpu`` (or
    ``jax.config.update("jax_platforms", "cpu")`` before the backend starts) so that the CUDA
    plugin does not try to open a GPU.

    Args:
        n: GPUs per host.
        hosts: number of hosts (processes); devices are numbered host by host.
        target_config_text: ``GpuTargetConfigProto`` text of another GPU; default: jaxdp's
            own target (:func:`target_config`).

    Raises:
        ImportError: the ``gpu-aot`` extra is not installed.
        RuntimeError: the CUDA plugin could not build the topology (reason in the message).

    Example (with the ``gpu-aot`` extra; ``tests/test_aot.py`` runs it)::

        devices = h100_topology(8)
        len(devices), devices[0].device_kind  # 8, and the device kind jax reports for it
    """
    n, hosts = _check_int("n", n), _check_int("hosts", hosts)
    versions = _plugin_versions()
    if not cuda_plugin_available():
        raise ImportError(
            "h100_topology: the CUDA PJRT plugin is not installed; it is needed to compile for "
            "GPUs without one. Fix: pip install 'jaxdp[gpu-aot]' (jax-cuda12-plugin and "
            f"jax-cuda12-pjrt =={versions['jaxlib']}, the installed jaxlib version)."
        )
    from jax.experimental import topologies

    cfg = target_config("h100_sxm") if target_config_text is None else target_config_text
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=cfg, topology=f"1x{hosts}x{n}"
        )
    except (NotImplementedError, RuntimeError) as e:
        mismatch = {k: v for k, v in versions.items() if v != versions["jaxlib"]}
        hint = (
            f"the plugin versions {mismatch} differ from jaxlib {versions['jaxlib']}: install "
            "the same version"
            if mismatch
            else "on a machine without a GPU, set JAX_PLATFORMS=cpu before jax starts a backend "
            "(the CUDA plugin otherwise fails to initialise and registers no topology); a "
            "custom target_config_text must be GpuTargetConfigProto text"
        )
        raise RuntimeError(
            f"h100_topology: jax.experimental.topologies.get_topology_desc(platform='cuda', "
            f"topology='1x{hosts}x{n}') failed: {e}. Fix: {hint}."
        ) from e
    return list(topo.devices)


def h100_mesh(n: int = 8, *, hosts: int = 1, axis: str = "data") -> Mesh:
    """A 1-D data-parallel :class:`Mesh` over :func:`h100_topology` devices.

    Example (with the ``gpu-aot`` extra)::

        mesh = h100_mesh(8)
        dp = DataParallel(loss_fn, optax.adamw(1e-3), DDPConfig(zero_stage=1), mesh=mesh)
    """
    return make_mesh(h100_topology(n, hosts=hosts), axis=axis)
