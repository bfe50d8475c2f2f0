"""Pipeline parallelism: stages cut from the model's layer list, run by `torch.distributed.pipelining`.

Each pipeline rank trains only its stage(s) (GPipe, 1F1B, or interleaved 1F1B with two virtual stages per
rank). Generation, evaluation and the old/reference log-prob passes run on a full replica of the model
kept on every rank and refreshed from the stages after each optimizer step ("gathered full weights"): the
decode loop then needs no pipeline bubbles, at the cost of one model copy per rank and a broadcast of every
stage's weights per step (counted in ``comm/weight_sync_bytes``). The pipeline ranks generate 1/pp of the
rows each and exchange them (`scalerl.rollout.sources.ColocatedRollouts`).

Tied embeddings: the first stage's embedding and the last stage's head are copies of one tensor; their
gradients are summed over the pipeline group each step (as Megatron does), so the copies stay equal.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor

from scalerl.comm.counting.accounting import CommCounter, sharded_over, tensor_bytes
from scalerl.models.decoder import CausalLM
from scalerl.parallel.distributed import DistContext

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


class CountedPipelineStage(PipelineStage):
    """A `PipelineStage` that counts what it sends (kind ``pp``): activations to the next stage in forward,
    input gradients to the previous one in backward, one point-to-point send per tensor and micro-batch.
    The schedules wait for these sends inside torch, so their time is not measured; the shape-inference
    messages of the first step are not counted."""

    def __init__(self, *args, counter: CommCounter, **kwargs):
        super().__init__(*args, **kwargs)
        self.counter = counter

    def _count(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        for op in ops:
            self.counter.record("pp", "send", tensor_bytes(op.tensor), 2, dim="pp")
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_fwd_send_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count(super().get_bwd_send_ops(bwd_chunk_id))


def stage_layer_ids(num_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous, equal runs of layer indices, one per stage."""
    if num_layers % num_stages:
        raise ValueError(f"{num_layers} layers do not split into {num_stages} pipeline stages")
    per = num_layers // num_stages
    return [list(range(s * per, (s + 1) * per)) for s in range(num_stages)]


class DecoderStage(CausalLM):
    """A slice of a ``CausalLM``: the model with the modules this stage does not hold removed, so it runs the
    model's own forward (one forward: no copy of it to drift). Its layers ``layer_ids`` keep their original
    names (parameter names match the full model); the embedding only on the first stage, norm + head only on
    the last.

    ``forward(x, attention_mask)``: ``x`` is token ids on the first stage, hidden states after; non-last
    stages return ``(hidden, attention_mask)`` so the mask travels down the pipeline with its micro-batch.
    """

    def __init__(self, model: CausalLM, layer_ids: list[int], first: bool, last: bool, autocast=None):
        nn.Module.__init__(self)  # not CausalLM's: the parts come from ``model``, not from its config
        self.config = model.config
        self.embed_tokens = copy.deepcopy(model.embed_tokens) if first else None
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(model.layers[i]) for i in layer_ids})
        self.norm = copy.deepcopy(model.norm) if last else None
        self.lm_head = copy.deepcopy(model.lm_head) if last else None
        self.rotary, self.local_rotary = model.rotary, model.local_rotary
        # The schedule runs forward and backward itself: autocast is entered around the forward only.
        self.autocast = autocast or contextlib.nullcontext()

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor):
        with self.autocast:
            out = super().forward(x, attention_mask=(attention_mask > 0).long())
        return out if self.lm_head is not None else (out, attention_mask)


