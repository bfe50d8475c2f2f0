"""vLLM behind the rollout engine interface (GPU only; vLLM is an optional extra, imported lazily).

Request construction and output mapping are plain functions so they are tested on the CPU with stand-in
objects shaped like vLLM's (``RequestOutput.outputs[0].token_ids / .logprobs / .finish_reason``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from scalerl.core.errors import UserError
from scalerl.rollout.engine import GenerationOutput, SamplingParams, left_pad


class VLLMNotAvailable(UserError, ImportError):
    pass


def import_vllm():
    try:
        import vllm
    except ImportError as err:
        raise VLLMNotAvailable(
            "rollout.engine=vllm needs vLLM, which is not installed (GPU only): `pip install 'scalerl[vllm]'`, "
            "or use rollout.engine=builtin"
        ) from err
    return vllm


def vllm_sampling_kwargs(sampling: SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``vllm.SamplingParams`` equivalent to ours (one completion per prompt;
    vLLM's ``top_k=-1`` means off; ``logprobs=0`` returns the sampled token's log-prob)."""
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "seed": sampling.seed,
        "logprobs": 0,
        "detokenize": False,
    }


def vllm_prompts(prompts: Sequence[Sequence[int]]) -> list[dict[str, list[int]]]:
    """Token-id prompts in vLLM's ``TokensPrompt`` dict form."""
    return [{"prompt_token_ids": list(p)} for p in prompts]


def map_vllm_outputs(
    request_outputs: Sequence[Any], prompts: Sequence[Sequence[int]], pad_token_id: int
) -> GenerationOutput:
    """Turn vLLM ``RequestOutput``s (in prompt order) into a right-padded ``GenerationOutput``."""
    completions = [r.outputs[0] for r in request_outputs]
    width = max((len(c.token_ids) for c in completions), default=0) or 1
    batch = len(completions)
    ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    logprobs = torch.zeros((batch, width), dtype=torch.float32)
    reasons = []
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        ids[i, :n] = torch.as_tensor(list(c.token_ids), dtype=torch.long)
        mask[i, :n] = 1
        if c.logprobs is not None:
            # One dict per position, {token_id: Logprob}; the sampled token is always among the entries.
            logprobs[i, :n] = torch.tensor([step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)])
        reasons.append("stop" if c.finish_reason == "stop" else "length")
    prompt_ids, prompt_mask = left_pad(prompts, pad_token_id)
    return GenerationOutput(prompt_ids, prompt_mask, ids, mask, logprobs, reasons)


class VLLMEngine:
    """Runs a vLLM ``LLM`` on a model directory; weight sync loads trainer tensors into it (`load_weights`)."""

    logprobs_match_training_forward = False  # its kernels differ from the trainer's: recompute old log-probs
    shares_trainer_weights = False  # it holds its own copy of the weights

    def __init__(self, model_path: str, pad_token_id: int, **llm_kwargs: Any):
        vllm = import_vllm()
        self._vllm = vllm
        self.pad_token_id = pad_token_id
        self.llm = vllm.LLM(model=model_path, skip_tokenizer_init=True, **llm_kwargs)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        params = self._vllm.SamplingParams(**vllm_sampling_kwargs(sampling))
        outputs = self.llm.generate(vllm_prompts(prompts), params, use_tqdm=False)
        return map_vllm_outputs(outputs, prompts, self.pad_token_id)

    # The receiving interface of weight sync (scalerl/rollout/weight_loading.py). GPU-only, not tested here.
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Hand whole tensors to vLLM's ``model.load_weights`` (which fuses q/k/v and gate/up itself)."""
        hf_named = hf_weight_names(named_tensors)
        self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(hf_named)
        return sum(t.numel() * t.element_size() for _, t in hf_named)

    def named_weights(self) -> None:
        """vLLM's parameters are fused under other names: weight sync keeps a shadow copy instead."""
        return None


def hf_weight_names(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Our names as Hugging Face's (what vLLM's loaders expect): the flat decoder's get the ``model.`` prefix
    except the head; the transformers fallback's are HF's own under its ``hf.``."""
    return [(n.removeprefix("hf.") if n.startswith("hf.") else n if n.startswith("lm_head.") else f"model.{n}", t)
            for n, t in named_tensors]
