"""Weight sync over a gloo group of 3 ranks: trainer ranks 0 and 1, a receiver on rank 2 outside their
mesh. The receiver serves broadcasts from rank 0; its weights are compared with the trainer's full
weights (gathered independently) after every step, for a plain model, an FSDP2-sharded one and a
tensor-parallel one, where both trainer ranks join the gathers. One spawned group runs every check."""

import hashlib

import torch

from tests.spawned_group import run_in_group

STEPS = 3


def _digest(tensors, dtype) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().to(dtype).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _train_step(model, optimizer, seed):
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))


def _full_digest(model, dtype) -> str:
    """Every trainer rank gathers (a collective); the digest of the full weights in the rollout dtype."""
    from torch.distributed.tensor import DTensor

    return _digest([p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()], dtype)


def _ranks(rank):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from scalerl.comm.weights.channel import BroadcastChannel, serve_broadcast
    from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
    from scalerl.comm.weights.sender import WeightSender

    sync_group = dist.new_group([0, 2])  # the source and the receiver; every rank creates it
    mesh = DeviceMesh("cpu", torch.tensor([0, 1]), mesh_dim_names=("trainer",))
    layouts = {
        "plain": lambda m: m,
        "fsdp2": lambda m: fully_shard(m, mesh=mesh),
        "tp": lambda m: parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}),
    }
    dtypes = {"plain": torch.bfloat16, "fsdp2": torch.float32, "tp": torch.bfloat16}
    out = {}

    class FlakyStore(TensorDictStore):
        fail_next = False

        def loaded(self, names):
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected failure")

    for name, layout in layouts.items():
        dtype = dtypes[name]
        if rank == 2:
            store = FlakyStore()
            receiver = WeightReceiver(store)
            digests = []
            for step in range(STEPS + 1):
                if name == "plain" and step == 2:
                    store.fail_next = True  # one failed apply, resent over the group
                if name == "plain" and step == 3:
                    store = TensorDictStore()
                    receiver = WeightReceiver(store)  # a restarted receiver
                serve_broadcast(receiver.handle, sync_group, src=0, timeout_s=120)
                digests.append(_digest([store.tensors[e.name] for e in receiver.plan.entries], dtype))
            out[name] = {"digests": digests}
            continue
        model = layout(_mlp())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        channel = BroadcastChannel(sync_group, src=0, timeout_s=120) if rank == 0 else None
        sender = WeightSender(dtype, 1024, channel)  # 1 KiB buckets: the 64x16 weights span several
        digests, reports = [], []
        for step in range(STEPS + 1):
            if name == "plain" and rank == 1:
                continue  # plain: rank 1 holds no part of the model
            report = sender.sync(model.named_parameters())
            reports.append({"full_push": report.full_push, "resyncs": report.resyncs, "bytes": report.bytes,
                            "full_bytes": report.full_bytes, "metrics": report.metrics()})
            digests.append(_full_digest(model, dtype))
            _train_step(model, optimizer, seed=step)  # TP needs the same inputs on both ranks
        out[name] = {"digests": digests, "reports": reports}
    return out


def test_weight_sync_over_a_process_group_from_plain_fsdp2_and_tp_trainers():
    results = run_in_group(_ranks, 3, timeout_s=240)
    source, other, receiver = results
    for name in ("plain", "fsdp2", "tp"):
        assert source[name]["digests"] == receiver[name]["digests"], name  # bit-exact after every sync
        assert len(set(source[name]["digests"])) == STEPS + 1, name  # and the weights did change each step
        reports = source[name]["reports"]
        assert [r["full_push"] for r in reports][:3] == [True, False, False], name
        assert all(r["bytes"] < r["full_bytes"] for r in reports[1:3]), name
    plain = source["plain"]["reports"]
    assert [r["resyncs"] for r in plain] == [0, 0, 1, 0]  # the injected failure was resent once
    assert plain[3]["full_push"]  # the restarted receiver got a full push
    for name in ("fsdp2", "tp"):  # the non-source trainer rank joined the gathers and reports zeros
        assert source[name]["digests"] == other[name]["digests"]
        assert all(r["bytes"] == 0 for r in other[name]["reports"])
        assert set(other[name]["reports"][0]["metrics"]) == set(source[name]["reports"][0]["metrics"])
