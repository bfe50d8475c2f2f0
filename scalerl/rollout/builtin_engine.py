"""The built-in rollout engine: batched prefill, then a decode loop over a preallocated KV cache.

Each decode step runs one forward for the whole batch and two copies into preallocated outputs; nothing
in the loop iterates over sequences. Finished sequences keep stepping (cheaper than compacting the batch at
these sizes); which tokens count is worked out once after the loop, from the first stop token of each row.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch.distributed.fsdp import FSDPModule

from scalerl.models.decoder import CausalLM
from scalerl.models.kv_cache import KVCache
from scalerl.rollout.engine import GenerationOutput, SamplingParams, left_pad
from scalerl.rollout.sampling import sample_tokens


class BuiltinEngine:
    """Generates with a ``CausalLM`` it shares with the trainer (colocated: weight sync is free)."""

    # Capabilities the trainer reads instead of asking for the class:
    logprobs_match_training_forward = True  # its log-probs equal an fp32 forward over the sequence (tested)
    shares_trainer_weights = True  # it generates with the trained parameters themselves

    def __init__(
        self,
        model: CausalLM,
        pad_token_id: int,
        finish_check_every: int | None = None,
        all_finished: Callable[[bool], bool] | None = None,
    ):
        self.model = model
        self.pad_token_id = pad_token_id
        # With sharded or tensor-parallel weights every forward is a collective, so the ranks agree on when
        # to stop (`DistContext.all_finished`); alone, a rank decides for itself.
        self.all_finished = all_finished or (lambda flag: flag)
        # "All finished?" reads a flag back from the device and scans the tokens so far; every few steps is
        # enough (at most that many wasted steps) and on a GPU avoids a sync per token.
        self.finish_check_every = finish_check_every

    def sync_weights(self, named_tensors: dict[str, torch.Tensor] | None = None) -> int:
        """Colocated: the engine reads the trainer's parameters directly. With tensors given (a standalone
        engine), copy them in place and return the bytes copied."""
        return self.load_weights(named_tensors.items()) if named_tensors else 0

    # The receiving interface of weight sync (scalerl/rollout/weight_loading.py).
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
        with torch.no_grad() if sharded else torch.inference_mode():
            return self._generate(prompts, sampling)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        model = self.model
        device = model.embed_tokens.weight.device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id)
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        batch, prompt_len = prompt_ids.shape
        max_new = sampling.max_new_tokens
        total_len = prompt_len + max_new
        if total_len > model.config.max_position_embeddings:
            raise ValueError(
                f"prompt length {prompt_len} + max_new_tokens {max_new} exceeds the model's "
                f"max_position_embeddings ({model.config.max_position_embeddings})"
            )
        generator, uniforms = None, None
        if sampling.seed is not None and sampling.temperature > 0:
            generator = torch.Generator(device=device).manual_seed(sampling.seed)
            total = sampling.total_rows or batch
            uniforms = torch.rand(max_new, total, device=device, generator=generator)
            uniforms = uniforms[:, sampling.row_offset : sampling.row_offset + batch]
        stop_ids = torch.as_tensor(list(sampling.stop_token_ids), dtype=torch.long, device=device)
        check_every = self.finish_check_every or (4 if device.type == "cpu" else 16)

        cache = KVCache.for_model(model, batch, total_len)
        key_mask = torch.ones(batch, total_len, dtype=torch.bool, device=device)
        key_mask[:, :prompt_len] = prompt_mask.bool()
        positions = prompt_mask.sum(-1, keepdim=True) - 1  # position of each prompt's last token
        tokens_out = torch.empty((batch, max_new), dtype=torch.long, device=device)
        logprobs_out = torch.empty((batch, max_new), dtype=torch.float32, device=device)

        logits = model(prompt_ids, attention_mask=prompt_mask, kv_cache=cache, cache_start=0, logits_to_keep=1)
        steps = max_new
        for t in range(max_new):
            tokens, logprobs = sample_tokens(
                logits[:, -1], sampling.temperature, sampling.top_k, sampling.top_p, generator,
                None if uniforms is None else uniforms[t],
            )
            tokens_out[:, t] = tokens
            logprobs_out[:, t] = logprobs
            if t + 1 == max_new:
                break
            if stop_ids.numel() and (t + 1) % check_every == 0:
                if self.all_finished(bool(torch.isin(tokens_out[:, : t + 1], stop_ids).any(-1).all())):
                    steps = t + 1
                    break
            positions = positions + 1
            cur = prompt_len + t
            logits = model(
                tokens_out[:, t : t + 1],
                attention_mask=key_mask[:, : cur + 1],
                position_ids=positions,
                kv_cache=cache,
                cache_start=cur,
            )
        return self._finish(prompt_ids, prompt_mask, tokens_out[:, :steps], logprobs_out[:, :steps], stop_ids)

    def _finish(self, prompt_ids, prompt_mask, tokens, logprobs, stop_ids) -> GenerationOutput:
        """Cut each row after its first stop token (kept, as generated), pad the rest, and trim columns
        that no row uses."""
        steps = tokens.shape[1]
        is_stop = torch.isin(tokens, stop_ids) if stop_ids.numel() else torch.zeros_like(tokens, dtype=torch.bool)
        stopped = is_stop.any(-1)
        last = torch.where(stopped, is_stop.int().argmax(-1), steps - 1)
        response_mask = torch.arange(steps, device=tokens.device).unsqueeze(0) <= last.unsqueeze(1)
        width = int(last.max()) + 1
        return GenerationOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens.masked_fill(~response_mask, self.pad_token_id)[:, :width],
            response_mask=response_mask.long()[:, :width],
            logprobs=logprobs.masked_fill(~response_mask, 0.0)[:, :width],
            finish_reasons=["stop" if s else "length" for s in stopped.tolist()],
        )
