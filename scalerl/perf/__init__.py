"""Performance arithmetic: FLOPs per token and device peaks (`flops`), MFU of a rank's share of a step
(`mfu`) and where the rest of the peak went (`mfu_waterfall`), step timers (`timing`), peak memory
(`memory`), and how each metric combines over ranks (`metrics`). The cost model built on them lives in `scalerl.bench.cost_model`."""

from scalerl.perf.flops import (
    decoder_param_count,
    device_peak_flops,
    flops_per_token,
    forward_flops_per_token,
    matmul_param_count,
    measure_matmul_flops,
)
from scalerl.perf.memory import max_memory_gb
from scalerl.perf.metrics import METRIC_REDUCTIONS, UndeclaredMetricError, reduction_of
from scalerl.perf.mfu import RankShare, StepWork, step_mfu
from scalerl.perf.mfu_waterfall import MfuWaterfall, run_waterfall, step_waterfall
from scalerl.perf.timing import StepTimer

__all__ = [
    "METRIC_REDUCTIONS", "MfuWaterfall", "RankShare", "StepTimer", "StepWork", "UndeclaredMetricError",
    "decoder_param_count", "device_peak_flops", "flops_per_token", "forward_flops_per_token", "matmul_param_count",
    "max_memory_gb", "measure_matmul_flops", "reduction_of", "run_waterfall", "step_mfu", "step_waterfall",
]
