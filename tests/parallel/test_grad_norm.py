"""The gradient norm the trainer clips by (`scalerl.parallel.grad_norm`): the value torch gives, and no
temporary of a gradient's size (the update's peak memory, which `scalerl plan` predicts, would hold it)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from scalerl.parallel.grad_norm import total_grad_norm


class _LargestOutput(TorchDispatchMode):
    """The largest new tensor any op under it returns, in bytes (a view of an input, as ``detach`` gives, is
    not new)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        sizes = [t.untyped_storage().nbytes() for t in tree_leaves(out)
                 if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs]
        self.largest = max([self.largest, *sizes])
        return out


def test_the_norm_is_torchs_and_makes_no_gradient_sized_temporary():
    grads = [torch.randn(256, 512, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    grads.append(torch.randn(512, dtype=torch.bfloat16))
    expected = torch.nn.utils.get_total_norm([g.float() for g in grads])
    with _LargestOutput() as ops:
        norm = total_grad_norm(grads)
    assert torch.allclose(norm, expected, rtol=1e-5)
    # squaring a gradient before summing it (``pow(2)``) made a copy of it: 512 KiB each here
    assert ops.largest < 1024, ops.largest