class PipelineRunner:
    """This rank's stages, their schedule, and the replica they refresh after each optimizer step."""

    def __init__(
        self,
        model: CausalLM,
        ctx: DistContext,
        schedule: str,
        microbatches: int,
        layout_stage: Callable[[nn.Module], None],
        autocast=None,
    ):
        self.ctx, self.replica = ctx, model
        pp_mesh = ctx.mesh["pp"]
        self.pp_group, pp_rank, pp = pp_mesh.get_group(), pp_mesh.get_local_rank(), pp_mesh.size()
        virtual = 2 if schedule == "interleaved_1f1b" else 1
        self.num_stages = pp * virtual
        layer_ids = stage_layer_ids(model.config.num_hidden_layers, self.num_stages)
        # Stage s lives on pipeline rank s % pp (the looped order interleaved schedules expect).
        self.stage_ids = [pp_rank + v * pp for v in range(virtual)]
        self.modules = []
        stages = []
        for s in self.stage_ids:
            module = DecoderStage(model, layer_ids[s], first=s == 0, last=s == self.num_stages - 1, autocast=autocast)
            layout_stage(module)
            self.modules.append(module)
            stages.append(CountedPipelineStage(module, s, self.num_stages, ctx.device, group=self.pp_group,
                                               counter=ctx.comm))
        self.owner = {s: s % pp for s in range(self.num_stages)}
        self.layer_ids = layer_ids
        self.tied = model.config.tie_word_embeddings
        self.has_last = self.num_stages - 1 in self.stage_ids
        # The schedule takes its loss function once; `step` sets the one this mini-batch uses. Micro-batch
        # losses are normalised by the whole mini-batch's token count already: no 1/M scaling.
        self.loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        cls = SCHEDULES[schedule]
        self.schedule = cls(stages if virtual > 1 else stages[0], microbatches, loss_fn=self._loss, scale_grads=False)
        self.pp_rank = pp_rank
        self.microbatches = microbatches

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters()]

    def norm_parameters(self) -> list[nn.Parameter]:
        """Parameters counted in the gradient norm: a tied head is the embedding's copy, counted once."""
        return [p for m in self.modules for n, p in m.named_parameters() if not (self.tied and n == "lm_head.weight")]

    def train(self) -> None:
        for m in self.modules:
            m.train()

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target)

    def step(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, target: torch.Tensor,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Forward + backward of one mini-batch through the pipeline (gradients accumulate in the stages);
        the last stage calls ``loss_fn(logits, target)`` per micro-batch."""
        self.loss_fn = loss_fn
        first = 0 in self.stage_ids
        args = (input_ids, attention_mask.float()) if first else ()
        self.schedule.step(*args, target=target if self.has_last else None)

    def sync_tied_gradients(self) -> None:
        if not self.tied:
            return
        pieces = []
        for m in self.modules:
            for piece in (m.embed_tokens, m.lm_head):
                if piece is not None and piece.weight.grad is not None:
                    pieces.append(piece.weight.grad)
        shape_source = self.replica.embed_tokens.weight
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        total = torch.zeros_like(local(pieces[0])) if pieces else torch.zeros_like(shape_source)
        for g in pieces:
            total += local(g)
        with self.ctx.comm.collective("grad", "all_reduce", total, self.pp_group, dim="pp"):
            dist.all_reduce(total, group=self.pp_group)
        for g in pieces:
            local(g).copy_(total)

    def stage_of(self, name: str) -> int:
        if name.startswith("embed_tokens."):
            return 0
        if name.startswith(("norm.", "lm_head.")):
            return self.num_stages - 1
        layer = int(name.split(".")[1])
        return next(s for s, ids in enumerate(self.layer_ids) if layer in ids)

    @torch.no_grad()
    def refresh_replica(self) -> int:
        """Copy every stage's weights into the full replica on all pipeline ranks; returns bytes received.
        Counted as ``weight_sync``: the all-gathers of data-parallel shards and the broadcasts."""
        own, comm = {}, self.ctx.comm
        for m in self.modules:
            for n, p in m.named_parameters():
                if isinstance(p, DTensor) and _is_dp_sharded(p):
                    # full_tensor() all-gathers over the sharded mesh dims (one dim in supported layouts)
                    full = p.full_tensor()
                    comm.record("weight_sync", "all_gather", tensor_bytes(full), sharded_over(p), dim="dp_shard")
                    own[n] = full
                else:
                    own[n] = p
        received = 0
        pp_ranks = dist.get_process_group_ranks(self.pp_group)
        for name, target in self.replica.named_parameters():
            stage = self.stage_of(name)
            dest = target.to_local() if isinstance(target, DTensor) else target
            if stage in self.stage_ids:
                src = own[name]
                dest.copy_(src.to_local() if isinstance(src, DTensor) else src)
            else:
                received += dest.numel() * dest.element_size()
            buf = dest.contiguous()
            src = pp_ranks[self.owner[stage]]
            with comm.collective("weight_sync", "broadcast", buf, self.pp_group, dim="pp", src=src):
                dist.broadcast(buf, src=src, group=self.pp_group)
            if buf.data_ptr() != dest.data_ptr():
                dest.copy_(buf)
        return received


def _is_dp_sharded(p: DTensor) -> bool:
    names = p.device_mesh.mesh_dim_names or ()
    return any(not pl.is_replicate() and n.startswith("dp") for n, pl in zip(names, p.placements))
