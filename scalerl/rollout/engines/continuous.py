"""Continuous batching: a queue of requests, up to ``max_num_seqs`` rows decoding, a finished row's slot
refilled from the queue at the next step.

``step()`` runs a few decode steps over the rows in use (one forward each, all rows writing their newest
token at one shared cache column, no Python over rows), then reads back which rows have finished, returns
their outputs and prefills the next waiting requests into the freed slots in one batched forward. A
request's prompt is right-aligned to the current column and its key mask hides older columns, so rows of
different lengths share the cache (`scalerl.models.kv_cache.SlotKVCache`); when the write column reaches
the cache's end, the live columns move back to the front. Slots left empty with nothing waiting are closed
up as in the fixed-batch engine (rows from the back fill the gaps) once a ``compact_at`` fraction is empty.

A request's random draws are its own (pre-drawn uniforms, from its seed), so its sample never depends on
which other requests share the batch. Each generated token records ``weight_version``, an int whoever
loads weights sets; weights may change between ``step()`` calls and rows in flight continue with them.
Requests decoding together share temperature, top-k and top-p; a request with other ones waits (FIFO)
until the rows in flight have drained.

Given a ``decode_model`` (`scalerl.models.decode_model.DecodeModel`, as `BuiltinEngine.continuous_engine`
passes its own), prefills and decode steps run the fused decode path over its packed weights, laid out
again at a ``step()`` that finds the parameters written since (a weight sync between steps); otherwise the
model's own forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from scalerl.models.decode_model import DecodeModel
from scalerl.models.decoder import CausalLM
from scalerl.models.kv_cache import KVCache, SlotKVCache
from scalerl.rollout.engines.engine import PromptTooLongError, SamplingParams, left_pad
from scalerl.rollout.engines.sampling import sample_tokens

# Decode steps between finish checks (votes, an all-reduce, when ranks decode in lockstep; here the decode
# steps of one `step()`): on a CPU a step is slow and the check cheap, on a GPU the check's sync would stall
# the launch queue. The cost model imports these.
FINISH_CHECK_EVERY_CPU = 4
FINISH_CHECK_EVERY_GPU = 16


@dataclass
class GenerationRequest:
    """One completion to generate. ``uniforms`` (``[sampling.max_new_tokens]``) are the request's sampling
    draws; when None they are drawn at submission from ``sampling.seed`` (column ``row_offset`` of
    ``total_rows`` draws per step, as the fixed-batch engine does) or, without a seed, from torch's RNG."""

    request_id: int
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    uniforms: torch.Tensor | None = None
    # Prefix reuse (a conversation's next turn): ``keep_kv`` keeps this request's keys and values once it
    # finishes; ``reuse_from`` names a kept request whose tokens this prompt starts with, so only the rest
    # is prefilled. A kept entry is used once (or released, or evicted oldest first past 2 x max_num_seqs).
    keep_kv: bool = False
    reuse_from: int | None = None


@dataclass
class KeptPrefix:
    """A finished request's token ids (its prompt and every response token fed back: all but the last) and
    their keys and values, ``[layers, 2 kv_heads, n, head_dim]`` (the fused layout) or a (keys, values) pair."""

    token_ids: list[int]
    kv: torch.Tensor | None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def cache(self, num_layers: int, width: int) -> KVCache:
        """A one-row cache of ``width`` columns holding this prefix at ``[0, n)``, in the layout it was kept in."""
        n = len(self.token_ids)
        cache = KVCache(num_layers, 1, width)
        if self.kv is not None:
            cache.allocate(self.kv.shape[1] // 2, self.kv.shape[3], self.kv.dtype, self.kv.device)
            cache.kv[:, 0, :, :n] = self.kv
        else:
            for name, kept in (("keys", self.keys), ("values", self.values)):
                buffer = torch.zeros(num_layers, 1, kept.shape[1], width, kept.shape[3], dtype=kept.dtype,
                                     device=kept.device)
                buffer[:, 0, :, :n] = kept
                setattr(cache, name, buffer)
        return cache


@dataclass
class RequestOutput:
    """A finished request: its tokens (stop token kept), their log-probs (``log_softmax(logits / T)`` of the
    sampled token, as a full fp32 forward gives) and the ``weight_version`` each token was sampled with."""

    request_id: int
    prompt_ids: list[int]
    token_ids: torch.Tensor  # [n] long, on CPU
    logprobs: torch.Tensor  # [n] float32
    weight_versions: torch.Tensor  # [n] long
    finish_reason: str  # "stop" | "length"


def request_uniforms(sampling: SamplingParams, device: torch.device) -> torch.Tensor | None:
    """The draws of a request generated alone with ``sampling`` (None for greedy)."""
    if sampling.temperature == 0:
        return None
    if sampling.seed is None:
        return torch.rand(sampling.max_new_tokens, device=device)
    generator = torch.Generator(device=device).manual_seed(sampling.seed)
    total = sampling.total_rows or sampling.row_offset + 1
    return torch.rand(sampling.max_new_tokens, total, device=device, generator=generator)[:, sampling.row_offset]


def decodes_in_lockstep(model: torch.nn.Module) -> bool:
    """Whether the model's forwards are collectives (FSDP-sharded or tensor-parallel weights): its ranks must
    run the same forwards, which ranks admitting requests at different steps would not."""
    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters())


