"""The built-in rollout engine: batched prefill, then a decode loop over a preallocated KV cache.

Each decode step runs one forward for the rows still decoding and two copies into preallocated outputs;
nothing in the loop iterates over sequences. Every few steps the engine reads which rows have emitted a
stop token; once enough of them have, it compacts the batch (tokens, positions, key mask, random draws and
KV cache gathered into fewer rows), so finished rows stop costing decode work: a batch whose responses
stop at very different lengths costs about its total tokens, not rows x longest. A row's random draws are
tied to its global row (``SamplingParams.row_offset``), so its sample never depends on which other rows
are still decoding. Which tokens count is worked out once after the loop, from each row's first stop token.
With ``record_routes`` (actor.router_replay) a MoE model's routed experts are recorded as they are computed:
the prompt's at prefill, each fed token's at its decode step, written to the row's place in the caller's
batch (`GenerationOutput.routed_experts`, `scalerl.models.routing_replay`).

With ``max_num_seqs`` set, a batch larger than that goes through continuous batching instead
(`scalerl.rollout.engines.continuous`: a finished row's slot is refilled from the rest), with the same
outputs; ``continuous_engine()`` hands out such an engine for a stream of requests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch.distributed.fsdp import FSDPModule

from scalerl.models.decode_model import DecodeModel, fused_decode_unsupported
from scalerl.models.decoder import CausalLM
from scalerl.models.kv_cache import KVCache
from scalerl.models.routing_replay import (
    NO_ROUTE,
    ROUTE_DTYPE,
    RouteRecorder,
    route_shape,
)
from scalerl.parallel.fsdp_generation import gathered_once
from scalerl.rollout.engines.continuous import (  # the finish-check intervals: one definition, both engines
    FINISH_CHECK_EVERY_CPU,
    FINISH_CHECK_EVERY_GPU,
    ContinuousEngine,
    GenerationRequest,
    decodes_in_lockstep,
)
from scalerl.rollout.engines.engine import (
    GenerationOutput,
    PromptTooLongError,
    SamplingParams,
    left_pad,
)
from scalerl.rollout.engines.sampling import sample_tokens

# (logits [n, V] of the decoding rows, their rows in the caller's batch [n], decode step) -> logits; through
# continuous batching the step is a tensor [n], each row's token index (rows start at different steps).
LogitsProcessor = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]



@dataclass
class DecodingRows:
    """The per-row state of the rows still decoding; ``select`` compacts all of it at once."""

    index: torch.Tensor  # [n] each row's index in the caller's batch (where its outputs go)
    positions: torch.Tensor  # [n, 1] RoPE position of the row's newest token
    key_mask: torch.Tensor  # [n, prompt + max_new] real (non-padding) key positions
    uniforms: torch.Tensor | None  # [max_new, n] the row's pre-drawn sampling uniforms (seeded sampling)
    unfinished: torch.Tensor  # [n] no stop token seen yet (as of the last check)

    @classmethod
    def start(cls, prompt_mask: torch.Tensor, total_len: int, uniforms: torch.Tensor | None) -> DecodingRows:
        """Every row of a left-padded prompt batch, about to decode its first token."""
        batch, prompt_len = prompt_mask.shape
        key_mask = torch.ones(batch, total_len, dtype=torch.bool, device=prompt_mask.device)
        key_mask[:, :prompt_len] = prompt_mask.bool()
        return cls(
            index=torch.arange(batch, device=prompt_mask.device),
            positions=prompt_mask.sum(-1, keepdim=True) - 1,  # position of each prompt's last token
            key_mask=key_mask,
            uniforms=uniforms,
            unfinished=torch.ones(batch, dtype=torch.bool, device=prompt_mask.device),
        )

    def __len__(self) -> int:
        return self.index.numel()

    def select(self, keep: torch.Tensor) -> DecodingRows:
        return DecodingRows(
            self.index[keep], self.positions[keep], self.key_mask[keep],
            None if self.uniforms is None else self.uniforms[:, keep], self.unfinished[keep],
        )


class BuiltinEngine:
    """Generates with a ``CausalLM`` it shares with the trainer (colocated: weight sync is free)."""

    # Capabilities the trainer reads instead of asking for the class:
    logprobs_match_training_forward = True  # per engine: `logprobs_match_forward` (tested)
    shares_trainer_weights = True  # it generates with the trained parameters themselves

    def __init__(
        self,
        model: CausalLM,
        pad_token_id: int,
        finish_check_every: int | None = None,
        all_finished: Callable[[bool], bool] | None = None,
        compact_at: float | None = 0.125,
        logits_processor: LogitsProcessor | None = None,
        max_num_seqs: int = 0,
        dtype: torch.dtype | None = None,
        fused: bool = True,
        record_routes: bool = False,
    ):
        self.model = model
        # Record each token's routed experts in every sparse MoE layer (`GenerationOutput.routed_experts`, for
        # actor.router_replay); fixed batches only. Off: no hook, no cost.
        self.record_routes = record_routes
        # Generation's compute dtype on the fused path (None: the parameters'); bf16 over fp32 parameters
        # computes as a bf16 autocast forward does, from bf16 copies laid out once per weight sync
        # (`DecodeModel`). ``fused=False`` decodes with the model's own forward (the reference the tests use).
        self.dtype = dtype
        self.fused = fused and fused_decode_unsupported(model) is None
        self.decode_model: DecodeModel | None = None
        # ``dtype`` is the training forward's compute dtype (the trainer passes its precision's); the
        # log-probs stand in for that forward's where `logprobs_match_forward` says the recipes are one.
        self.logprobs_match_training_forward = logprobs_match_forward(
            model, self.dtype or model.embed_tokens.weight.dtype, self.compute_dtype, self.fused, max_num_seqs)
        self.pad_token_id = pad_token_id
        # With sharded or tensor-parallel weights every forward is a collective, so the ranks agree on when
        # to stop (`DistContext.all_finished`); alone, a rank decides for itself.
        self.all_finished = all_finished or (lambda flag: flag)
        # "Which rows finished?" reads from the device and scans the tokens since the last check; every few
        # steps is enough (at most that many wasted steps per row) and on a GPU avoids a sync per token.
        self.finish_check_every = finish_check_every
        # Compact once this fraction of the decoding rows has finished (None: never). A compaction copies the
        # kept rows' KV cache, about one step's worth of cache reads; see benchmarks/generation.py.
        self.compact_at = compact_at
        # Adjusts each step's logits before sampling (e.g. the benchmark forcing stop lengths); the
        # returned logits are also those the log-probs are taken from.
        self.logits_processor = logits_processor
        # Rows decoding at once (`rollout.max_num_seqs`): a larger batch goes through continuous batching, a
        # finished row's slot refilled from the rest at once (`continuous_engine`); 0: one fixed batch.
        self.max_num_seqs = max_num_seqs

    @property
    def compute_dtype(self) -> torch.dtype:
        """What decoding computes in: ``dtype`` on the fused path, else the parameters' own (the model's
        forward, unchanged: sharded, pipeline-cut and unfused architectures)."""
        return (self.dtype if self.fused else None) or self.model.embed_tokens.weight.dtype

    def refresh_weights(self) -> int:
        """Lay the model's current weights out for decoding (after an optimizer step or weight load);
        returns the bytes written (0 where the model's own forward decodes)."""
        if not self.fused:
            return 0
        if self.decode_model is None:
            self.decode_model = DecodeModel(self.model, self.compute_dtype)
            return self.decode_model.weight_bytes
        return self.decode_model.refresh()

    def _forward(self, sharded: bool) -> Callable[..., torch.Tensor]:
        """The forward generation calls: the fused one over up-to-date weights, else the model's own."""
        if not self.fused or sharded:
            return self.model
        if self.decode_model is None or self.decode_model.is_stale():
            self.refresh_weights()  # a weight write no sync announced (a test, a direct load)
        return self.decode_model

    # The receiving interface of weight sync (scalerl/rollout/engines/weight_loading.py).
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy whole tensors into the model's parameters by name (converting dtype); returns bytes given."""
        params = dict(self.model.named_parameters())
        copied = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"the built-in engine's model has no parameter {name!r}")
                if params[name].data_ptr() != tensor.data_ptr():
                    params[name].copy_(tensor)
                copied += tensor.numel() * tensor.element_size()
        return copied

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The model's parameters, detached (same storage): weight sync decodes buckets into them in place."""
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        # inference_mode is ~15% faster here than no_grad (no version counters or view tracking), but FSDP2
        # keeps all-gather buffers across calls, and buffers created as inference tensors cannot be written
        # by a later training forward: sharded models decode under no_grad.
        sharded = any(isinstance(m, FSDPModule) for m in self.model.modules())
        # Sharded or tensor-parallel forwards are collectives, so ranks decode in lockstep: one fixed batch.
        if 0 < self.max_num_seqs < len(prompts) and not decodes_in_lockstep(self.model):
            if self.record_routes:
                raise ValueError("recording routed experts (actor.router_replay=true) covers the fixed batch only; "
                                 "continuous batching (rollout.max_num_seqs > 0) does not record them: set "
                                 "rollout.max_num_seqs=0")
            return self._generate_continuous(prompts, sampling)
        with torch.no_grad() if sharded else torch.inference_mode(), gathered_once(self.model):
            return self._generate(prompts, sampling, self._forward(sharded))

    def continuous_engine(self, max_prompt_len: int, max_new_tokens: int, max_num_seqs: int | None = None):
        """A continuous-batching engine on this engine's model and settings (``max_num_seqs`` rows, by default
        this engine's), for prompts up to ``max_prompt_len`` tokens and responses up to ``max_new_tokens``."""
        fused = self._forward(sharded=False)  # the fused path where the fixed batch takes it
        return ContinuousEngine(
            self.model, self.pad_token_id, max_num_seqs or self.max_num_seqs, max_prompt_len, max_new_tokens,
            finish_check_every=self.finish_check_every, compact_at=self.compact_at,
            logits_processor=self.logits_processor, decode_model=fused if fused is not self.model else None)

    def _generate_continuous(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        """``generate`` through continuous batching: row ``i`` is request ``i`` with the draws of global row
        ``row_offset + i``, so outputs equal the fixed batch's; reassembled in prompt order."""
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        engine = self.continuous_engine(prompt_ids.shape[1], sampling.max_new_tokens)
        _, uniforms = _random_draws(sampling, len(prompts), engine.device)
        requests = [GenerationRequest(i, p, sampling, None if uniforms is None else uniforms[:, i])
                    for i, p in enumerate(prompts)]
        outputs = sorted(engine.generate_stream(requests), key=lambda o: o.request_id)
        width = max(o.token_ids.numel() for o in outputs)
        response_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        logprobs = torch.zeros((len(prompts), width), dtype=torch.float32)
        for i, o in enumerate(outputs):
            n = o.token_ids.numel()
            response_ids[i, :n], response_mask[i, :n], logprobs[i, :n] = o.token_ids, 1, o.logprobs
        device = engine.device
        return GenerationOutput(prompt_ids.to(device), prompt_mask.to(device), response_ids.to(device),
                                response_mask.to(device), logprobs.to(device), [o.finish_reason for o in outputs])

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                  forward: Callable[..., torch.Tensor]) -> GenerationOutput:
        model = self.model
        device = model.embed_tokens.weight.device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        batch, prompt_len = prompt_ids.shape
        max_new = sampling.max_new_tokens
        total_len = prompt_len + max_new
        if total_len > model.config.max_position_embeddings:
            raise PromptTooLongError(
                f"prompt length {prompt_len} + max_new_tokens {max_new} = {total_len} tokens exceeds the model's "
                f"max_position_embeddings ({model.config.max_position_embeddings}); shorten the prompt or generate "
                "fewer tokens"
            )
        generator, uniforms = _random_draws(sampling, batch, device)
        stop_ids = torch.as_tensor(list(sampling.stop_token_ids), dtype=torch.long, device=device)
        check_every = self.finish_check_every or (FINISH_CHECK_EVERY_CPU if device.type == "cpu" else FINISH_CHECK_EVERY_GPU)

        cache = KVCache.for_model(model, batch, total_len)
        rows = DecodingRows.start(prompt_mask, total_len, uniforms)
        # Rows that leave the batch keep these fillers; they lie after the row's stop token, so `_finish` masks them.
        tokens_out = torch.full((batch, max_new), self.pad_token_id, dtype=torch.long, device=device)
        logprobs_out = torch.zeros((batch, max_new), dtype=torch.float32, device=device)

        routes = None
        if self.record_routes:  # [B, P + max_new, L, k]: prompt at prefill, each fed response token at its step
            layers, top_k = route_shape(model)
            if not layers:
                raise ValueError("record_routes (actor.router_replay=true) needs a model with sparse MoE layers")
            routes = torch.full((batch, total_len, layers, top_k), NO_ROUTE, dtype=ROUTE_DTYPE, device=device)
        with RouteRecorder(model) if routes is not None else contextlib.nullcontext() as recorder:
            logits = forward(prompt_ids, attention_mask=prompt_mask, kv_cache=cache, cache_start=0, logits_to_keep=1)
            if recorder is not None:
                prompt_routes = recorder.take().reshape(batch, prompt_len, *routes.shape[2:])
                routes[:, :prompt_len] = prompt_routes.masked_fill(~prompt_mask.bool()[:, :, None, None], NO_ROUTE)
            steps = self._decode(forward, logits, rows, cache, sampling, generator, tokens_out, logprobs_out,
                                 stop_ids, check_every, prompt_len, recorder, routes)
        return self._finish(prompt_ids, prompt_mask, tokens_out[:, :steps], logprobs_out[:, :steps], stop_ids, routes)

    def _decode(self, forward, logits, rows: DecodingRows, cache, sampling, generator, tokens_out, logprobs_out,
                stop_ids, check_every: int, prompt_len: int, recorder: RouteRecorder | None,
                routes: torch.Tensor | None) -> int:
        """The decode loop from the prefill's ``logits``; returns the steps taken. With a ``recorder``, each fed
        token's routes go to ``routes[row, prompt_len + t]`` of its row in the caller's batch."""
        max_new = sampling.max_new_tokens
        steps, checked = max_new, 0
        for t in range(max_new):
            tokens = self._sample(logits[:, -1], rows, t, sampling, generator, tokens_out, logprobs_out)
            if t + 1 == max_new:
                break
            if stop_ids.numel() and (t + 1) % check_every == 0:
                rows.unfinished &= ~torch.isin(tokens_out[rows.index, checked : t + 1], stop_ids).any(-1)
                checked = t + 1
                unfinished = int(rows.unfinished.sum())
                if self.all_finished(unfinished == 0):
                    steps = t + 1
                    break
                if self._should_compact(len(rows), unfinished):
                    keep = _rows_to_keep(rows.unfinished, unfinished)
                    rows, tokens = rows.select(keep), tokens[keep]
                    cache.keep_rows(keep, filled=prompt_len + t)  # the cache holds positions < prompt_len + t
            rows.positions += 1  # in place: the loop allocates no per-step state
            cur = prompt_len + t
            logits = forward(
                tokens.unsqueeze(1),
                attention_mask=rows.key_mask[:, : cur + 1],
                position_ids=rows.positions,
                kv_cache=cache,
                cache_start=cur,
            )
            if recorder is not None:
                routes[rows.index, cur] = recorder.take()
        return steps

    def _sample(self, logits, rows: DecodingRows, step: int, sampling, generator, tokens_out, logprobs_out):
        """Sample step ``step`` for the decoding rows and write the tokens and log-probs to their rows."""
        if self.logits_processor is not None:
            logits = self.logits_processor(logits, rows.index, step)
        tokens, logprobs = sample_tokens(
            logits, sampling.temperature, sampling.top_k, sampling.top_p, generator,
            None if rows.uniforms is None else rows.uniforms[step],
        )
        tokens_out[:, step].index_copy_(0, rows.index, tokens)
        logprobs_out[:, step].index_copy_(0, rows.index, logprobs)
        return tokens

    def _should_compact(self, rows: int, unfinished: int) -> bool:
        """Compact once a ``compact_at`` fraction of the decoding rows has finished (and some row can go)."""
        finished = rows - unfinished
        return self.compact_at is not None and rows > 1 and finished > 0 and finished >= self.compact_at * rows

    def _finish(self, prompt_ids, prompt_mask, tokens, logprobs, stop_ids, routes=None) -> GenerationOutput:
        """Cut each row after its first stop token (kept, as generated), pad the rest, and trim columns
        that no row uses."""
        steps = tokens.shape[1]
        is_stop = torch.isin(tokens, stop_ids) if stop_ids.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        stopped = is_stop.any(-1)
        last = torch.where(stopped, is_stop.int().argmax(-1), steps - 1)
        response_mask = torch.arange(steps, device=tokens.device).unsqueeze(0) <= last.unsqueeze(1)
        width = int(last.max()) + 1
        if routes is not None:  # fed tokens after a row's stop token are not the response's: no route
            prompt_len = prompt_ids.shape[1]
            routes = routes[:, : prompt_len + width].clone()
            routes[:, prompt_len:].masked_fill_(~response_mask[:, :width, None, None], NO_ROUTE)
        return GenerationOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens.masked_fill(~response_mask, self.pad_token_id)[:, :width],
            response_mask=response_mask.long()[:, :width],
            logprobs=logprobs.masked_fill(~response_mask, 0.0)[:, :width],
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
            routed_experts=routes,
        )


