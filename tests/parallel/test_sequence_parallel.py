"""Ulysses sequence parallelism (`scalerl.parallel.sequence_parallel`) on 4 gloo ranks, one spawned group:
sp=4 (kv heads replicated: 2 kv heads over 4 ranks), sp=2 x DDP 2 and sp=2 x FSDP2 2 (kv heads split), and
sp=2 x DDP 2 on a Gemma 2 model (sliding window, soft caps), each against one process on the same
micro-batches: logits of padded and packed batches, losses, gradients, and the ``sequence`` bytes against
the formula.

Sequences are 13 tokens (not a multiple of sp: the padding path runs) with left padding in one row, so
a mask that was cut, shifted or lost between shards changes the outputs."""

from __future__ import annotations

import math

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
    mask[2, -2:] = 0  # right padding: its outputs are read by nothing (masked out of the loss and the checks)
    return ids, mask


def _per_token(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the policy loss reads per token: a label's log-prob and the entropy (the trainer's functions,
    which give an empty result without a graph on a shard with no kept position: that rank's backward
    must run all the same)."""
    from scalerl.algorithms.entropy import entropy_from_logits, logprobs_from_logits

    return torch.stack([logprobs_from_logits(logits, labels), entropy_from_logits(logits)], dim=-1)


def _token_outputs(output, labels: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` at the kept positions: on the whole logits (one process) or on each rank's shard (sp)."""
    from scalerl.parallel.sequence_parallel import SequenceShards

    if isinstance(output, SequenceShards):
        return output.per_token(fn, labels)
    return fn(output[:, -labels.shape[1]:].float(), labels)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(model, replica: int, packed: bool, keep: int = KEEP):
    """One forward + backward of a masked per-token loss at the last ``keep`` positions (0: all). Returns
    the model's output, the labels, the real-token mask there and the loss."""
    from scalerl.models.packing import packed_batch_or_none

    ids, mask = _batch(replica)
    inputs, attention = packed_batch_or_none(ids, mask, "sdpa_per_sequence" if packed else None)
    output = model(inputs, attention_mask=attention, logits_to_keep=keep)
    labels = torch.roll(ids, -1, dims=1)[:, -(keep or SEQ):]
    real = mask[:, -(keep or SEQ):].float()
    stats = _token_outputs(output, labels, _per_token)
    loss = ((stats[..., 1].pow(2) - stats[..., 0]) * real).sum() / real.sum()
    loss.backward()
    return output, labels, real, float(loss.detach())


def _logits(output, labels: torch.Tensor) -> torch.Tensor:
    """The whole kept logits (for the comparison only: the losses never gather them)."""
    with torch.no_grad():
        return _token_outputs(output, labels, lambda logits, _: logits)


def _reference(replicas: int, packed: bool, name: str) -> dict:
    """One process: the mean over the replicas' batches of the gradients, each replica's logits."""
    model = tiny_model(**MODELS.get(name, {}))
    outs = [_run(model, r, packed) for r in range(replicas)]
    grads = {n: p.grad / replicas for n, p in model.named_parameters()}
    critic = _value_model(name)
    values = [_run_values(critic, r, packed) for r in range(replicas)]
    return {"logits": [_logits(o[0], o[1]) for o in outs], "real": [o[2] for o in outs],
            "loss": [o[3] for o in outs], "grads": grads, "values": values,
            "value_grads": {n: p.grad / replicas for n, p in critic.named_parameters()}}


def _saved_shapes(model, packed: bool) -> dict:
    """Shapes the head reads and autograd saves in a forward that keeps every position."""
    saved, head_inputs = [], []
    lm_head = getattr(model, "module", model).lm_head
    handle = lm_head.register_forward_hook(lambda m, args, out: head_inputs.append(tuple(args[0].shape)))
    def keep_shape(t: torch.Tensor) -> torch.Tensor:
        weight = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        if not weight:  # activations only
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep_shape, lambda t: t):
        _run(model, 0, packed, keep=0)
    handle.remove()
    return {"saved": saved, "head_inputs": head_inputs}


def _value_model(name: str):
    """A critic on the tiny model with a random value head (the trainer's starts at zero: no gradient)."""
    from scalerl.models.value_model import ValueModel

    critic = ValueModel(tiny_model(**MODELS.get(name, {})))
    torch.nn.init.normal_(critic.value_head.weight, std=0.1, generator=torch.Generator().manual_seed(3))
    return critic


