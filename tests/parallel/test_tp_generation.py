"""Tensor-parallel generation: each rank caches only its own kv heads and the tokens match one process."""

import torch

from tests.spawned_group import run_in_group


def _cached_kv_heads(model) -> int:
    from scalerl.models.kv_cache import KVCache

    cache = KVCache.for_model(model, 1, 8)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), kv_cache=cache, cache_start=0)
    return cache.keys.shape[2]


def _generate_with_tp(rank):
    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams
    from tests.tiny import tiny_model

    # 4 kv heads over tp=2: two local kv heads per rank, shared by four local query heads.
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=4,
                 tie_word_embeddings=False)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 20, 21]]
    sampling = SamplingParams(max_new_tokens=8, temperature=0.8, seed=3)
    single = BuiltinEngine(tiny_model(**sizes).eval(), 0).generate(prompts, sampling)
    ctx = init_distributed(ParallelSection(dp_replicate=1, tp=2), torch.device("cpu"))
    model = tiny_model(**sizes).eval()
    parallelize(model, ctx)
    sharded = BuiltinEngine(model, 0).generate(prompts, sampling)
    return {
        "same_tokens": torch.equal(single.response_ids, sharded.response_ids),
        "logprob_diff": float((single.logprobs - sharded.logprobs).abs().max()),
        "local_kv_heads": _cached_kv_heads(model),
    }


def test_tensor_parallel_generation_matches_single_process():
    results = run_in_group(_generate_with_tp, 2)
    for rank in (0, 1):
        assert results[rank]["local_kv_heads"] == 2
        assert results[rank]["same_tokens"]
        assert results[rank]["logprob_diff"] < 1e-5