class ContinuousEngine:
    """Continuous-batching generation with a ``CausalLM`` (unsharded: ranks do not decode in lockstep)."""

    logprobs_match_training_forward = True  # as the fixed-batch engine's (tested)

    def __init__(self, model: CausalLM, pad_token_id: int, max_num_seqs: int, max_prompt_len: int,
                 max_new_tokens: int, finish_check_every: int | None = None, compact_at: float | None = 0.125,
                 logits_processor=None, decode_model: DecodeModel | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if decodes_in_lockstep(model):
            raise ValueError("continuous batching needs an unsharded model (FSDP / tensor-parallel ranks decode in "
                             "lockstep); use BuiltinEngine.generate's fixed batch")
        self.model, self.pad_token_id, self.max_num_seqs = model, pad_token_id, max_num_seqs
        if decode_model is not None and decode_model.model is not model:
            raise ValueError("decode_model must lay out this engine's model (DecodeModel(model))")
        self.decode_model = decode_model
        # The fused path's log-probs match an fp32 training forward only when it computes in fp32.
        self.logprobs_match_training_forward = decode_model is None or decode_model.dtype == torch.float32
        self.forward = decode_model if decode_model is not None else model
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        self.device = device = model.embed_tokens.weight.device
        self.finish_check_every = finish_check_every or (
            FINISH_CHECK_EVERY_CPU if device.type == "cpu" else FINISH_CHECK_EVERY_GPU)
        self.compact_at = compact_at
        # (logits [n, V], request ids [n], token index in each response [n]) -> logits
        self.logits_processor = logits_processor
        self.weight_version = 0  # recorded with every token sampled; set by whoever loads weights
        self.waiting: deque[GenerationRequest] = deque()
        # Live rows span at most a prompt, the response and one check interval's overrun; twice that lets
        # the live columns move to the front once per such span at most.
        self.columns = 2 * (max_prompt_len + max_new_tokens + self.finish_check_every)
        self.cache = SlotKVCache(model.config.num_hidden_layers, max_num_seqs, self.columns)
        slots, width = max_num_seqs, max_new_tokens + 1  # the last output column takes overrun writes
        self.pending = torch.zeros(slots, dtype=torch.long, device=device)  # sampled, not yet fed
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)  # the pending token's RoPE position
        self.generated = torch.zeros(slots, dtype=torch.long, device=device)  # tokens sampled so far
        self.limit = torch.zeros(slots, dtype=torch.long, device=device)  # the request's max_new_tokens
        self.request_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.live = torch.zeros(slots, dtype=torch.bool, device=device)
        self.key_mask = torch.zeros(slots, self.columns, dtype=torch.bool, device=device)
        self.stop_ids = torch.full((slots, 1), -1, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(slots, width, device=device)
        self.tokens_out = torch.full((slots, width), pad_token_id, dtype=torch.long, device=device)
        self.logprobs_out = torch.zeros(slots, width, dtype=torch.float32, device=device)
        self.versions_out = torch.zeros(slots, width, dtype=torch.long, device=device)
        # Host side, changed only at admission and finish checks.
        self.slots: list[GenerationRequest | None] = [None] * slots
        self.starts = [0] * slots  # each row's first cache column
        self.rows = 0  # rows in use, at the front (live ones and gaps)
        self.column = 0  # the column the next decode step writes
        self.filters: tuple | None = None  # (temperature, top_k, top_p) of the rows in flight
        self.kept: dict[int, KeptPrefix] = {}  # request id -> its keys and values, oldest first
        self.prefill_tokens = 0  # tokens run through a prefill forward (prefix reuse skips the kept ones)

    # ------------------------------------------------------------------------------------------ public
    def submit(self, request: GenerationRequest) -> None:
        """Queue a request (prefilled at the next ``step()`` with a free slot)."""
        s, n = request.sampling, len(request.prompt_ids)
        if n == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if n > self.max_prompt_len or s.max_new_tokens > self.max_new_tokens:
            raise ValueError(f"request {request.request_id}: prompt {n} / max_new_tokens {s.max_new_tokens} exceed "
                             f"the engine's max_prompt_len {self.max_prompt_len} / max_new_tokens {self.max_new_tokens}")
        limit = self.model.config.max_position_embeddings
        if n + s.max_new_tokens > limit:
            raise PromptTooLongError(f"prompt length {n} + max_new_tokens {s.max_new_tokens} exceeds the model's "
                                     f"max_position_embeddings ({limit}); shorten the prompt or generate fewer tokens")
        if request.uniforms is None:
            request.uniforms = request_uniforms(s, self.device)
        self.waiting.append(request)

    def abort(self, request_ids: Iterable[int]) -> int:
        """Drop these requests, waiting or in flight (their slots free at the next ``step()``); returns how many."""
        ids = set(request_ids)
        before = len(self.waiting)
        self.waiting = deque(r for r in self.waiting if r.request_id not in ids)
        rows = [i for i, r in enumerate(self.slots) if r is not None and r.request_id in ids]
        for i in rows:
            self.slots[i] = None
        if rows:
            self.live[torch.as_tensor(rows, device=self.device)] = False
        if not self.num_running:
            self.filters = None
        return before - len(self.waiting) + len(rows)

    def release(self, request_ids: Iterable[int]) -> None:
        """Drop the kept keys and values of these requests (a conversation that ended)."""
        for i in request_ids:
            self.kept.pop(i, None)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def has_unfinished(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def step(self) -> list[RequestOutput]:
        """Fill free slots from the queue, decode ``finish_check_every`` steps, return the requests that finished."""
        with torch.inference_mode():
            if self.decode_model is not None and self.decode_model.is_stale():
                self.decode_model.refresh()  # weights written since the last step: rows continue with them
            self._admit()
            if not self.rows:
                return []
            for _ in range(self.finish_check_every):
                self._decode()
            return self._collect_finished()

    def generate_stream(self, requests: Iterable[GenerationRequest]) -> Iterator[RequestOutput]:
        """Outputs as requests finish; ``requests`` is read lazily, keeping enough waiting to fill every slot."""
        incoming = iter(requests)
        for request in incoming:
            self.submit(request)
            if len(self.waiting) >= self.max_num_seqs:
                break
        while self.has_unfinished():
            yield from self.step()
            for request in incoming:
                self.submit(request)
                if len(self.waiting) >= self.max_num_seqs:
                    break

    # ------------------------------------------------------------------------------------------ decoding
    def _decode(self) -> None:
        """One forward over the rows in use: feed each its pending token, sample the next."""
        if self.column == self.columns:  # the live columns move to the front
            self._move_columns(0)
        n, col, base = self.rows, self.column, self.cache.view_start
        self.key_mask[:n, col] = True
        logits = self.forward(self.pending[:n, None], attention_mask=self.key_mask[:n, base : col + 1],
                            position_ids=self.positions[:n, None], kv_cache=self.cache, cache_start=col)
        index = self.generated[:n].clamp(max=self.max_new_tokens)  # overrun rows write the spare column
        tokens, logprobs = self._sample(logits[:, -1], slice(0, n), index)
        self.tokens_out[:n].scatter_(1, index[:, None], tokens[:, None])
        self.logprobs_out[:n].scatter_(1, index[:, None], logprobs[:, None])
        self.versions_out[:n].scatter_(1, index[:, None], self.weight_version)
        self.pending[:n] = tokens
        self.positions[:n] += 1
        self.generated[:n] += 1
        self.column += 1

    def _sample(self, logits: torch.Tensor, rows, index: torch.Tensor):
        if self.logits_processor is not None:
            logits = self.logits_processor(logits, self.request_ids[rows], index)
        temperature, top_k, top_p = self.filters
        uniform = None if temperature == 0 else self.uniforms[rows].gather(1, index[:, None]).squeeze(1)
        return sample_tokens(logits, temperature, top_k, top_p, None, uniform)

    def _base(self) -> int:
        """The first column a live row uses (the current one when none is live); host work over the rows, so
        read at admission and column moves only (kept as ``cache.view_start`` for the decode steps)."""
        return min((s for s, r in zip(self.starts[: self.rows], self.slots) if r is not None), default=self.column)

    def _move_columns(self, to: int) -> None:
        """Move every live row's columns so they start at column ``to``."""
        base = self._base()
        shift = to - base
        if shift == 0:
            return
        n, width = self.rows, self.column - base
        self.cache.move_columns(base, self.column, to, n)
        moved = self.key_mask[:n, base : self.column].clone()
        self.key_mask[:n] = False  # columns left behind are no row's keys any more
        self.key_mask[:n, to : to + width] = moved
        self.starts = [s + shift for s in self.starts]
        self.column += shift
        self.cache.view_start = to

    # ------------------------------------------------------------------------------------------ finishing
    def _collect_finished(self) -> list[RequestOutput]:
        """Read back which rows have emitted a stop token or their limit; free their slots."""
        n, width = self.rows, self.max_new_tokens
        tokens = self.tokens_out[:n, :width]
        counted = torch.arange(width, device=self.device) < torch.minimum(self.generated[:n], self.limit[:n])[:, None]
        is_stop = (tokens[:, :, None] == self.stop_ids[:n, None, :]).any(-1) & counted
        stopped = is_stop.any(-1)
        length = torch.where(stopped, is_stop.int().argmax(-1) + 1, self.limit[:n])
        done = self.live[:n] & (stopped | (self.generated[:n] >= self.limit[:n]))
        rows = done.nonzero().squeeze(1)
        if not rows.numel():
            return []
        self.live[rows] = False
        host = torch.stack([rows, length[rows], stopped[rows].long()]).tolist()
        tokens, logprobs, versions = (t[rows].cpu() for t in (self.tokens_out, self.logprobs_out, self.versions_out))
        outputs = []
        for i, (row, count, stop) in enumerate(zip(*host)):
            if self.slots[row].keep_kv:
                self._keep(row, self.slots[row], tokens[i, : count - 1].tolist())
            request, self.slots[row] = self.slots[row], None
            outputs.append(RequestOutput(request.request_id, list(request.prompt_ids), tokens[i, :count],
                                         logprobs[i, :count], versions[i, :count], "stop" if stop else "length"))
        if not self.num_running:
            self.filters = None
        return outputs

    def _keep(self, row: int, request: GenerationRequest, fed: list[int]) -> None:
        """Keep ``row``'s keys and values of its prompt and the response tokens fed back (``fed``): the first
        that many of its key-mask columns (padding and the overrun past its stop are not among them)."""
        token_ids = list(request.prompt_ids) + fed
        columns = self.key_mask[row].nonzero().squeeze(1)[: len(token_ids)]
        if self.cache.kv is not None:
            kept = KeptPrefix(token_ids, self.cache.kv[:, row].index_select(2, columns))
        else:
            kept = KeptPrefix(token_ids, None, self.cache.keys[:, row].index_select(2, columns),
                              self.cache.values[:, row].index_select(2, columns))
        self.kept[request.request_id] = kept
        while len(self.kept) > 2 * self.max_num_seqs:  # bounded: the oldest kept prefix goes first
            self.kept.pop(next(iter(self.kept)))

    def _reusable(self, request: GenerationRequest) -> KeptPrefix | None:
        kept = self.kept.pop(request.reuse_from, None) if request.reuse_from is not None else None
        if kept is None:
            return None
        n = len(kept.token_ids)
        return kept if len(request.prompt_ids) > n and list(request.prompt_ids[:n]) == kept.token_ids else None

    # ------------------------------------------------------------------------------------------ admission
    def _admit(self) -> None:
        """Prefill waiting requests into free slots (gaps first, then unused rows), batched; close up gaps
        that nothing fills."""
        if not self.num_running:  # idle: start again from the first row and column
            self.rows, self.column = 0, 0
            self.live.zero_()
        gaps = [i for i in range(self.rows) if self.slots[i] is None]
        free = gaps + list(range(self.rows, self.max_num_seqs))
        taken: list[GenerationRequest] = []
        while self.waiting and len(taken) < len(free):
            s = self.waiting[0].sampling
            filters = (s.temperature, s.top_k, s.top_p)
            if self.filters not in (None, filters):
                break
            self.filters = filters
            taken.append(self.waiting.popleft())
        if taken:
            slots = free[: len(taken)]
            prefixes = [self._reusable(r) for r in taken]
            fresh = [(r, slot) for r, slot, k in zip(taken, slots, prefixes) if k is None]
            if fresh:  # one batched prefill of the whole prompts
                self._prefill([r for r, _ in fresh], [slot for _, slot in fresh])
            for r, slot, kept in zip(taken, slots, prefixes):
                if kept is not None:  # a conversation's next turn: only its new tokens
                    self._prefill([r], [slot], kept)
            gaps = gaps[len(taken):]
        while self.rows and self.slots[self.rows - 1] is None:  # empty rows at the back just drop off
            self.rows -= 1
            gaps = gaps[:-1] if gaps and gaps[-1] == self.rows else gaps
        if gaps and self.compact_at is not None and len(gaps) >= self.compact_at * self.rows:
            self._close_gaps()
        self.cache.view_start = self._base()

    def _prefill(self, requests: list[GenerationRequest], slots: list[int], kept: KeptPrefix | None = None) -> None:
        """Prefill ``requests`` into ``slots``: their whole prompts in one batch, or one request whose prompt
        starts with ``kept``'s tokens, of which only the rest runs, over the kept keys and values."""
        prompt_ids, prompt_mask = left_pad([r.prompt_ids for r in requests], self.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(self.device), prompt_mask.to(self.device)
        width = prompt_ids.shape[1]
        if self.column < width:  # room on the left for the prompts (they end at the write column)
            self._move_columns(self._base() + width - self.column)
        end = self.column
        layers = self.model.config.num_hidden_layers
        if kept is None:
            prefilled = KVCache(layers, len(requests), width)
            logits = self.forward(prompt_ids, attention_mask=prompt_mask, kv_cache=prefilled, cache_start=0,
                                  logits_to_keep=1)
            self.prefill_tokens += int(prompt_mask.sum())
        else:
            n = len(kept.token_ids)
            prefilled = kept.cache(layers, width)  # positions follow from the mask: the suffix's are n..width-1
            logits = self.forward(prompt_ids[:, n:], attention_mask=prompt_mask, kv_cache=prefilled, cache_start=n,
                                  logits_to_keep=1)
            self.prefill_tokens += width - n
        index = torch.as_tensor(slots, device=self.device)
        self.cache.write_rows(index, prefilled, end)
        self.key_mask[index] = False
        self.key_mask[index, end - width : end] = prompt_mask.bool()
        stops = [list(r.sampling.stop_token_ids) for r in requests]
        if max(map(len, stops)) > self.stop_ids.shape[1]:
            extra = max(map(len, stops)) - self.stop_ids.shape[1]
            self.stop_ids = torch.nn.functional.pad(self.stop_ids, (0, extra), value=-1)
        self.stop_ids[index] = torch.tensor([s + [-1] * (self.stop_ids.shape[1] - len(s)) for s in stops],
                                            dtype=torch.long, device=self.device)
        self.limit[index] = torch.tensor([r.sampling.max_new_tokens for r in requests], device=self.device)
        self.request_ids[index] = torch.tensor([r.request_id for r in requests], device=self.device)
        if self.filters[0] != 0:
            draws = torch.zeros(len(requests), self.uniforms.shape[1], device=self.device)
            for i, r in enumerate(requests):
                draws[i, : r.uniforms.numel()] = r.uniforms.to(self.device)
            self.uniforms[index] = draws
        zero = torch.zeros(len(requests), dtype=torch.long, device=self.device)
        tokens, logprobs = self._sample(logits[:, -1], index, zero)
        self.tokens_out[index, 0], self.logprobs_out[index, 0] = tokens, logprobs
        self.versions_out[index, 0] = self.weight_version
        self.pending[index], self.positions[index] = tokens, prompt_mask.sum(-1)
        self.generated[index], self.live[index] = 1, True
        for slot, request in zip(slots, requests):
            self.slots[slot], self.starts[slot] = request, end - width
        self.rows = max(self.rows, max(slots) + 1)

    def _close_gaps(self) -> None:
        """Rows from the back take the places of empty rows in front, so the rows in use shrink to the live ones."""
        live = [i for i in range(self.rows) if self.slots[i] is not None]
        n = len(live)
        targets = [i for i in range(n) if self.slots[i] is None]
        sources = [i for i in live if i >= n]
        if sources:
            src = torch.as_tensor(sources, device=self.device)
            dst = torch.as_tensor(targets, device=self.device)
            for name in ("pending", "positions", "generated", "limit", "request_ids", "live", "key_mask", "stop_ids",
                         "uniforms", "tokens_out", "logprobs_out", "versions_out"):
                buffer = getattr(self, name)
                buffer[dst] = buffer[src]
            self.cache.move_rows(src, dst, self._base(), self.column)
            for s, t in zip(sources, targets):
                self.slots[t], self.starts[t], self.slots[s] = self.slots[s], self.starts[s], None
        self.live[n : self.rows] = False
        self.rows = n
