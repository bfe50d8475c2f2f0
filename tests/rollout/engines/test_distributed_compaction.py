"""Compaction with sharded weights, where every forward is a collective.

FSDP: the ranks hold different rows, finishing at very different steps; the early rank shrinks to one
stand-in row but runs as many forwards as the late one. Tensor parallel: both ranks hold all rows and
compact alike. Either way every rank's tokens equal a single process generating the whole batch.
"""


import pytest
import torch

from tests.rollout.engines.test_compaction import ForcedStops, RowsPerForward
from tests.spawned_group import run_in_group

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 20, 21], [4, 4], [9, 8, 7, 6, 5], [30]]
LENGTHS = [2, 2, 3, 5, 9, 12]  # rank 0 holds rows 0-2 (done by step 3), rank 1 rows 3-5


def _model():
    from tests.tiny import tiny_model

    return tiny_model(hidden_size=64, intermediate_size=128, tie_word_embeddings=False).eval()


def _generate(rank, layout):
    from scalerl.core.config import ParallelSection
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams

    sampling = {"max_new_tokens": 16, "temperature": 1.0, "seed": 5, "stop_token_ids": [1]}
    single = BuiltinEngine(_model(), 0, logits_processor=ForcedStops(LENGTHS)).generate(PROMPTS, SamplingParams(**sampling))
    sections = {"fsdp": ParallelSection(dp_replicate=1, dp_shard=2), "tp": ParallelSection(dp_replicate=1, tp=2)}
    ctx = init_distributed(sections[layout], torch.device("cpu"))
    model = _model()
    parallelize(model, ctx)
    mine = slice(3 * rank, 3 * rank + 3) if layout == "fsdp" else slice(0, 6)
    engine = BuiltinEngine(model, 0, finish_check_every=1, compact_at=0.01, all_finished=ctx.all_finished,
                           logits_processor=ForcedStops(LENGTHS[mine]))
    ctx.comm.reset()
    with RowsPerForward(model) as sizes:
        out = engine.generate(PROMPTS[mine], SamplingParams(**sampling, row_offset=mine.start, total_rows=6))
    gathers = ctx.comm.calls()
    width = out.response_ids.shape[1]
    # Training after generation: every layer is sharded again and a forward + backward works.
    sharded_after = all(p.to_local().numel() < p.numel() for p in model.parameters()) if layout == "fsdp" else True
    model.train()
    model(torch.tensor([PROMPTS[0]]), attention_mask=torch.ones(1, 4, dtype=torch.long)).float().sum().backward()
    return {
        "param_gathers": sum(n for (kind, op, _), n in gathers.items() if kind == "param" and op == "all_gather"),
        "sharded_after": sharded_after,
        "rows_per_forward": sizes,
        "lengths": out.response_lengths.tolist(),
        "same_tokens": torch.equal(out.response_ids, single.response_ids[mine, :width]),
        "logprob_diff": float((out.logprobs - single.logprobs[mine, :width]).abs().max()),
    }


def _run_two_ranks(layout):
    # A rank that stopped joining forwards would hang its peer: the limit names the ranks left.
    return run_in_group(_generate, 2, layout, timeout_s=120)


@pytest.mark.slow
def test_fsdp_ranks_stay_in_lockstep_while_compacting():
    early, late = _run_two_ranks("fsdp")
    assert early["lengths"] == LENGTHS[:3] and late["lengths"] == LENGTHS[3:]
    assert early["same_tokens"] and late["same_tokens"]
    assert early["logprob_diff"] < 1e-5 and late["logprob_diff"] < 1e-5
    # Prefill + 11 decode steps on both ranks (the longest row has 12 tokens).
    assert late["rows_per_forward"] == [3, 3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1]
    assert early["rows_per_forward"] == [3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    # Each FSDP module (2 layers + the root) is gathered once for the whole generation, not once per forward
    # (12 forwards would be 36 all-gathers), and everything is sharded again afterwards.
    assert early["param_gathers"] == late["param_gathers"] == 3
    assert early["sharded_after"] and late["sharded_after"]


@pytest.mark.slow
def test_tensor_parallel_ranks_compact_alike():
    first, second = _run_two_ranks("tp")
    for rank in (first, second):
        assert rank["lengths"] == LENGTHS and rank["same_tokens"] and rank["logprob_diff"] < 1e-5
        assert rank["rows_per_forward"] == [6, 6, 4, 3, 3, 2, 2, 2, 2, 1, 1, 1]
