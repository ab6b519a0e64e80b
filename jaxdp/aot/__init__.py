"""Device-less (ahead-of-time) compilation for multi-GPU hosts, and schedule reports.

Compile a :class:`jaxdp.DataParallel` step for 8 compile-only GPUs on a machine without any
(needs the ``gpu-aot`` extra and ``JAX_PLATFORMS=cpu``) and see which collectives XLA overlaps
with compute::

    from jaxdp import DataParallel, DDPConfig
    from jaxdp import aot

    loss_fn, params, batch = aot.example_mlp(layers=8, width=512)
    config = DDPConfig(zero_stage=1, bucket_size=2 * 512 * 513, param_dtype="bfloat16")
    dp = DataParallel(loss_fn, optax.adamw(1e-3), config, mesh=aot.h100_mesh(8))
    report = aot.schedule_report(aot.compile_step(dp, params, batch))
    print(report)

``memory_report(compiled, dp)`` reads the same program's per-device memory against the ZeRO
formula and names the weights whose GEMM widths XLA pads.

Or from the shell: ``python -m jaxdp.aot --stage 1 --grad-reduce-in-fp32``.
"""

from ._compile import abstract_batch as abstract_batch
from ._compile import abstract_state as abstract_state
from ._compile import collective_roles as collective_roles
from ._compile import compile_step as compile_step
from ._compile import cross_compile_step as cross_compile_step
from ._compile import example_mlp as example_mlp
from ._compile import gradient_collectives as gradient_collectives
from ._memory import MemoryReport as MemoryReport
from ._memory import memory_report as memory_report
from ._memory import zero_formula_bytes as zero_formula_bytes
from ._report import Collective as Collective
from ._report import ScheduleReport as ScheduleReport
from ._report import schedule_report as schedule_report
from ._topology import TARGET_CONFIGS as TARGET_CONFIGS
from ._topology import h100_mesh as h100_mesh
from ._topology import h100_topology as h100_topology
from ._topology import target_config as target_config

__all__ = [
    "TARGET_CONFIGS",
    "Collective",
    "MemoryReport",
    "ScheduleReport",
    "abstract_batch",
    "abstract_state",
    "collective_roles",
    "compile_step",
    "cross_compile_step",
    "example_mlp",
    "gradient_collectives",
    "h100_mesh",
    "h100_topology",
    "memory_report",
    "schedule_report",
    "target_config",
    "zero_formula_bytes",
]