def logprobs_match_forward(model: CausalLM, training_dtype: torch.dtype, compute_dtype: torch.dtype, fused: bool,
                           max_num_seqs: int = 0) -> bool:
    """Whether an engine decoding ``model`` in ``compute_dtype`` gives the log-probs of a training forward
    in ``training_dtype`` (fp32, or bf16 autocast over fp32 parameters), up to summation order.

    fp32: every engine path runs the model's own ops (within 1e-5, tested). bf16 on CPU: the fused path and
    the autocast forward share one recipe (bf16 matmuls, bitwise equal at every row count; fp32 norms,
    residual, RoPE as one multiply-add, and attention in fp32 over bf16-rounded q/k/v), so a prefill equals
    the autocast forward bitwise and a decode step differs only where single-query SDPA's fp32 summation
    order flips a bf16 rounding (measured in tests/rollout/engines/test_builtin.py). Not on CUDA (autocast
    attention runs in bf16 there, the decode path's in fp32), not for bf16 parameters (their norms and
    residual are bf16), and not through continuous batching (``max_num_seqs``: it runs the model's own
    forward, in its parameters' dtype)."""
    params = model.embed_tokens.weight
    if compute_dtype != training_dtype or params.dtype != torch.float32:
        return False
    if compute_dtype == torch.float32:
        return True
    return compute_dtype == torch.bfloat16 and fused and params.device.type == "cpu" and not max_num_seqs


