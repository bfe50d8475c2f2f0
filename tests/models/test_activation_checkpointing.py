"""Activation checkpointing recomputes each layer in backward: same gradients, less stored activation."""

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model


def test_checkpointing_gives_identical_gradients():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    grads = []
    for checkpointing in (False, True):
        model = build_model(cfg, seed=0).train()
        model.gradient_checkpointing = checkpointing
        model(ids, attention_mask=mask).float().logsumexp(-1).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)
