"""The vLLM adapter's request construction and output mapping, with stand-ins shaped like vLLM objects."""

from types import SimpleNamespace

import pytest
import torch

from scalerl.rollout.engine import SamplingParams
from scalerl.rollout.vllm_engine import (
    VLLMEngine,
    VLLMNotAvailable,
    map_vllm_outputs,
    vllm_prompts,
    vllm_sampling_kwargs,
)


def test_sampling_kwargs_translate():
    kw = vllm_sampling_kwargs(SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0, stop_token_ids=[2], seed=4))
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 9, "stop_token_ids": [2],
                  "seed": 4, "logprobs": 0, "detokenize": False}
    assert vllm_sampling_kwargs(SamplingParams(top_k=5))["top_k"] == 5
    assert vllm_prompts([[1, 2], [3]]) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]


def test_outputs_map_to_generation_output():
    def completion(tokens, reason):
        lps = [{t: SimpleNamespace(logprob=-0.5 * (k + 1)), 99: SimpleNamespace(logprob=-9.0)} for k, t in enumerate(tokens)]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=lps, finish_reason=reason)])

    out = map_vllm_outputs([completion([5, 6, 2], "stop"), completion([7], "length")], [[1, 2, 3], [4]], pad_token_id=0)
    assert out.response_ids.tolist() == [[5, 6, 2], [7, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.allclose(out.logprobs, torch.tensor([[-0.5, -1.0, -1.5], [-0.5, 0.0, 0.0]]))
    assert out.finish_reasons == ["stop", "length"]
    assert out.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]]


def test_clear_error_without_vllm():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(VLLMNotAvailable, match="pip install"):
            VLLMEngine("/nonexistent", pad_token_id=0)
    else:
        pytest.skip("vLLM is installed here")