def _random_draws(sampling: SamplingParams, batch: int, device: torch.device):
    """``(generator, uniforms [max_new, batch])`` for seeded sampling: draws are made for all
    ``total_rows`` and sliced to this call's rows, so each row's draws depend only on its global row."""
    if sampling.seed is None or sampling.temperature == 0:
        return None, None
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    total = sampling.total_rows or batch
    uniforms = torch.rand(sampling.max_new_tokens, total, device=device, generator=generator)
    return generator, uniforms[:, sampling.row_offset : sampling.row_offset + batch]


def _rows_to_keep(unfinished: torch.Tensor, n: int) -> torch.Tensor:
    """Which current rows form the compacted batch, in which order: unfinished rows already in its front
    part stay in place and those behind move into the places of finished ones, so the KV cache copies
    one row per finished row at most. When no row is left (other ranks still decoding), row 0 stays as a
    stand-in so this rank keeps joining the forwards, which are collectives with sharded weights.
    ``n`` is the number of unfinished rows (already read back by the caller)."""
    if n == 0:
        return torch.zeros(1, dtype=torch.long, device=unfinished.device)
    keep = torch.arange(n, device=unfinished.device)
    holes = (~unfinished[:n]).nonzero().squeeze(1)
    keep[holes] = unfinished[n:].nonzero().squeeze(1) + n
    return keep
