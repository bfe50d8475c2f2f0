"""Forward-only passes over a rollout batch: log-probs of the responses (old policy, reference policy) and
the critic's values, micro-batched, with all-padding columns trimmed away (or, with a ``packed_kernel``,
each micro-batch packed into one row of real tokens, `scalerl.models.packing`). Under FSDP each unit is gathered
once for the whole pass rather than once per micro-batch (`gathered_once`, as generation does)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from scalerl.algorithms.distillation import teacher_token_outputs
from scalerl.algorithms.entropy import logprobs_from_logits
from scalerl.models.decoder import CausalLM
from scalerl.models.packing import choose_packed_kernel, packed_batch_or_none, response_layout
from scalerl.models.routing_replay import replaying_routes, replays_routes
from scalerl.parallel.distributed import DistContext
from scalerl.parallel.fsdp_generation import gathered_once
from scalerl.parallel.sequence_parallel import SequenceShards, splits_sequences
from scalerl.rollout.batch import RolloutBatch
from scalerl.trainer.run_directory import say
from scalerl.trainer.update import micro_batches


def packed_kernel_for(model: nn.Module, use_remove_padding: bool, ctx: DistContext) -> str | None:
    """``actor.use_remove_padding``: the packed-row attention kernel for this device, said once at start
    (None when off). Only the built-in decoder takes packed rows."""
    if not use_remove_padding:
        return None
    if not isinstance(model, CausalLM):
        raise ValueError(f"actor.use_remove_padding=true needs the built-in decoder (model.implementation="
                         f"scalerl); this model is {type(model).__name__}")
    if ctx.dims.pp > 1:
        raise ValueError("actor.use_remove_padding=true does not apply with parallel.pp > 1 (stages fix shapes)")
    kernel = choose_packed_kernel(ctx.device)
    # flash-attention's varlen kernel takes fp16/bf16 only: in fp32 its layers run SDPA per sequence.
    note = " (fp16/bf16 compute; fp32 runs sdpa_per_sequence)" if kernel == "flash_varlen" else ""
    say(ctx, f"sequence packing: micro-batches packed into rows of real tokens, attention kernel {kernel}{note}")
    return kernel


@torch.no_grad()
def response_logprobs(
    model: nn.Module, batch: RolloutBatch, temperature: float, micro_batch_size: int, autocast=None,
    packed_kernel: str | None = None,
) -> torch.Tensor:
    """Per-token log-probs ``[B, R]`` of the batch's responses under ``model`` at the sampling temperature
    (zero on padding). A model marked for routing replay (`enable_router_replay`: actor.router_replay, the
    policy and its copies, not a teacher) routes by the batch's recorded experts where it has them."""

    def logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if temperature not in (0.0, 1.0):
            logits = logits / temperature
        return logprobs_from_logits(logits, labels)

    replay = batch.routed_experts is not None and replays_routes(model)
    return _per_response_token(model, batch, micro_batch_size, autocast, logprobs, packed_kernel, replay)


@torch.no_grad()
def teacher_outputs(model: nn.Module, batch: RolloutBatch, temperature: float, micro_batch_size: int, top_k: int,
                    autocast=None, packed_kernel: str | None = None) -> torch.Tensor:
    """A distillation teacher's pass: ``[B, R]`` log-probs of the sampled tokens (`response_logprobs`), or with
    ``top_k`` ``[B, R, 1 + 2k]``: those, then its k likeliest ids and their log-probs (`teacher_token_outputs`).
    Under sequence parallelism each rank takes the top-k of its own positions (each holds the whole vocabulary
    there) and only the ``[B, m, 1 + 2k]`` results are gathered (`SequenceShards.per_token`)."""
    if not top_k:
        return response_logprobs(model, batch, temperature, micro_batch_size, autocast, packed_kernel)

    def outputs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return teacher_token_outputs(logits / temperature if temperature not in (0.0, 1.0) else logits, labels, top_k)

    return _per_response_token(model, batch, micro_batch_size, autocast, outputs, packed_kernel)


@torch.no_grad()
def response_values(critic: nn.Module, batch: RolloutBatch, micro_batch_size: int, autocast=None,
                    packed_kernel: str | None = None) -> torch.Tensor:
    """The critic's values ``[B, R]`` at the positions before each response token (zero on padding)."""
    return _per_response_token(critic, batch, micro_batch_size, autocast, lambda values, labels: values,
                               packed_kernel)


def _per_response_token(model: nn.Module, batch: RolloutBatch, micro_batch_size: int, autocast, per_token,
                        packed_kernel: str | None = None, replay: bool = False) -> torch.Tensor:
    """``per_token(output, labels)`` over the model's fp32 outputs at the positions before each response token
    and the response ids, micro-batch by micro-batch (all-padding columns trimmed), masked and padded back to
    ``[B, R]``. Packed, the model returns only the predictions of the masked response tokens ``[M, ...]``, so
    ``per_token`` (a log-softmax over the vocabulary) runs on those and its ``[M]`` results are put in place.
    Under sequence parallelism the policy returns this rank's shard of the logits (`SequenceShards`):
    ``per_token`` runs there and only its results are gathered. ``replay``: forwards route by the batch's
    recorded experts (`replaying_routes`)."""
    if replay and packed_kernel is not None:
        raise ValueError("actor.router_replay=true does not apply to packed rows (actor.use_remove_padding=true)")
    out = []
    # Plain weights are cast to the compute dtype once for the pass (`Autocast.holding_casts`), not per
    # micro-batch; FSDP2/TP parameters are left to autocast's per-forward casts.
    holds = autocast is not None and not any(isinstance(p, DTensor) for p in model.parameters())
    with gathered_once(model), autocast.holding_casts() if holds else contextlib.nullcontext():
        for micro in micro_batches(batch, micro_batch_size):
            micro, _, right = micro.trimmed()
            response_len = micro.response_ids.shape[1]
            marked = micro.response_mask > 0
            packed_outputs = packed_kernel is not None and not splits_sequences(model)  # sp unpacks its shards
            input_ids, attention_mask = packed_batch_or_none(micro.input_ids, micro.attention_mask, packed_kernel,
                                                             marked if packed_outputs else None)
            with autocast or contextlib.nullcontext(), replaying_routes(model, micro.routed_experts if replay else None):
                output = model(input_ids, attention_mask=attention_mask, logits_to_keep=response_len + 1)
            with autocast.paused() if holds else contextlib.nullcontext():  # fp32 log-softmax
                if isinstance(output, SequenceShards):  # the last kept position predicts nothing: label 0
                    values = output.per_token(per_token, F.pad(micro.response_ids, (0, 1)))[:, :-1]
                elif not packed_outputs:
                    values = per_token(output[:, :-1].float(), micro.response_ids)
                else:
                    values = response_layout(per_token(output[0].float(), micro.response_ids[marked]), marked)
                mask = micro.response_mask.view(*micro.response_mask.shape, *(1,) * (values.dim() - 2))
                out.append(F.pad(values * mask, (0, 0) * (values.dim() - 2) + (0, right)))  # [B, R, ...]: pad R
    return torch.cat(out)
