"""Diagnosis of a run's performance: FLOPs model and utilization."""

from scalerl.diagnose.flops import (
    decoder_param_count,
    device_peak_flops,
    flops_per_token,
    forward_flops_per_token,
    matmul_param_count,
    measure_matmul_flops,
    mfu,
)

__all__ = [
    "decoder_param_count",
    "device_peak_flops",
    "flops_per_token",
    "forward_flops_per_token",
    "matmul_param_count",
    "measure_matmul_flops",
    "mfu",
]
