"""Ulysses sequence parallelism (`scalerl.parallel.sequence_parallel`) on 4 gloo ranks, one spawned group:
sp=4 (kv heads replicated: 2 kv heads over 4 ranks), sp=2 x DDP 2 and sp=2 x FSDP2 2 (kv heads split), and
sp=2 x DDP 2 on a Gemma 2 model (sliding window, soft caps), each against one process on the same
micro-batches: logits of padded and packed batches, losses, gradients, and the ``sequence`` bytes against
the formula.

Sequences are 13 tokens (not a multiple of sp: the padding path runs) with left padding in one row, so
a mask that was cut, shifted or lost between shards changes the outputs."""

from __future__ import annotations

import pytest
import torch

from tests.spawned_group import run_in_group
from tests.tiny import tiny_model

ROWS, SEQ, KEEP = 3, 13, 6
LAYOUTS = {"sp4": {"dp_replicate": 1, "dp_shard": 1, "sp": 4}, "sp2-ddp2": {"dp_replicate": 2, "dp_shard": 1, "sp": 2},
           "sp2-fsdp2": {"dp_replicate": 1, "dp_shard": 2, "sp": 2},
           "sp2-ddp2-gemma2": {"dp_replicate": 2, "dp_shard": 1, "sp": 2}}
# Gemma 2's choices inside the attention that runs on head shards: a sliding window shorter than a shard
# (layer 0), capped scores, a scaled query; its norms, scaled embeddings and capped logits around it.
MODELS = {"sp2-ddp2-gemma2": {"model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"],
                              "sliding_window": 4, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                              "query_pre_attn_scalar": 20}}


def _batch(replica: int):
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(20 + replica))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    return ids, mask


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().logsumexp(-1).pow(2).mean()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(model, replica: int, packed: bool):
    """Logits of the last KEEP positions (padded layout), the loss, after one backward."""
    from scalerl.models.packing import packed_batch_or_none

    ids, mask = _batch(replica)
    inputs, attention = packed_batch_or_none(ids, mask, "sdpa_per_sequence" if packed else None)
    logits = model(inputs, attention_mask=attention, logits_to_keep=KEEP)
    loss = _loss(logits)
    loss.backward()
    return logits.detach(), float(loss.detach())


def _reference(replicas: int, packed: bool, name: str) -> dict:
    """One process: the mean over the replicas' batches of the gradients, each replica's logits."""
    model = tiny_model(**MODELS.get(name, {}))
    outs = [_run(model, r, packed) for r in range(replicas)]
    grads = {n: p.grad / replicas for n, p in model.named_parameters()}
    return {"logits": [o[0] for o in outs], "loss": [o[1] for o in outs], "grads": grads}


def _sp_rank(rank: int) -> dict:
    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims
    from scalerl.parallel.parallelize import parallelize
    from scalerl.parallel.sequence_parallel import sequence_parallel_bytes

    out = {}
    for name, sizes in LAYOUTS.items():
        dims = ParallelDims(pp=1, tp=1, **sizes)
        mesh, dp_mesh = dims.build_mesh("cpu")
        ctx = DistContext(dims, mesh, dp_mesh, rank=rank, comm=CommCounter())
        replica = ctx.dp_rank
        for packed in (False, True):
            model = tiny_model(**MODELS.get(name, {}))
            parts = parallelize(model, ctx)
            ctx.comm.reset()
            logits, loss = _run(parts.trained, replica, packed)
            sent = {op: ctx.comm.bytes_by("sequence", op) for op in ("all_to_all", "all_gather")}
            grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
            out[name, packed] = {"replica": replica, "logits": logits, "loss": loss, "grads": grads, "sent": sent}
        cfg, s = model.config, dims.sp
        tokens = -(-SEQ // s) * s  # padded up to a multiple of sp
        packed_tokens = -(-int(_batch(replica)[1].sum()) // s) * s
        for packed, (batch, width) in {False: (ROWS, tokens), True: (1, packed_tokens)}.items():
            payload = sequence_parallel_bytes(batch, width, cfg.hidden_size, cfg.num_attention_heads,
                                              cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, s)
            out[name, packed]["expected"] = {op: (s - 1) / s * b for op, b in payload.items()}
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    ranks = run_in_group(_sp_rank, 4, timeout_s=600)
    reference = {(name, packed): _reference(_replicas(name), packed, name)
                 for name in LAYOUTS for packed in (False, True)}
    return {"ranks": ranks, "reference": reference}


def _replicas(name: str) -> int:
    return LAYOUTS[name]["dp_replicate"] * LAYOUTS[name]["dp_shard"]


CASES = [(name, packed) for name in LAYOUTS for packed in (False, True)]


@pytest.mark.parametrize("name,packed", CASES)
def test_logits_and_loss_equal_one_process(runs, name, packed):
    ref = runs["reference"][name, packed]
    for rank_out in runs["ranks"]:
        got = rank_out[name, packed]
        assert got["logits"].shape == (ROWS, KEEP, 64)
        torch.testing.assert_close(got["logits"], ref["logits"][got["replica"]], rtol=1e-5, atol=1e-6)
        assert abs(got["loss"] - ref["loss"][got["replica"]]) <= 1e-5 * abs(ref["loss"][got["replica"]])


@pytest.mark.parametrize("name,packed", CASES)
def test_gradients_equal_one_process(runs, name, packed):
    """After DP's reduction over dp x sp, every rank holds the one-process gradient of its replicas' mean."""
    ref = runs["reference"][name, packed]["grads"]
    for rank_out in runs["ranks"]:
        grads = rank_out[name, packed]["grads"]
        assert grads.keys() == ref.keys()
        for n, g in ref.items():
            assert g.abs().max() > 0, n
            torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("name,packed", CASES)
def test_sequence_bytes_equal_the_formula(runs, name, packed):
    for rank_out in runs["ranks"]:
        got = rank_out[name, packed]
        assert got["sent"]["all_to_all"] > 0
        assert got["sent"] == pytest.approx(got["expected"], rel=1e-12)


def test_head_rule_names_the_key():
    from scalerl.core.config import sequence_parallel_head_problems

    assert sequence_parallel_head_problems(2, 4, 2) == []
    assert sequence_parallel_head_problems(4, 8, 2) == []  # kv heads replicated twice
    assert sequence_parallel_head_problems(8, 8, 8) == []
    (heads,) = sequence_parallel_head_problems(3, 4, 2)
    assert "parallel.sp=3" in heads and "num_attention_heads=4" in heads
    (kv,) = sequence_parallel_head_problems(4, 12, 3)
    assert "parallel.sp=4" in kv and "num_key_value_heads=3" in kv
