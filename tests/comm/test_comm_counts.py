"""Counted bytes equal a hand computation for every collective and layout, at world 2 and 4.

One spawned gloo group per world size lays a tiny model out as DDP, FSDP, HSDP, TP, FSDP x TP, PP,
PP x DP and PP x TP in turn (each through `parallelize`), runs one mini-batch of 2 micro-batches, and
reports its `CommCounter`. The expected numbers below are written out from the model's shapes, not read
from the model. TP's analytic counts are also checked against the functional collectives DTensor really
dispatches (seen by a dispatch mode, as torch's `CommDebugMode` does; CommDebugMode itself fails on this
model's module tree in torch 2.13); the mesh built in node order ([0, 2, 1, 3]) keeps its groups in that
order and counts the same bytes.
"""

import pytest
import torch

from tests.spawned_group import run_in_group

# The model: vocab 64, hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 kv heads, q/k/v bias, untied head.
V, H, FF, L, KV = 64, 32, 64, 2, 16
LAYER = 2 * H + (H * H + H) + 2 * (H * KV + KV) + H * H + 3 * H * FF  # norms, q, k + v, o, gate + up + down
LAYER_TP2 = 2 * H + (LAYER - 2 * H) // 2  # tp=2: everything but the norms split in half
P = 4 * (V * H + L * LAYER + H + V * H)  # bytes: embedding, layers, final norm, head
P_TP2 = 4 * (V * H // 2 + L * LAYER_TP2 + H + V * H // 2)
ROOT, ROOT_TP2 = 4 * (V * H + H + V * H), 4 * (V * H // 2 + H + V * H // 2)  # FSDP's root unit: embedding, norm, head
STAGE0, STAGE1 = 4 * (V * H + LAYER), 4 * (LAYER + H + V * H)  # pp=2: embedding + layer 0 | layer 1 + norm + head
M, B, T = 2, 2, 8  # micro-batches, rows per micro-batch, tokens
ACT, LOGITS, MASK = 4 * B * T * H, 4 * B * T * V, 4 * B * T  # one micro-batch's hidden states, logits, float mask
# rebalance_batch on 4 rows of 3 prompt + 5 response tokens: lengths, input_ids, attention_mask, response_ids
# (int64), response_mask, rollout_logprobs, advantages (fp32), group_ids (int64), scores (fp32)
REBALANCE_LOCAL = 8 * 4 + 8 * 4 * 8 * 2 + 8 * 4 * 5 + 4 * 4 * 5 * 3 + 8 * 4 + 4 * 4


def ring(n):  # all-reduce: bytes sent per byte of payload
    return 2 * (n - 1) / n


def gather(n):  # all-gather: per byte of gathered output
    return (n - 1) / n


gloo_reduce_scatter = ring  # gloo reduce-scatters through an all-reduce (measured, docs/comm-accounting.md)

LAYOUTS = {  # name: ((pp, dp_replicate, dp_shard, tp), rank order or None)
    2: {"ddp": ((1, 2, 1, 1), None), "fsdp": ((1, 1, 2, 1), None), "tp": ((1, 1, 1, 2), None),
        "pp": ((2, 1, 1, 1), None)},
    4: {"ddp": ((1, 4, 1, 1), None), "fsdp": ((1, 1, 4, 1), None), "hsdp": ((1, 2, 2, 1), None),
        "fsdp_tp": ((1, 1, 2, 2), None), "pp_dp": ((2, 2, 1, 1), None), "pp_tp": ((2, 1, 1, 2), None),
        "ddp_node_order": ((1, 4, 1, 1), [0, 2, 1, 3]), "hsdp_node_order": ((1, 2, 2, 1), [0, 2, 1, 3])},
}


def expected(world: int, name: str, rank: int) -> dict[str, float]:
    """Bytes this rank sends in one mini-batch of M micro-batches, by 'kind/op/dim'."""
    n = world
    layouts = {
        "ddp": {"grad/all_reduce/dp_replicate": ring(n) * P},  # one bucket, on the last micro-batch only
        # layers: forward + backward re-gather; the root stays gathered from its forward to its backward
        "fsdp": {"param/all_gather/dp_shard": M * gather(n) * (2 * P - ROOT),
                 "grad/reduce_scatter/dp_shard": M * gloo_reduce_scatter(n) * P},
        "hsdp": {"param/all_gather/dp_shard": M * gather(2) * (2 * P - ROOT),
                 "grad/reduce_scatter/dp_shard": M * gloo_reduce_scatter(2) * P,
                 "grad/all_reduce/dp_replicate": M * ring(2) * P / 2},  # the shard, over the replicas
        # forward: embedding + o and down per layer; backward: the attention and MLP blocks' inputs per layer
        # (q/k/v and gate/up sum their partial gradients first) + the vocabulary-split head's input
        "tp": {"tp/all_reduce/tp": M * ((1 + 2 * L) + (2 * L + 1)) * ring(2) * ACT,
               "tp/all_gather/tp": M * gather(2) * LOGITS},
    }
    layouts["ddp_node_order"], layouts["hsdp_node_order"] = layouts["ddp"], layouts["hsdp"]
    layouts["fsdp_tp"] = {"param/all_gather/dp_shard": M * gather(2) * (2 * P_TP2 - ROOT_TP2),
                          "grad/reduce_scatter/dp_shard": M * gloo_reduce_scatter(2) * P_TP2, **layouts["tp"]}
    stage = 0 if name == "pp" and rank == 0 or name != "pp" and rank < 2 else 1
    stage_bytes = STAGE0 if stage == 0 else STAGE1
    # stage 0 sends activations + the mask forward, stage 1 the activations' gradient backward
    pp_send = {"pp/send/pp": M * (ACT + MASK) if stage == 0 else M * ACT}
    layouts["pp"] = pp_send
    # PP x DP is HSDP with shard groups of one: per FSDP unit, one all-reduce on the last micro-batch
    layouts["pp_dp"] = {**pp_send, "grad/all_reduce/dp_replicate": ring(2) * stage_bytes}
    # stage 0: embedding + 1 layer forward, 1 layer backward; stage 1: 1 layer forward, layer + head backward.
    # The schedule's first step infers shapes with real passes: a forward on stage 0, forward + backward on
    # the last stage (to learn the gradient it sends); their TP collectives are real traffic too.
    tp_calls = M * (3 + 2) + 3 if stage == 0 else M * (2 + 3) + (2 + 3)
    layouts["pp_tp"] = {**pp_send, "tp/all_reduce/tp": tp_calls * ring(2) * ACT}
    if stage == 1:
        layouts["pp_tp"]["tp/all_gather/tp"] = (M + 1) * gather(2) * LOGITS
    return layouts[name]


def _count_every_layout(rank, world):
    from collections import Counter

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class FunctionalCollectives(TorchDispatchMode):
        """Counts the functional collectives dispatched (CommDebugMode's trick: let DTensor desugar first)."""

        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented
            if func.namespace == "_c10d_functional":
                self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    from scalerl.comm.counting.accounting import process_counter
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims
    from scalerl.parallel.metric_reduction import reduce_metrics
    from scalerl.parallel.parallelize import MicroBatch, PipelineOptions, parallelize
    from scalerl.rollout.batch import RolloutBatch
    from scalerl.trainer.rollout_rebalance import rebalance_batch

    counter = process_counter()
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    micros = [MicroBatch(ids, torch.ones(B, T, dtype=torch.long), torch.zeros(B)) for _ in range(M)]

    def loss_fn(out, target):
        return out.float().pow(2).mean()

    def counts():
        return ({"/".join(str(x) for x in k): v for k, v in counter.breakdown().items() if v},
                {"/".join(str(x) for x in k): c for k, c in counter.calls().items()})

    out = {}
    for name, (shape, order) in LAYOUTS[world].items():
        dims = ParallelDims(*shape)
        mesh, dp_mesh = dims.build_mesh("cpu", order)
        ctx = DistContext(dims, mesh, dp_mesh, rank=rank, comm=counter)
        parts = parallelize(build_model(cfg, seed=0), ctx, pipeline=PipelineOptions("1f1b", M))
        parts.train()
        counter.reset()
        if name == "tp":
            with FunctionalCollectives() as seen:
                parts.forward_backward(micros, loss_fn)
            torch_counts = dict(seen.counts)
        else:
            parts.forward_backward(micros, loss_fn)
        metrics = counter.step_metrics()
        out[name] = {"bytes": counts()[0], "calls": counts()[1],
                     "grad_wait": metrics["timing_s/comm/grad"], "param_wait": metrics["timing_s/comm/param"]}
        if name == "tp":
            out[name]["torch_counts"] = torch_counts
        if name.endswith("node_order"):
            out[name]["groups"] = {d: dist.get_process_group_ranks(mesh[d].get_group())
                                   for d in ("dp_replicate", "dp_shard")}
            out[name]["dp_group"] = dist.get_process_group_ranks(dp_mesh.get_group())
        if name == "fsdp" and world == 2:
            counter.reset()
            parts.clip_grad_norm(1.0)
            out["clip"] = counts()[0]
            # a forward-only pass of 3 micro-batches gathers each unit once, and equals the unsharded model's
            from scalerl.trainer.forward_passes import response_logprobs

            rows = RolloutBatch(
                input_ids=torch.randint(0, V, (6, 8), generator=torch.Generator().manual_seed(1)),
                attention_mask=torch.ones(6, 8, dtype=torch.long), response_ids=torch.ones(6, 5, dtype=torch.long),
                response_mask=torch.ones(6, 5), rollout_logprobs=torch.zeros(6, 5), group_ids=torch.arange(6),
                scores=torch.zeros(6))
            counter.reset()
            sharded = response_logprobs(parts.model, rows, 1.0, micro_batch_size=2)
            out["forward_pass_calls"] = counts()[1]
            plain = build_model(cfg, seed=0)
            out["forward_pass_diff"] = float((sharded - response_logprobs(plain, rows, 1.0, 2)).abs().max())
        if name == "pp":
            counter.reset()
            parts.share_loss_metrics({"loss": torch.tensor(1.0)}, ["loss"])
            parts.refresh_generation_copy()
            out["pp_refresh"] = counts()[0]
        if name == "ddp":  # the trainer's small collectives and rollout rebalancing, on the DP group
            counter.reset()
            ctx.all_reduce(torch.ones(2))
            ctx.all_finished(True)
            reduce_metrics({"actor/pg_loss": 1.0, "perf/throughput": 2.0, "timing_s/step": 3.0}, ctx)
            out["small"] = counts()[0]
            counter.reset()
            batch = RolloutBatch(
                input_ids=torch.ones(4, 8, dtype=torch.long), attention_mask=torch.ones(4, 8, dtype=torch.long),
                response_ids=torch.ones(4, 5, dtype=torch.long), response_mask=torch.ones(4, 5),
                rollout_logprobs=torch.zeros(4, 5), group_ids=torch.arange(4) // 2, scores=torch.zeros(4),
                advantages=torch.zeros(4, 5))
            rebalance_batch(batch, ctx, local_groups=2)
            out["rebalance"] = counts()[0]
            out["facade"] = _facade(ctx, rank, world)
            out["facade_bytes"] = counts()[0]
        dist.barrier()
    return out


def _facade(ctx, rank: int, world: int) -> dict:
    """The rest of DistContext's counted collectives, values and bytes (counted after ``rebalance``)."""
    ctx.comm.reset()
    mine = torch.full((2,), float(rank))
    out = {"all_gather": ctx.all_gather(mine).tolist(),
           "max": ctx.all_reduce(mine.clone(), op="max", over="trainer").tolist(),
           "broadcast": ctx.broadcast(torch.full((2,), float(rank), dtype=torch.float64), src=1).tolist(),
           "all_to_all": ctx.all_to_all(torch.arange(2 * world, dtype=torch.float32) + 100 * rank,
                                        kind="rebalance").tolist()}
    with ctx.counted("weight_sync", "send", over="rollout") as transfer:
        transfer.payload_bytes = 1000  # known once the block has sent it (a tensor message)
    return out


def _run(world: int) -> dict:
    return dict(enumerate(run_in_group(_count_every_layout, world, world, timeout_s=240)))


def _check_layouts(world: int, results: dict) -> None:
    for rank, out in results.items():
        for name in LAYOUTS[world]:
            want = expected(world, name, rank)
            got = out[name]["bytes"]
            assert set(got) == set(want), (world, name, rank, got, want)
            for key, value in want.items():
                assert got[key] == pytest.approx(value), (world, name, rank, key, got[key], value)


@pytest.fixture(scope="module")
def world2():
    return _run(2)


@pytest.fixture(scope="module")
def world4():
    return _run(4)


def test_world2_counts_match_hand_computation(world2):
    _check_layouts(2, world2)
    for rank, out in world2.items():
        # call counts: one DDP bucket; FSDP: 3 units (2 layers + root) reduce-scattered once per micro-batch
        assert out["ddp"]["calls"] == {"grad/all_reduce/dp_replicate": 1}
        # 2 layers gathered in forward and again in backward, the root once per micro-batch
        assert out["fsdp"]["calls"] == {"param/all_gather/dp_shard": (2 * 2 + 1) * M, "grad/reduce_scatter/dp_shard": 3 * M}
        assert out["clip"] == {"metrics/all_reduce/None": ring(2) * 4}  # one fp32 partial norm
        # 3 micro-batches of a forward-only pass: each of the 3 units gathered once (9 unit-forwards)
        assert out["forward_pass_calls"] == {"param/all_gather/dp_shard": 3}
        assert out["forward_pass_diff"] < 1e-5
        # the DP group's small collectives: 2 fp32 counts, one fp32 finish flag, 3 float64 metrics gathered
        assert out["small"] == {"metrics/all_reduce/dp": ring(2) * 8, "metrics/all_reduce/None": ring(2) * 4,
                                "metrics/all_gather/None": gather(2) * 2 * 3 * 8}
        assert out["rebalance"] == {"rebalance/all_gather/dp": gather(2) * 2 * REBALANCE_LOCAL,
                                    "rebalance/all_reduce/dp": ring(2) * 16}
        _check_facade(2, rank, out)
        # the replica refresh: each rank broadcasts its stage's weights (gloo, 2 ranks: the root sends S)
        owned = STAGE0 if rank == 0 else STAGE1
        loss_broadcast = {"metrics/broadcast/pp": 8} if rank == 1 else {}  # the last stage sends its float64 loss
        assert out["pp_refresh"] == {"weight_sync/broadcast/pp": owned, **loss_broadcast}
        assert out["ddp"]["grad_wait"] > 0 and out["fsdp"]["grad_wait"] > 0 and out["fsdp"]["param_wait"] > 0


def test_world2_tp_counts_agree_with_the_collectives_dtensor_dispatches(world2):
    for out in world2.values():
        calls = out["tp"]["calls"]
        torch_counts = out["tp"]["torch_counts"]
        assert calls["tp/all_reduce/tp"] == torch_counts["all_reduce"] == M * 10  # Megatron's 2 + 2 per layer
        assert calls["tp/all_gather/tp"] == torch_counts["all_gather_into_tensor"] == M


def _check_facade(world: int, rank: int, out: dict) -> None:
    f = out["facade"]
    assert f["all_gather"] == [float(r) for r in range(world) for _ in range(2)]
    assert f["max"] == [world - 1.0] * 2 and f["broadcast"] == [1.0, 1.0]
    # chunk j of every rank's input goes to rank j: rank r receives element pair r from each rank, in order
    assert f["all_to_all"] == [100.0 * j + v for j in range(world) for v in (2 * rank, 2 * rank + 1)]
    # broadcast from rank 1 (gloo's binomial tree, 16 bytes): world 2: 1 -> 0; world 4: 1 -> 2, 3 and 2 -> 0
    tree = {2: {1: 1}, 4: {1: 2, 2: 1}}[world]
    want = {"metrics/all_gather/dp": gather(world) * 4 * 2 * world, "metrics/all_reduce/None": ring(world) * 8,
            "rebalance/all_to_all/dp": gather(world) * 4 * 2 * world, "weight_sync/send/rollout_workers": 1000}
    if rank in tree:
        want["metrics/broadcast/None"] = tree[rank] * 16
    assert out["facade_bytes"] == pytest.approx(want), (rank, out["facade_bytes"])


def test_the_facade_is_a_no_op_in_a_single_process():
    from scalerl.comm.counting.accounting import CommCounter
    from scalerl.parallel.distributed import DistContext
    from scalerl.parallel.mesh import ParallelDims

    ctx = DistContext(ParallelDims(1, 1, 1, 1), mesh=None, comm=CommCounter())
    t = torch.arange(4.0)
    for result in (ctx.all_reduce(t, op="max", over="trainer"), ctx.all_gather(t), ctx.broadcast(t),
                   ctx.all_to_all(t, kind="rebalance")):
        assert result is t and t.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert ctx.all_finished(True) and not ctx.agree(False)
    assert ctx.comm.calls() == {}
    with pytest.raises(ValueError, match="unknown group 'pp'"):
        ctx.all_reduce(t, over="pp")


def test_world4_counts_match_hand_computation(world4):
    _check_layouts(4, world4)
    for rank, out in world4.items():
        _check_facade(4, rank, out)
        assert out["hsdp"]["calls"]["grad/all_reduce/dp_replicate"] == 3 * M


def test_world4_node_order_mesh_keeps_its_ring_order(world4):
    for rank, out in world4.items():
        assert out["ddp_node_order"]["dp_group"] == [0, 2, 1, 3]
        shard = out["hsdp_node_order"]["groups"]["dp_shard"]
        replicate = out["hsdp_node_order"]["groups"]["dp_replicate"]
        assert shard == ([0, 2] if rank in (0, 2) else [1, 3])  # one node's ranks shard together
        assert replicate == ([0, 1] if rank in (0, 1) else [2, 3])
