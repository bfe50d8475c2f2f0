"""Activation checkpointing (``model.activation_checkpointing=true``) as `parallelize` applies it: a
checkpoint hook on every decoder layer, on while training and off for generation; each layer's forward run
again in backward; fewer bytes saved for backward; the same gradients as without. In one process, then
under DDP and FSDP2 on 2 gloo ranks (one spawned group for both layouts).

Every check compares a run with checkpointing against the same run without it, so checkpointing that
silently did nothing (no hook, a hook left off, no recomputation) fails here: the saved bytes and the layer
forwards would equal the plain run's."""

from __future__ import annotations

import pytest
import torch

from tests.spawned_group import run_in_group
from tests.tiny import tiny_model

LAYERS = 4  # deep enough that the layers' activations dominate what the embedding and head save
MICROS, ROWS, SEQ = 2, 3, 16


def _hooks(model) -> list[bool | None]:
    """Per decoder layer: whether its checkpoint hook runs (None: no checkpoint applied)."""
    from torch.distributed._composable import checkpoint

    from scalerl.models.decoder import decoder_layers

    return [None if checkpoint.state(layer) is None else checkpoint.state(layer).enable_hook
            for layer in decoder_layers(model)]


def _micro_batches(rank: int):
    from scalerl.parallel.parallelize import MicroBatch

    ids = torch.randint(0, 64, (MICROS, ROWS, SEQ), generator=torch.Generator().manual_seed(10 + rank))
    mask = torch.ones_like(ids)
    mask[:, 0, :5] = 0  # a left-padded row: the recomputation must see the same attention mask
    return [MicroBatch(ids[i], mask[i], torch.zeros(ROWS)) for i in range(MICROS)]


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.float().logsumexp(-1).mean()


def _train_once(ctx, checkpointing: bool, rank: int = 0) -> dict:
    """One forward+backward of two micro-batches through `parallelize`'s parts: the hooks' state, the
    layer forwards run, the bytes autograd saved for backward outside any checkpoint, and the gradients."""
    from scalerl.models.decoder import decoder_layers
    from scalerl.parallel.parallelize import parallelize

    model = tiny_model(num_hidden_layers=LAYERS)
    parts = parallelize(model, ctx, activation_checkpointing=checkpointing)
    parts.train()
    hooks_training = _hooks(model)
    layer_forwards = [0]
    for layer in decoder_layers(model):
        # A pre-hook: the recomputation stops (early) inside the MLP once it has what backward needs.
        layer.mlp.register_forward_pre_hook(lambda *_: layer_forwards.__setitem__(0, layer_forwards[0] + 1))
    saved_bytes = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        # A checkpointed layer's own hooks take its tensors (innermost hooks win): only what is kept
        # outside a checkpoint reaches this one.
        saved_bytes[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parts.forward_backward(_micro_batches(rank), _loss)
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # FSDP2: this rank's shard
        grads[name] = grad.detach().clone()
    parts.eval()
    return {"hooks_training": hooks_training, "hooks_eval": _hooks(model), "layer_forwards": layer_forwards[0],
            "saved_bytes": saved_bytes[0], "grads": grads}


def _with_and_without(ctx, rank: int = 0) -> dict:
    return {checkpointing: _train_once(ctx, checkpointing, rank) for checkpointing in (False, True)}


def _both_layouts(rank: int) -> dict:
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims

    out = {}
    for name, dims in {"ddp": ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1),
                       "fsdp": ParallelDims(pp=1, dp_replicate=1, dp_shard=2, tp=1)}.items():
        mesh, dp_mesh = dims.build_mesh("cpu")
        out[name] = _with_and_without(DistContext(dims, mesh, dp_mesh, rank=rank), rank)
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    """``{layout: [rank's {checkpointing: run}]}``: one process, and each rank of DDP and FSDP2."""
    from scalerl.parallel.distributed import single_process_context

    ranks = run_in_group(_both_layouts, 2, timeout_s=300)
    return {"single": [_with_and_without(single_process_context())],
            **{name: [ranks[r][name] for r in range(2)] for name in ("ddp", "fsdp")}}


LAYOUTS = ["single", "ddp", "fsdp"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_hook_on_every_layer_while_training_only(runs, layout):
    for rank_runs in runs[layout]:
        assert rank_runs[False]["hooks_training"] == [None] * LAYERS  # off unless asked for
        assert rank_runs[True]["hooks_training"] == [True] * LAYERS
        assert rank_runs[True]["hooks_eval"] == [False] * LAYERS  # generation keeps no activations anyway


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layer_runs_again_in_backward(runs, layout):
    for rank_runs in runs[layout]:
        assert rank_runs[False]["layer_forwards"] == LAYERS * MICROS
        assert rank_runs[True]["layer_forwards"] == 2 * LAYERS * MICROS


@pytest.mark.parametrize("layout", LAYOUTS)
def test_less_is_saved_for_backward(runs, layout):
    for rank_runs in runs[layout]:
        plain, checkpointed = rank_runs[False]["saved_bytes"], rank_runs[True]["saved_bytes"]
        assert 0 < checkpointed < plain / 4, (checkpointed, plain)  # 4 layers: about 9x less here


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_gradients_as_without(runs, layout):
    for rank_runs in runs[layout]:
        plain, checkpointed = rank_runs[False]["grads"], rank_runs[True]["grads"]
        assert plain.keys() == checkpointed.keys()
        for name, grad in plain.items():
            assert grad.abs().max() > 0, name  # a zero gradient would make the comparison empty
            torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-8, msg=name)


def test_ddp_ranks_see_other_data_and_agree_on_gradients(runs):
    """The reductions ran: each rank's batch differs, its all-reduced gradients equal the other rank's."""
    rank0, rank1 = (r[True]["grads"] for r in runs["ddp"])
    for name in rank0:
        torch.testing.assert_close(rank0[name], rank1[name], rtol=1e-6, atol=1e-8, msg=name)
    assert not torch.equal(*(_micro_batches(r)[0].input_ids for r in (0, 1)))
