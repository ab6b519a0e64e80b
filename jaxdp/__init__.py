"""jaxdp: Megatron-style data-parallel gradient machinery for JAX.

Bucketed gradient reduction, FP32 accumulation and ZeRO stages under ``jax.shard_map``.
"""

from ._src.platform.platform import prepare_jax as _prepare_jax

_prepare_jax()  # before anything imports jax: no CUDA noise on machines without a GPU

from ._src.platform.frames import exclude_engine_frames as _exclude_engine_frames

_exclude_engine_frames()  # operations' source locations start at the user's code

from ._src.comm.public import reduce_buckets as reduce_buckets
from ._src.comm.public import reduce_gradients as reduce_gradients
from ._src.comm.reduce import all_to_all_fp32_reduce_scatter as all_to_all_fp32_reduce_scatter
from ._src.comm.reduce import ring_reduce_scatter as ring_reduce_scatter
from ._src.config.config import AUTO_BUCKET_SIZE as AUTO_BUCKET_SIZE
from ._src.config.config import DDPConfig as DDPConfig
from ._src.config.config import default_bucket_size as default_bucket_size
from ._src.core.batching import microbatches as microbatches
from ._src.core.loss import LossOutput as LossOutput
from ._src.engine.checkpoint import CheckpointManager as CheckpointManager
from ._src.engine.checkpoint import CheckpointMismatchError as CheckpointMismatchError
from ._src.engine.engine import DataParallel as DataParallel
from ._src.engine.engine import TrainState as TrainState
from ._src.layout.layout import Bucket as Bucket
from ._src.layout.layout import BucketLayout as BucketLayout
from ._src.layout.layout import Buffer as Buffer
from ._src.layout.layout import ParamSlot as ParamSlot
from ._src.layout.layout import path_str as path_str
from ._src.layout.padding import bucket_end_divisor as bucket_end_divisor
from ._src.layout.padding import pad_bucket_end as pad_bucket_end
from ._src.layout.padding import pad_param_start as pad_param_start
from ._src.layout.padding import pad_to_divisor as pad_to_divisor
from ._src.platform.xla_flags import apply_xla_flags as apply_xla_flags
from ._src.platform.xla_flags import combine_thresholds as combine_thresholds
from ._src.platform.xla_flags import xla_compiler_options as xla_compiler_options
from ._src.platform.xla_flags import xla_flags as xla_flags
from ._src.topology.mesh import dp_size as dp_size
from ._src.topology.mesh import make_mesh as make_mesh
from ._src.zero3.scan_gather import find_scanned_axes as find_scanned_axes
from ._src.zero3.scan_gather import find_scanned_leaves as find_scanned_leaves
from ._src.zero3.scan_gather import gather_in_scans as gather_in_scans
from ._src.zero3.scan_gather import stacked_by_path as stacked_by_path

# isort: split
# The tools stand on the public names above (aot and testing import them from jaxdp).
from . import aot as aot
from . import nn as nn
from . import testing as testing

__version__ = "0.1.0"

__all__ = [
    "AUTO_BUCKET_SIZE",
    "Bucket",
    "CheckpointManager",
    "CheckpointMismatchError",
    "BucketLayout",
    "Buffer",
    "DDPConfig",
    "DataParallel",
    "LossOutput",
    "ParamSlot",
    "TrainState",
    "aot",
    "testing",
    "all_to_all_fp32_reduce_scatter",
    "apply_xla_flags",
    "combine_thresholds",
    "bucket_end_divisor",
    "default_bucket_size",
    "dp_size",
    "find_scanned_axes",
    "find_scanned_leaves",
    "gather_in_scans",
    "make_mesh",
    "microbatches",
    "nn",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
    "path_str",
    "reduce_buckets",
    "reduce_gradients",
    "ring_reduce_scatter",
    "stacked_by_path",
    "xla_compiler_options",
    "xla_flags",
]
