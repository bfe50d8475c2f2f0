"""Tensor parallelism with DTensor plans on the decoder (Megatron-style column/row split per block).

q/k/v and gate/up are split by output features (column-wise: each rank owns whole heads / a slice of the
MLP), o/down by input features (row-wise: partial sums all-reduced). The attention and MLP blocks take their
input as one replicated DTensor (`PrepareModuleInput`), so the partial input gradients of q, k and v (gate
and up) add up locally and are all-reduced once per block, as in Megatron: 2 backward all-reduces per layer
where a plan on the projections alone does 5. Attention reads its local head count from the weight shapes,
so the module code needs no TP special case. With untied embeddings, the embedding
is split by vocabulary and the output head by vocabulary with replicated logits; tied embeddings stay
replicated (one parameter cannot carry two shardings).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from scalerl.comm.counting.accounting import CommCounter
from scalerl.comm.counting.framework_collectives import count_tensor_parallel_style
from scalerl.models.decoder import decoder_layers


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, counter: CommCounter | None = None) -> None:
    """Apply the plan; with a ``counter``, each planned module's collectives are counted (kind ``tp``)."""

    def apply(module: nn.Module, plan: dict) -> None:
        parallelize_module(module, tp_mesh, plan)
        if counter is not None:
            for name, style in plan.items():
                count_tensor_parallel_style(module.get_submodule(name), style, counter, tp_mesh.size())

    if not model.config.tie_word_embeddings:
        plan = {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
        # A pipeline stage may hold neither (middle stages) or one of them.
        plan = {name: style for name, style in plan.items() if getattr(model, name, None) is not None}
        if plan:
            apply(model, plan)
    plan = {
        # (hidden states, cos, sin, mask, kv cache, cache start): only the first is a layout to prepare
        "self_attn": PrepareModuleInput(input_layouts=(Replicate(), None, None, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None, None, None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if model.config.traits.qk_norm:
        plan.update(QK_NORM_PLAN)
    for layer in decoder_layers(model):
        apply(layer, plan)


# q/k norms see only the rank's heads ([B, T, local heads, head_dim]): their weights are replicated DTensors
# taking the input as sharded by head, so the weights' partial gradients are all-reduced (transformers'
# "replicated_with_grad_allreduce"). SequenceParallel is that style; the heads dimension stands in for sequence.
QK_NORM_PLAN = {
    "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
    "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
}
