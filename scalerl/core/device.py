"""Which device a run computes on, and its mixed-precision contexts (autocast, fp16 loss scaling)."""

from __future__ import annotations

import contextlib
import os

import torch

from scalerl.core.errors import UserError

# A precision's name (trainer.precision, rollout.dtype) -> its torch dtype: the one table of them.
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST_DTYPES = {name: PRECISION_DTYPES[name] for name in ("bf16", "fp16")}


class DeviceError(UserError, RuntimeError):
    """The configured device is not there."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        cuda = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build of torch"
        raise DeviceError(f"trainer.device=cuda but no CUDA device is visible (torch {torch.__version__}, {cuda}, "
                          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); use "
                          "trainer.device=cpu or auto")
    return torch.device(name)


def compute_dtype(precision: str, param_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype matmuls run in: the autocast dtype for bf16/fp16, else the parameters' own."""
    return AUTOCAST_DTYPES.get(precision, param_dtype)


class Autocast:
    """Reusable autocast for ``precision`` (bf16/fp16 compute, fp32 parameters); a no-op for fp32.
    Autocast contexts are single-use, so a new one is made each time this is entered.

    Autocast casts each fp32 weight to the compute dtype once per outermost context and caches the copy
    until that context exits. Entered per micro-batch, every micro-batch pays the casts again (on a CPU a
    0.5B model's casts cost as much as its bf16 matmuls), so a pass over many micro-batches holds the casts
    (`holding_casts`) and runs what must stay fp32 (loss, backward) with autocast `paused`."""

    def __init__(self, precision: str, device: torch.device):
        self.precision, self.device = precision, device

    @property
    def enabled(self) -> bool:
        return self.precision in AUTOCAST_DTYPES

    def holding_casts(self) -> contextlib.AbstractContextManager:
        """An outer autocast whose cast weights live until it exits: wrap one pass (a forward-only pass, or
        one mini-batch's micro-batches, before the optimizer steps the weights)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=AUTOCAST_DTYPES[self.precision])

    def paused(self) -> contextlib.AbstractContextManager:
        """Autocast off inside `holding_casts` (fp32 loss and backward) without dropping its cast weights."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, enabled=False)

    def __enter__(self):
        if self.precision in AUTOCAST_DTYPES:
            self._ctx = torch.autocast(device_type=self.device.type, dtype=AUTOCAST_DTYPES[self.precision])
        else:
            self._ctx = contextlib.nullcontext()
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range and needs none."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None
