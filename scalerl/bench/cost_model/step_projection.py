"""Step time, throughput and memory of one RL step for a model, a batch and a layout: compute from FLOPs at
calibrated per-phase rates, plus communication from the alpha-beta cost of every collective the step issues
(`scalerl.bench.cost_model.step_traffic`), summed (no overlap assumed: on gloo the collectives are synchronous).

    step = gen + forward-only passes + update x (1 + pipeline bubble) + per-row host work   (compute)
         + sum over collectives of count x alpha-beta time                                   (communication)

A phase's compute time is its calls (decode steps, micro-batch forward + backward passes; a pipeline stage's
calls cost its share of the layers) at a fixed cost each, plus its FLOPs (`scalerl.perf.flops`) at an
effective rate, both calibrated on a device (`scalerl.bench.calibration`), times ``contention``: how many
ranks share each core on an oversubscribed host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scalerl.bench.cost_model.collective_cost import (
    LinkCost,
    collective_time,
    hierarchical_all_reduce_time,
)
from scalerl.bench.cost_model.step_traffic import (
    MIN_ROWS_PER_PIPELINE_RANK,
    Collective,
    Layout,
    StepShape,
    step_collectives,
)
from scalerl.models.config import ModelConfig
from scalerl.perf.flops import (
    decoder_param_count,
    flops_per_token,
    forward_flops_per_token,
)
from scalerl.perf.mfu import StepWork, generation_flops

GB = 1024**3
ADAM_STATE_BYTES = 8  # two fp32 moments per parameter


@dataclass(frozen=True)
class ComputeRates:
    """Per phase, a fixed cost per call (a full model's forward + backward, forward, or decode step: launch
    and dispatch overhead, scaled by the share of the layers a rank runs) plus FLOPs at an effective rate;
    and seconds of host work per sequence (data, rewards, advantages). With where the numbers came from."""

    gen_flops_per_s: float
    train_flops_per_s: float
    forward_flops_per_s: float
    other_s_per_row: float
    source: str = ""
    gen_step_s: float = 0.0
    train_call_s: float = 0.0
    forward_call_s: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict) -> ComputeRates:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Links:
    intra: LinkCost  # between ranks of one node
    inter: LinkCost  # one stream between nodes
    # a collective's own fit inside a node where it was measured alone ({op: LinkCost}; `intra` otherwise):
    # gloo's all-gather and reduce-scatter do not cost the all-reduce's share of their bytes
    intra_ops: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class TokenLengths:
    """Mean real lengths (FLOPs count real tokens; widths in `StepShape` are padded)."""

    prompt: float
    response: float


@dataclass
class StepEstimate:
    compute_s: dict[str, float]
    comm_s: dict[str, float]
    bytes_per_rank: dict[str, float]
    tokens_per_step: float
    devices: int
    memory_gb: float
    node_link_bytes_per_s: float = 0.0
    collectives: list[Collective] = field(default_factory=list, repr=False)

    @property
    def compute_total_s(self) -> float:
        return sum(self.compute_s.values())

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    @property
    def step_s(self) -> float:
        return self.compute_total_s + self.comm_total_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / max(1, self.devices)


def phase_flops(model: ModelConfig, step: StepShape, layout: Layout, lengths: TokenLengths) -> dict[str, float]:
    """FLOPs one trainer rank computes per phase (generation with standalone workers: one worker's). Real
    tokens, except under pipeline parallelism, whose stages run mini-batches padded to fixed widths."""
    rows = step.rows
    tokens = rows * (lengths.prompt + lengths.response)
    seq = lengths.prompt + lengths.response
    work = StepWork(int(rows * lengths.prompt), int(rows * lengths.response), lengths.prompt, lengths.response)
    gen = generation_flops(model, work) / layout.tp
    if layout.rollout_workers:  # the workers generate the whole batch between them, unsplit by TP
        gen = gen * layout.tp * layout.dp / layout.rollout_workers
    elif layout.pp > 1 and rows >= MIN_ROWS_PER_PIPELINE_RANK * layout.pp:  # the replicas split the rows
        gen = gen / layout.pp
    update = step.epochs * tokens * flops_per_token(model, seq)
    if layout.pp > 1 and step.pp_width:  # pipeline stages train on mini-batches padded to the fixed widths
        update = step.epochs * rows * step.pp_width * flops_per_token(model, step.pp_width)
    return {
        "gen": gen,
        "forward": step.forward_passes * tokens * forward_flops_per_token(model, seq) / layout.tp,
        "update": update / (layout.tp * layout.pp),
    }


def compute_seconds(model: ModelConfig, step: StepShape, layout: Layout, lengths: TokenLengths,
                    rates: ComputeRates, contention: float = 1.0) -> dict[str, float]:
    flops = phase_flops(model, step, layout, lengths)
    bubble = (layout.pp - 1) / step.pp_microbatches if layout.pp > 1 else 0.0
    train_calls = step.optimizer_steps * step.pp_microbatches / layout.pp if layout.pp > 1 else step.micro_batches
    forward_calls = step.forward_passes * math.ceil(step.rows / step.micro_rows)
    # one round runs to its longest response; over several (rollout.max_num_seqs), a finished row's slot takes the
    # next row, so the rounds before the last cost the mean response each (no more than the longest: an agent's
    # mean trajectory holds the environment's answers, prefilled, beside its decoded turns)
    decode_steps = step.response_len + (step.decode_waves - 1) * min(lengths.response, step.response_len)
    seconds = {
        "gen": decode_steps * rates.gen_step_s + flops["gen"] / rates.gen_flops_per_s,
        "forward": forward_calls * rates.forward_call_s + flops["forward"] / rates.forward_flops_per_s,
        "update": (train_calls * rates.train_call_s + flops["update"] / rates.train_flops_per_s) * (1 + bubble),
        "other": step.rows * rates.other_s_per_row,
    }
    return {k: v * max(1.0, contention) for k, v in seconds.items()}


def collective_seconds(c: Collective, links: Links, ranks_per_node: int) -> float:
    """Seconds of all ``c.count`` collectives (the mean rank's share for point-to-point sends)."""
    if c.hierarchical:
        return c.count * hierarchical_all_reduce_time(c.payload_bytes, c.group.nodes, ranks_per_node, links.intra,
                                                      links.inter, c.backend)
    link = links.inter if c.group.crosses_nodes else links.intra_ops.get(c.op, links.intra)
    share = c.group.share if c.group.crosses_nodes else 1
    one = collective_time(c.op, c.payload_bytes, c.group.size, link, c.backend, share)
    fraction = c.per_rank_fraction if c.time_fraction is None else c.time_fraction
    if c.pipelined:  # back-to-back transfers from one sender overlap their latencies: paid once
        latency = collective_time(c.op, 0.0, c.group.size, link, c.backend, share)
        return fraction * (c.count * (one - latency) + latency)
    return c.count * fraction * one


def device_memory_gb(model: ModelConfig, step: StepShape, layout: Layout) -> float:
    """Estimated peak per device: weights, gradients and AdamW moments of this rank's shard, the generation
    copy (a pipeline rank's full replica, FSDP's gathered unit), the KV cache, training activations (about
    10 hidden + 3 intermediate values per token and layer, not checkpointed) and the logits (x3: values,
    log-softmax, gradient)."""
    params = decoder_param_count(model)
    shard = layout.dp_shard * layout.tp * layout.pp
    state = params / shard * (2 * step.param_bytes + ADAM_STATE_BYTES)
    layers = model.num_hidden_layers
    if layout.pp > 1:
        gen_copy = params / layout.tp * step.param_bytes
    elif layout.dp_shard > 1:
        gen_copy = 2 * params / layout.tp / (layers + 1) * step.param_bytes
    else:
        gen_copy = 0.0
    kv_dim = model.num_key_value_heads * model.head_dim
    kv_cache = step.rows * (step.prompt_len + step.response_len) * layers * 2 * kv_dim * step.act_bytes / layout.tp
    width = step.pp_width if layout.pp > 1 and step.pp_width else step.train_width
    micro = step.mini_rows / step.pp_microbatches if layout.pp > 1 else step.micro_rows
    in_flight = min(layout.pp, step.pp_microbatches) if layout.pp > 1 else 1
    per_token = (layers / layout.pp) * (10 * model.hidden_size + 3 * model.intermediate_size / layout.tp)
    logits = 3 * model.vocab_size / (1 if model.tie_word_embeddings else layout.tp)
    activations = micro * width * in_flight * (per_token + logits) * step.act_bytes
    return (state + gen_copy + kv_cache + activations) / GB


def project_step(model: ModelConfig, step: StepShape, layout: Layout, lengths: TokenLengths, rates: ComputeRates,
                 links: Links, contention: float = 1.0) -> StepEstimate:
    """The step of ``layout`` (its ``rows`` per data-parallel rank) with compute at ``rates`` and collectives
    over ``links``."""
    collectives = step_collectives(model, step, layout)
    comm: dict[str, float] = {}
    sent: dict[str, float] = {}
    crossing = 0.0
    for c in collectives:
        comm[c.kind] = comm.get(c.kind, 0.0) + collective_seconds(c, links, layout.ranks_per_node)
        sent[c.kind] = sent.get(c.kind, 0.0) + c.sent_bytes
        if c.group.crosses_nodes:  # a ring crosses each node boundary once; `share` such streams at a time
            crossing += c.sent_bytes * c.group.share
    compute = compute_seconds(model, step, layout, lengths, rates, contention)
    tokens = layout.dp * step.rows * (lengths.prompt + lengths.response)
    estimate = StepEstimate(compute, comm, sent, tokens, layout.world + layout.rollout_workers,
                            device_memory_gb(model, step, layout), collectives=collectives)
    if estimate.step_s > 0 and layout.nodes > 1:
        estimate.node_link_bytes_per_s = crossing / estimate.step_s  # one direction of each node's link
    return estimate
