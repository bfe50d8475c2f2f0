"""Activation checkpointing: each decoder layer keeps only its input and recomputes its activations in
backward, trading about one extra forward for activation memory that no longer grows with depth.

Applied per layer with torch's composable `checkpoint` (it wraps the layer's forward in hooks, so parameter
names, state dicts and FSDP2 units are unchanged), before data parallelism as torchtitan does. The hooks
are switched off outside training (`set_activation_checkpointing`): generation and log-prob passes keep
no activations for backward anyway, and the hooks would cost an RNG-state copy per layer per decode step.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from scalerl.models.decoder import decoder_layers


def apply_activation_checkpointing(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        checkpoint(layer)


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn the checkpointing hooks of ``model``'s layers on or off (a no-op where none were applied)."""
    for layer in decoder_layers(model):
        state = checkpoint.state(layer)
        if state is not None:
            state.enable_hook = enabled
