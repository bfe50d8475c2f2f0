"""Host<->device copy bandwidth of this rank's GPU: pinned host memory, one direction at a time, timed with
CUDA events. On a CPU-only rank there is no such link and nothing is measured."""

from __future__ import annotations

from typing import Any

import torch

COPY_REPEATS = 5


def measure_host_device_copy(device: torch.device, size: int) -> dict[str, Any] | None:
    """``{h2d_bytes_per_s, d2h_bytes_per_s, size}`` (best of a few copies), or None without a GPU."""
    if device.type != "cuda":
        return None
    size = min(size, 256 * 2**20)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    out = {"size": size}
    for name, dst, src in (("h2d_bytes_per_s", dev, host), ("d2h_bytes_per_s", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        best = float("inf")
        for _ in range(COPY_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        out[name] = size / best
    return out
