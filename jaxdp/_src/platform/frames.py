"""jaxdp's own stack frames are left out of the source locations JAX attaches to what it traces.

JAX gives every operation it lowers the Python stack that created it (the innermost frames that
are not JAX's own, up to ``jax_traceback_in_locations_limit``), and XLA carries that stack
through each pass as the instruction's location, into its metadata and profiles. Inside a
:class:`jaxdp.DataParallel` step the innermost frames are the engine's (``jaxdp/_src/``: the
strategy, the kernel, the reductions), so each of the model's operations carried a chain of
engine frames before the user's own, and the engine's operations a chain that named only
jaxdp. Registered as JAX's own (as flax registers its module machinery), those frames drop
out, and an operation's location starts at the user's code: the line of the model that made
it, or the line that called the step. The model code jaxdp ships (``jaxdp.models``,
``jaxdp.nn``) keeps its frames, as flax keeps ``flax.linen``'s layers.

It saves compile time, counted in instructions with callgrind on XLA:CPU and for compile-only
GPUs (BENCHMARKS.md section 7): XLA's importers had spent about twice plain ``jit``'s
instructions on locations (``GenerateInstructionLocation``), and dropping the engine's frames
cut a few percent of a jaxdp step's compile.

``JAXDP_SOURCE_FRAMES=1`` in the environment when jaxdp is imported keeps the engine's frames
(for debugging jaxdp itself).
"""

from __future__ import annotations

import os

__all__ = ["ENV", "exclude_engine_frames", "engine_prefix"]

#: The environment variable that keeps the engine's frames in source locations.
ENV = "JAXDP_SOURCE_FRAMES"


def engine_prefix() -> str:
    """The path prefix of jaxdp's engine modules and its ``__init__`` (``.../jaxdp/_``)."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(package, "_")


def exclude_engine_frames(environ: dict[str, str] | None = None) -> bool:
    """Register :func:`engine_prefix` with JAX as a path of its own (skipped where ``ENV`` is
    set to anything but ``0`` or empty, or where jax has no ``jax.extend.source_info_util``
    hook: locations are metadata, so jaxdp works the same without it); whether it did.

    Example:
        >>> exclude_engine_frames({ENV: "1"})
        False
    """
    env = os.environ if environ is None else environ
    if env.get(ENV, "0") not in ("", "0"):
        return False
    try:
        from jax.extend import source_info_util

        register = source_info_util.register_exclusion
    except (ImportError, AttributeError):  # pragma: no cover - a jax without the hook
        return False
    register(engine_prefix())
    return True
