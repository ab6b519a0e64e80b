"""``make_mesh``: the 1-D data-parallel device mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["make_mesh", "dp_size", "auto_mesh", "instance_mesh", "instance_axes"]


def make_mesh(devices: Sequence[Any] | Mesh | None = None, axis: str = "data") -> Mesh:
    """A 1-D :class:`jax.sharding.Mesh` over ``devices`` (default: all devices) named ``axis``.

    The axis is of type ``Auto``: jaxdp places every array explicitly (``NamedSharding``) and
    does its collectives by hand inside ``shard_map``, and ``Auto`` lets a user's batch arrive
    with any sharding.

    Args:
        devices: ``None`` for every device of every process, a sequence of devices, or an
            existing ``Mesh``, which is returned as is once it is checked to have ``axis``.
        axis: name of the data-parallel axis (the config's ``data_axis``).

    Example:
        >>> import jax
        >>> mesh = make_mesh()
        >>> mesh.axis_names, mesh.shape["data"] == jax.device_count()
        (('data',), True)
    """
    if not isinstance(axis, str) or not axis:
        raise ValueError(
            f"make_mesh: axis={axis!r}; expected a non-empty axis name. Fix: axis='data'."
        )
    if isinstance(devices, Mesh):
        if axis not in devices.axis_names:
            raise ValueError(
                f"make_mesh: the mesh has axes {devices.axis_names}; expected one named {axis!r}. "
                f"Fix: pass axis=<one of {devices.axis_names}> or build the mesh with it."
            )
        return devices
    if devices is None:
        return jax.make_mesh((jax.device_count(),), (axis,), axis_types=(AxisType.Auto,))
    devs = list(devices)
    if not devs:
        raise ValueError("make_mesh: devices is empty; expected at least one device.")
    if len({id(d) for d in devs}) != len(devs):
        raise ValueError(f"make_mesh: devices contains duplicates: {devs}.")
    return Mesh(np.asarray(devs, dtype=object), (axis,), axis_types=(AxisType.Auto,))


def dp_size(mesh: Mesh, axis: str = "data") -> int:
    """Size of ``axis`` in ``mesh`` (the data-parallel world size)."""
    if axis not in mesh.axis_names:
        raise ValueError(
            f"dp_size: the mesh has axes {mesh.axis_names}; expected one named {axis!r}. "
            "Fix: pass axis=<the mesh's data-parallel axis>."
        )
    return int(mesh.shape[axis])


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type ``Auto`` (same devices and names).

    jaxdp places its arrays itself and does its collectives by hand in ``shard_map``; with
    ``Explicit`` axes (jax's default for ``jax.make_mesh``) sharding-in-types would reject the
    reshapes between the flat sharded optimizer view and the parameter shapes.
    """
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def instance_axes(data_axis: str) -> tuple[str, str]:
    """The ``(outer, inner)`` axis names of a hierarchical mesh built from ``data_axis``."""
    return f"{data_axis}_outer", f"{data_axis}_inner"


def instance_mesh(
    mesh: Mesh, data_axis: str, instances: int, names: tuple[str, str] | None = None
) -> Mesh:
    """``mesh``'s data ranks as ``instances`` instances of consecutive devices: a 2-D mesh
    ``(data_axis + "_outer", data_axis + "_inner")`` (or ``names``) of shape ``(N, dp / N)``
    over the same devices in the same order, so rank ``o * (dp / N) + i`` is the device it
    was (one host's devices stay together: ``jax.devices()`` lists them process by process).

    Example:
        >>> import jax
        >>> m = instance_mesh(make_mesh(), "data", 2)
        >>> m.axis_names, m.shape["data_outer"] * m.shape["data_inner"] == jax.device_count()
        (('data_outer', 'data_inner'), True)
    """
    field = "num_distributed_optimizer_instances"
    if mesh.axis_names != (data_axis,):
        raise ValueError(
            f"DataParallel: {field}={instances} with a mesh of axes {mesh.axis_names}; "
            f"expected a 1-D mesh over {data_axis!r} (hierarchical data parallelism on a "
            "tensor-parallel or expert mesh is not implemented). Fix: pass jaxdp.make_mesh() "
            f"(or no mesh), or set {field}=1."
        )
    dp = int(mesh.shape[data_axis])
    if instances > dp or dp % instances:
        raise ValueError(
            f"DataParallel: {field}={instances} with {dp} data-parallel ranks; expected a "
            f"divisor of {dp} (each instance holds dp / N consecutive devices). Fix: use one "
            f"of {[n for n in range(1, dp + 1) if dp % n == 0]}, e.g. the number of nodes."
        )
    outer, inner = names or instance_axes(data_axis)
    devices = np.asarray(mesh.devices).reshape(instances, dp // instances)
    return Mesh(devices, (outer, inner), axis_types=(AxisType.Auto, AxisType.Auto))
