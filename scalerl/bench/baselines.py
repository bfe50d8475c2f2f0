"""Baselines measured in the calibration cell's own process, between its steps, on the same model and batch,
so a busy machine slows both sides alike:

- **plain PyTorch update**: the loop a user would write for the actor update of the step just run: a copy
  of the policy, `torch.optim.AdamW`, the same mini-batches and micro-batches (padded to the batch's width,
  not trimmed), log-probs of the responses, PPO-clip loss, backward, clip, step. Against scalerl's
  ``timing_s/update_actor`` of the same steps it gives the framework overhead ratio (baseline time /
  scalerl time; >= 1.0 means scalerl costs nothing over the plain loop).
- **HF generate**: Hugging Face ``generate`` on the same weights and the step's prompts, sampling exactly
  ``rollout.max_new_tokens`` tokens per row (no stop token), against the built-in engine asked for the same
  fixed length: tokens/s of each and their ratio.
"""

from __future__ import annotations

import copy
import tempfile
import time
from typing import Any

import torch

from scalerl.rollout.batch import RolloutBatch
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams


class PlainUpdate:
    """The plain PyTorch actor update on its own copy of the model and optimizer."""

    def __init__(self, model: torch.nn.Module, lr: float, clip: float, mini_rows: int, micro_rows: int,
                 clip_ratio: float = 0.2):
        self.model = copy.deepcopy(model).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.clip, self.mini_rows, self.micro_rows, self.clip_ratio = clip, mini_rows, micro_rows, clip_ratio

    def run(self, batch: RolloutBatch) -> float:
        """Seconds for one epoch of mini-batch updates over ``batch``."""
        start = time.perf_counter()
        rows = batch.input_ids.shape[0]
        response = batch.response_ids.shape[1]
        order = torch.randperm(rows)
        for mini_start in range(0, rows, self.mini_rows):
            mini = order[mini_start:mini_start + self.mini_rows]
            tokens = batch.response_mask[mini].sum().clamp(min=1)
            self.optimizer.zero_grad(set_to_none=True)
            for micro_start in range(0, len(mini), self.micro_rows):
                idx = mini[micro_start:micro_start + self.micro_rows]
                logits = self.model(batch.input_ids[idx], batch.attention_mask[idx])
                logits = logits[:, -response - 1:-1].float()
                logp = torch.log_softmax(logits, -1).gather(-1, batch.response_ids[idx].unsqueeze(-1)).squeeze(-1)
                ratio = torch.exp(logp - batch.old_logprobs[idx])
                adv = batch.advantages[idx]
                loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - self.clip_ratio, 1 + self.clip_ratio))
                ((loss * batch.response_mask[idx]).sum() / tokens).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            self.optimizer.step()
        return time.perf_counter() - start


class GenerateComparison:
    """HF ``generate`` and the built-in engine on the same weights and prompts, both at a fixed length."""

    def __init__(self, model: torch.nn.Module, pad_token_id: int, new_tokens: int):
        from transformers import (
            AutoModelForCausalLM,  # a test extra: missing means this baseline is skipped
        )

        from scalerl.models.hf_checkpoint import save_pretrained

        self.new_tokens, self.pad_token_id = new_tokens, pad_token_id
        self.ours = BuiltinEngine(copy.deepcopy(model).eval(), pad_token_id)
        with tempfile.TemporaryDirectory(prefix="scalerl-bench-hf-") as tmp:
            save_pretrained(self.ours.model, f"{tmp}/model")
            self.hf = AutoModelForCausalLM.from_pretrained(f"{tmp}/model", torch_dtype=torch.float32).eval()

    def run(self, batch: RolloutBatch) -> dict[str, float]:
        """Seconds of each engine on ``batch``'s prompts, ``new_tokens`` sampled per row."""
        prompt_ids = batch.input_ids[:, :batch.prompt_len]
        prompt_mask = batch.attention_mask[:, :batch.prompt_len]
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
        sampling = SamplingParams(max_new_tokens=self.new_tokens, temperature=1.0, seed=0, stop_token_ids=())
        start = time.perf_counter()
        out = self.ours.generate(prompts, sampling)
        ours_s = time.perf_counter() - start
        assert int(out.response_mask.sum()) == len(prompts) * self.new_tokens, "the engine stopped early"
        start = time.perf_counter()
        with torch.inference_mode():
            generated = self.hf.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, temperature=1.0, top_p=1.0,
                top_k=0, max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens,
                pad_token_id=self.pad_token_id, eos_token_id=None)
        hf_s = time.perf_counter() - start
        assert generated.shape[1] - prompt_ids.shape[1] == self.new_tokens
        return {"scalerl_s": ours_s, "hf_s": hf_s, "tokens": float(len(prompts) * self.new_tokens)}


def run_baselines(trainer: Any, batch: RolloutBatch, plain: PlainUpdate | None, generate: GenerateComparison | None,
                  record: dict[str, list[float]]) -> None:
    """One round of each available baseline on ``batch`` (the step just run), appended to ``record``."""
    if plain is not None:
        record.setdefault("plain_update_s", []).append(plain.run(batch))
    if generate is not None:
        times = generate.run(batch)
        for key, value in times.items():
            record.setdefault(f"generate_{key}", []).append(value)


def baseline_setup(trainer: Any, with_update: bool, with_generate: bool) -> tuple[PlainUpdate | None,
                                                                                  GenerateComparison | None, dict]:
    """The baselines this process can run, and why any is missing."""
    cfg, notes = trainer.cfg, {}
    plain = None
    if with_update:
        a = cfg.actor
        rows_per_rank = cfg.trainer.batch_size * cfg.rollout.n
        plain = PlainUpdate(trainer.policy.model, a.lr, a.grad_clip or float("inf"),
                            a.ppo_mini_batch_size, a.ppo_micro_batch_size, a.clip_ratio_low)
        notes["plain_update"] = (f"AdamW, {rows_per_rank // a.ppo_mini_batch_size} mini-batches of "
                                 f"{a.ppo_mini_batch_size} rows in micro-batches of {a.ppo_micro_batch_size}, "
                                 "padded to the batch width")
    generate = None
    if with_generate:
        try:
            generate = GenerateComparison(trainer.policy.model, trainer.tokenizer.pad_token_id,
                                          cfg.rollout.max_new_tokens)
            notes["generate"] = f"fixed length {cfg.rollout.max_new_tokens} new tokens per row, fp32, sampling"
        except ImportError as e:
            notes["generate"] = f"skipped: transformers is not installed ({e}); pip install transformers"
    return plain, generate, notes

