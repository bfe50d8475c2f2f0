"""Weight sync in one process: delta pushes are bit-exact against full pushes after every training step,
across bucket cuts and dtypes; failed applies, drift, restarts and plan changes resync instead of
drifting; the lossy mode's staleness is bounded; engines receive through the rollout interface."""

import pytest
import torch

from scalerl.comm.weights.channel import (
    InProcessChannel,
    Kind,
    Message,
    WeightSyncError,
)
from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
from scalerl.comm.weights.sender import WeightSender
from scalerl.core.config import ConfigError, load_config
from scalerl.models.decoder import build_model
from scalerl.perf.metrics import reduction_of
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.engines.weight_loading import engine_weight_receiver
from tests.tiny import tiny_model_config

CONFIG = tiny_model_config()


def _model(seed=0):
    return build_model(CONFIG, seed=seed)


def _train(model, optimizer, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, CONFIG.vocab_size, (4, 12), generator=g)
        logits = model(ids, attention_mask=torch.ones_like(ids))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _holds_exactly(store_tensors, model, dtype) -> bool:
    return all(torch.equal(store_tensors[n].view(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           p.detach().to(dtype).reshape(-1).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
               for n, p in model.named_parameters())


def _pair(dtype, bucket_bytes=4096, mode="delta", receivers=1, **kw):
    stores = [TensorDictStore() for _ in range(receivers)]
    channel = InProcessChannel([WeightReceiver(s) for s in stores])
    return WeightSender(dtype, bucket_bytes, channel, mode=mode, **kw), stores, channel


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("lr", [1e-3, 1e-5])
def test_delta_sync_is_bit_exact_against_a_full_push_after_every_step(dtype, lr):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # 4 KiB buckets: the 64x32 embedding spans buckets, the norms and biases share them.
    delta, delta_stores, _ = _pair(dtype, receivers=2)
    full, full_stores, _ = _pair(dtype, mode="full")
    for step in range(5):
        d = delta.sync(model.named_parameters())
        f = full.sync(model.named_parameters())
        for store in delta_stores:
            assert all(torch.equal(store.tensors[n], full_stores[0].tensors[n]) for n in full_stores[0].tensors)
            assert _holds_exactly(store.tensors, model, dtype), step
        assert d.full_push == (step == 0) and f.full_push
        assert d.full_bytes == f.full_bytes == sum(p.numel() for p in model.parameters()) * (2 if dtype == torch.bfloat16 else 4)
        if step:
            assert d.bytes < f.bytes  # a training step never changes every bit of every element
            assert 0 < d.changed_fraction <= 1 and d.resyncs == 0
            assert d.static_tensors + d.dynamic_tensors == len(list(model.parameters()))
        assert d.buckets > 1 and d.peak_bucket_bytes > 0
        _train(model, optimizer, 1, seed=step)
    metrics = d.metrics()
    for name in metrics:
        reduction_of(name)  # every metric is declared in scalerl/perf/metrics.py
    assert metrics["weight_sync/full_bytes"] == d.full_bytes


def test_unchanged_tensors_are_not_sent_and_counted_static():
    model = _model()
    sender, stores, _ = _pair(torch.bfloat16, bucket_bytes=1 << 20)
    sender.sync(model.named_parameters())
    with torch.no_grad():
        model.norm.weight.add_(0.5)  # one tensor of many changes
    report = sender.sync(model.named_parameters())
    assert report.dynamic_tensors == 1 and report.static_tensors == len(list(model.parameters())) - 1
    assert report.changed_elements == model.norm.weight.numel()
    assert report.bytes < 500  # headers + a few dozen changed elements
    assert _holds_exactly(stores[0].tensors, model, torch.bfloat16)
    assert sender.sync(model.named_parameters()).dynamic_tensors == 0


def test_a_failed_apply_is_resent_and_the_snapshot_never_moves_past_the_receiver():
    """The bug other frameworks shipped: a receiver fails to apply one delta, the sender's snapshot moves
    on anyway, and every later delta is applied to the wrong base. Here a failure is resent at once, and
    a bucket that cannot be confirmed leaves the snapshot where the receiver is and forces a full push."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    class FlakyStore(TensorDictStore):
        failures = 0

        def loaded(self, names):
            if self.failures:
                self.failures -= 1
                raise RuntimeError("injected: engine refused the tensors")

    store = FlakyStore()
    sender = WeightSender(torch.bfloat16, 4096, InProcessChannel([WeightReceiver(store)]), max_resends=2)
    sender.sync(model.named_parameters())
    _train(model, optimizer, 1, seed=0)
    store.failures = 1  # one failed apply: resent dense within the same sync
    report = sender.sync(model.named_parameters())
    assert report.resyncs == 1 and _holds_exactly(store.tensors, model, torch.bfloat16)

    _train(model, optimizer, 1, seed=1)
    before = sender.snapshot.clone()
    store.failures = 10  # keeps failing: the sync aborts...
    with pytest.raises(WeightSyncError, match="bucket 0 still fails"):
        sender.sync(model.named_parameters())
    assert torch.equal(sender.snapshot[: sender.plan.bucket_elems], before[: sender.plan.bucket_elems])  # ...bucket 0 not moved on
    assert sender.version == 0
    store.failures = 0
    for step in range(3):  # ...and the receiver is whole again from the next sync on
        report = sender.sync(model.named_parameters())
        assert report.full_push == (step == 0)
        assert _holds_exactly(store.tensors, model, torch.bfloat16)
        _train(model, optimizer, 1, seed=10 + step)


def test_weights_that_drift_on_the_receiver_are_caught_and_repaired():
    model = _model()
    sender, stores, _ = _pair(torch.bfloat16)
    sender.sync(model.named_parameters())
    held = stores[0].tensors["layers.1.mlp.down_proj.weight"]
    held.view(-1).view(torch.int16)[5] ^= 1  # a single flipped bit behind the sender's back
    report = sender.sync(model.named_parameters())  # nothing changed on the trainer: deltas are empty...
    assert report.changed_elements == 0
    assert report.resyncs == 1  # ...but the bucket holding the flip does not verify and is resent dense
    assert _holds_exactly(stores[0].tensors, model, torch.bfloat16)


def test_a_payload_corrupted_in_transit_is_refused_and_resent():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    store = TensorDictStore()

    class CorruptingChannel(InProcessChannel):
        corrupt_next = False

        def exchange(self, message):
            if self.corrupt_next and message.kind == Kind.BUCKET and message.payload:
                self.corrupt_next = False
                damaged = bytearray(message.payload)
                damaged[len(damaged) // 2] ^= 0x40
                message = Message(message.kind, message.bucket, message.version, message.plan_hash, message.checksum,
                                  message.encoded, bytes(damaged))
                message.encoded = Message.from_wire(message.header(), message.payload).encoded
            return super().exchange(message)

    channel = CorruptingChannel([WeightReceiver(store)])
    sender = WeightSender(torch.bfloat16, 1 << 20, channel)
    sender.sync(model.named_parameters())
    for step in range(3):
        _train(model, optimizer, 1, seed=step)
        channel.corrupt_next = True
        report = sender.sync(model.named_parameters())
        assert report.resyncs == 1 and not report.full_push
        assert _holds_exactly(store.tensors, model, torch.bfloat16)


def test_a_restarted_receiver_or_sender_gets_a_full_push():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sender, stores, channel = _pair(torch.bfloat16, receivers=2)
    sender.sync(model.named_parameters())
    _train(model, optimizer, 1, seed=0)
    assert not sender.sync(model.named_parameters()).full_push
    fresh = TensorDictStore()
    channel.receivers[1] = WeightReceiver(fresh)  # receiver 1 restarted with nothing
    _train(model, optimizer, 1, seed=1)
    report = sender.sync(model.named_parameters())
    assert report.full_push and report.resyncs == 0
    assert _holds_exactly(fresh.tensors, model, torch.bfloat16) and _holds_exactly(stores[0].tensors, model, torch.bfloat16)
    restarted = WeightSender(torch.bfloat16, 4096, channel)  # the trainer restarted (e.g. resumed)
    assert restarted.sync(model.named_parameters()).full_push
    assert not restarted.sync(model.named_parameters()).full_push


def test_a_receiver_whose_tensors_do_not_fit_refuses_the_plan():
    model = _model()
    wrong = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in model.named_parameters()}
    wrong["norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    engine = BuiltinEngine(_model(), pad_token_id=0)
    engine.model.norm.weight.data = torch.zeros(3)
    sender = WeightSender(torch.bfloat16, 4096, InProcessChannel([engine_weight_receiver(engine)]))
    with pytest.raises(WeightSyncError, match="refused the plan"):
        sender.sync(model.named_parameters())
    assert "norm.weight" in sender.channel.receivers[0].last_error


def test_lossy_mode_defers_small_changes_with_bounded_staleness():
    model = _model()
    sender, stores, _ = _pair(torch.bfloat16, static_every=2, static_threshold=1e-2)
    with torch.no_grad():
        model.norm.weight.fill_(0.01)  # small values: a 1e-3 step moves their bf16 bits every time
    sender.sync(model.named_parameters())
    deferred = []
    for step in range(6):
        with torch.no_grad():
            model.norm.weight.add_(1e-3)  # below the threshold each step: deferred, at most 2 syncs in a row
            model.layers[0].mlp.up_proj.weight.add_(0.1)  # above it: always pushed
        report = sender.sync(model.named_parameters())
        deferred.append(report.deferred_tensors)
        assert report.max_staleness <= 2
        assert report.max_deviation < 1e-2
        up = stores[0].tensors["layers.0.mlp.up_proj.weight"]
        assert torch.equal(up, model.layers[0].mlp.up_proj.weight.detach().to(torch.bfloat16))
        # receivers hold exactly the sender's snapshot, deferred tensors included
        flat = torch.cat([stores[0].tensors[e.name].reshape(-1).view(torch.int16) for e in sender.plan.entries])
        assert torch.equal(flat, sender.snapshot)
    assert deferred == [1, 1, 0, 1, 1, 0]  # deferred twice, then pushed


@pytest.mark.parametrize("engine_dtype", [torch.bfloat16, torch.float32])
def test_the_builtin_engine_receives_in_place_or_through_a_shadow_copy(engine_dtype):
    trainer = _model(seed=0)
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    engine = BuiltinEngine(_model(seed=1).to(engine_dtype).eval(), pad_token_id=0)
    receiver = engine_weight_receiver(engine)
    sender = WeightSender(torch.bfloat16, 4096, InProcessChannel([receiver]))
    for step in range(3):
        sender.sync(trainer.named_parameters())
        for n, p in engine.model.named_parameters():  # bf16 bits, upcast exactly where the engine is fp32
            assert torch.equal(p.detach(), dict(trainer.named_parameters())[n].detach().to(torch.bfloat16).to(engine_dtype))
        _train(trainer, optimizer, 1, seed=step)
    assert receiver.store.in_place == (engine_dtype == torch.bfloat16)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert out.response_ids.shape == (1, 4)


def test_config_section_builds_a_sender_and_rejects_impossible_values():
    cfg = load_config(None, ["weight_sync.bucket_mb=0.5", "rollout.dtype=fp32"])
    sender = WeightSender.from_config(cfg.weight_sync, cfg.rollout.dtype, None)
    assert sender.dtype == torch.float32 and sender.bucket_bytes == 1 << 19 and sender.mode == "delta"
    for bad in (["weight_sync.mode=sparse"], ["weight_sync.bucket_mb=0"], ["rollout.dtype=fp16"],
                ["weight_sync.static_every=3"], ["weight_sync.static_every=3", "weight_sync.static_threshold=1e-3",
                                                  "weight_sync.mode=full"]):
        with pytest.raises(ConfigError):
            load_config(None, bad)


class _SlowChannel(InProcessChannel):
    """An in-process channel that takes as long as a link of ``bytes_per_s`` would (sleeping per message)."""

    def __init__(self, receivers, bytes_per_s):
        super().__init__(receivers)
        self.bytes_per_s = bytes_per_s

    def exchange(self, message):
        import time

        time.sleep(message.nbytes / self.bytes_per_s)
        return super().exchange(message)


def test_auto_mode_picks_deltas_over_a_slow_link():
    """Over a 1 MB/s link, bf16 deltas at a small learning rate (a few % of the elements) cost far less time
    than dense buckets: after the first (full, dense) push and one delta, auto keeps deltas, trying dense
    again on every 8th sync. Every sync is bit-exact."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    store = TensorDictStore()
    sender = WeightSender(torch.bfloat16, 1 << 20, _SlowChannel([WeightReceiver(store)], 1e6), mode="auto")
    chosen = []
    for step in range(10):
        report = sender.sync(model.named_parameters())
        assert _holds_exactly(store.tensors, model, torch.bfloat16), step
        chosen.append("full" if report.full_push else "dense" if report.dense_by_choice else "delta")
        _train(model, optimizer, 1, seed=step)
    assert chosen == ["full"] + ["delta"] * 7 + ["dense", "delta"], chosen
    assert 0 < sender.cost_per_element["delta"] < sender.cost_per_element["dense"]


def test_auto_mode_follows_its_measured_costs_and_stays_exact():
    """With no link cost, fp32 weights that change everywhere: whichever way the timings fall on this
    machine, each sync sends the way its measured costs favour (the other on every 8th), bit-exact."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = TensorDictStore()
    sender = WeightSender(torch.float32, 1 << 20, InProcessChannel([WeightReceiver(store)]), mode="auto")
    for step in range(12):
        dense, delta = sender.cost_per_element["dense"], sender.cost_per_element["delta"]
        report = sender.sync(model.named_parameters())
        assert _holds_exactly(store.tensors, model, torch.float32), step
        if step == 0:
            assert report.full_push
        elif step == 1:
            assert not report.dense_by_choice  # dense timed by the full push, now a delta
        else:
            assert report.dense_by_choice == ((dense <= delta) != (step % 8 == 0)), (step, dense, delta)
        _train(model, optimizer, 1, seed=step)


def test_auto_mode_is_a_config_choice():
    cfg = load_config(None, ["weight_sync.mode=auto"])
    assert WeightSender.from_config(cfg.weight_sync, "bf16", None).mode == "auto"
    with pytest.raises(ConfigError, match="static_every"):
        load_config(None, ["weight_sync.mode=auto", "weight_sync.static_every=2", "weight_sync.static_threshold=0.1"])
