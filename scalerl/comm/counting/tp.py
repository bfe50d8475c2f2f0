"""Counting tensor parallelism's collectives from the activations each parallel-style module sees.

DTensor issues TP's collectives inside its dispatch, where no hook reaches; they follow from the plan's
layouts and the activation shapes, which module hooks see (kind ``tp``, dimension ``tp``):

- ``RowwiseParallel`` with a replicated output: forward all-reduce of the output (partial sums);
- ``PrepareModuleInput`` turning a plain input into a replicated DTensor (the attention and MLP blocks):
  backward all-reduce of the input's gradient, once per block: the column-wise projections inside take
  that DTensor and leave their partial gradients to add up first (2 per decoder layer, as Megatron);
- ``ColwiseParallel`` with a replicated input given as a plain tensor: backward all-reduce of the input's
  gradient (each rank holds a partial one);
- ``ColwiseParallel`` with a replicated output (the vocabulary-split head): forward all-gather of it.

Counted when they happen: forward ones in the forward hook (also during generation and activation
recomputation, which repeat them), backward ones from a gradient hook on the module's output, so a
forward without backward counts none. Bytes use the real tensors (dtype included). Their time is not
measured (see `scalerl.comm.counting.accounting.TIMED_KINDS`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
)

from scalerl.comm.counting.accounting import CommCounter, tensor_bytes


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def count_tensor_parallel_style(module: nn.Module, style: ParallelStyle, counter: CommCounter, tp_size: int,
                                dim: str = "tp") -> None:
    """Register the counting hooks for ``module`` laid out with ``style`` (after `parallelize_module`,
    so these hooks see its inputs and outputs as the style leaves them)."""
    if tp_size <= 1:
        return
    replicated = lambda layouts: all(isinstance(p, Replicate) for p in layouts)  # noqa: E731
    forward_op = None
    if isinstance(style, RowwiseParallel) and replicated(style.output_layouts):
        forward_op = "all_reduce"
    elif isinstance(style, ColwiseParallel) and replicated(style.output_layouts):
        forward_op = "all_gather"
    prepares_input = isinstance(style, PrepareModuleInput) and isinstance(style.input_layouts[0], Replicate)
    backward_input_all_reduce = prepares_input or (isinstance(style, ColwiseParallel)
                                                   and replicated(style.input_layouts))

    arrived_as_dtensor = [False]

    def before_style(mod, args):  # runs before the style's own input conversion (prepended)
        arrived_as_dtensor[0] = isinstance(_first_tensor(args), DTensor)

    def after_forward(mod, args, output):
        out, inp = _first_tensor(output), _first_tensor(args)
        if out is None:
            return
        if forward_op is not None:
            counter.record("tp", forward_op, tensor_bytes(out), tp_size, dim=dim)
        # A column-wise projection handed a DTensor (prepared by its block) reduces nothing itself.
        own_reduce = not arrived_as_dtensor[0]
        if backward_input_all_reduce and own_reduce and inp is not None and inp.requires_grad \
                and out.requires_grad and torch.is_grad_enabled():
            size = tensor_bytes(inp)

            def on_output_grad(grad):
                counter.record("tp", "all_reduce", size, tp_size, dim=dim)

            out.register_hook(on_output_grad)

    module.register_forward_pre_hook(before_style, prepend=True)
    module.register_forward_hook(after_forward)