def _run_values(critic, replica: int, packed: bool):
    """The critic's values at the last KEEP positions and one backward of a masked loss on them."""
    from scalerl.models.packing import packed_batch_or_none

    ids, mask = _batch(replica)
    inputs, attention = packed_batch_or_none(ids, mask, "sdpa_per_sequence" if packed else None)
    values = critic(inputs, attention_mask=attention, logits_to_keep=KEEP)
    real = mask[:, -KEEP:].float()
    ((values.float().pow(2) * real).sum() / real.sum()).backward()
    return values.detach() * real


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
            output, labels, _, loss = _run(parts.trained, replica, packed)
            sent = {op: ctx.comm.bytes_by("sequence", op) for op in ("all_to_all", "all_gather")}
            grads = {n: _local(p.grad).clone() for n, p in model.named_parameters()}
            out[name, packed] = {"replica": replica, "logits": _logits(output, labels), "loss": loss, "grads": grads,
                                 "sent": sent}
            if name == "sp4":
                out[name, packed].update(_saved_shapes(parts.trained, packed))
            if name == "sp2-ddp2":  # the critic: its head on each rank's shard, values gathered
                critic = _value_model(name)
                values = _run_values(parallelize(critic, ctx).trained, replica, packed)
                out[name, packed]["values"] = values
                out[name, packed]["value_grads"] = {n: _local(p.grad).clone() for n, p in critic.named_parameters()}
        cfg, s = model.config, dims.sp
        tokens = -(-SEQ // s) * s  # padded up to a multiple of sp
        packed_tokens = -(-int(_batch(replica)[1].sum()) // s) * s
        for packed, (batch, width) in {False: (ROWS, tokens), True: (1, packed_tokens)}.items():
            payload = sequence_parallel_bytes(batch, width, cfg.num_attention_heads, cfg.num_key_value_heads,
                                              cfg.head_dim, cfg.num_hidden_layers, s, outputs_per_token=2)
            out[name, packed]["expected"] = {op: (s - 1) / s * b for op, b in payload.items()}
            out[name, packed]["shard"] = width // s
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
        real = ref["real"][got["replica"]].bool()  # padding positions' outputs are read by nothing
        torch.testing.assert_close(got["logits"][real], ref["logits"][got["replica"]][real], rtol=1e-5, atol=1e-6)
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


@pytest.mark.parametrize("packed", [False, True])
def test_critic_values_and_gradients_equal_one_process(runs, packed):
    """sp=2 x DDP 2: the value head runs on each rank's shard and the gathered values, and gradients after
    the reduction over dp x sp, are the one-process ones."""
    ref = runs["reference"]["sp2-ddp2", packed]
    for rank_out in runs["ranks"]:
        got = rank_out["sp2-ddp2", packed]
        torch.testing.assert_close(got["values"], ref["values"][got["replica"]], rtol=1e-5, atol=1e-6)
        assert got["value_grads"].keys() == ref["value_grads"].keys()
        for n, g in ref["value_grads"].items():
            assert g.abs().max() > 0, n
            torch.testing.assert_close(got["value_grads"][n], g, rtol=1e-4, atol=1e-6, msg=n)


def _whole_length(shapes: list[tuple], widths: tuple[int, ...], tokens: int) -> list[tuple]:
    """The shapes ``[..., width]`` with a width of ``widths`` over more than ``tokens`` rows (all dims but the
    last: a linear layer saves its input flattened)."""
    return [shape for shape in shapes if len(shape) >= 2 and shape[-1] in widths and math.prod(shape[:-1]) > tokens]


@pytest.mark.parametrize("packed", [False, True])
def test_no_rank_holds_whole_sequence_hidden_states_or_logits(runs, packed):
    """sp=4, every position kept: the head reads only this rank's shard of the tokens, and nothing autograd
    saves has the hidden or vocabulary width over more tokens than a shard; the same check flags the
    whole-length hidden states and logits of one process."""
    cfg = tiny_model().config
    widths = (cfg.hidden_size, cfg.vocab_size)
    for rank_out in runs["ranks"]:
        got = rank_out["sp4", packed]
        shard, rows = got["shard"], 1 if packed else ROWS
        assert got["head_inputs"] and all(shape[-2] <= shard for shape in got["head_inputs"]), got["head_inputs"]
        assert _whole_length(got["saved"], widths, rows * shard) == []
    single = _saved_shapes(tiny_model(), packed)
    assert _whole_length(single["saved"], widths, rows * shard)  # the check can fail


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


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2"])
def test_left_padding_attention_equals_the_dense_mask(model_type):
    """A padded batch's attention under sp (`LeftPadding`: causal per row from its first real column, no
    ``T x T`` mask) gives every real and left-padding query the dense mask's output; a mask with a hole
    falls back to the dense mask."""
    from scalerl.models.decoder import attention_mask_4d
    from scalerl.parallel.sequence_parallel import LeftPadding

    extra = {"gemma2": {"model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"],
                        "sliding_window": 3, "attn_logit_softcapping": 5.0, "query_pre_attn_scalar": 20}}
    model = tiny_model(**extra.get(model_type, {}))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, 4, 10, 8, generator=g)
    k, v = torch.randn(4, 2, 10, 8, generator=g), torch.randn(4, 2, 10, 8, generator=g)
    mask = torch.ones(4, 10, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :5] = 0
    mask[2, -2:] = 0
    mask[3, -4:] = 0
    padding = LeftPadding.of(mask)
    assert isinstance(padding, LeftPadding) and padding.first == [0, 3, 5, 0]
    for layer in model.layers:
        attn = layer.self_attn
        dense = attn.core_attention(q, k, v, attention_mask_4d(mask, 10))
        got = padding.attend(attn.core_attention, q, k, v)
        before_right_padding = torch.ones_like(mask, dtype=torch.bool)
        before_right_padding[2, -2:] = before_right_padding[3, -4:] = False
        torch.testing.assert_close(got.transpose(1, 2)[before_right_padding],
                                   dense.transpose(1, 2)[before_right_padding], rtol=1e-5, atol=1e-6)
    holed = mask.clone()
    holed[0, 4] = 0
    assert LeftPadding.of(holed).shape == (4, 1, 10, 10)
