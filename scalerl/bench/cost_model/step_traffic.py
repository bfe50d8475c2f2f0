"""The collectives one RL step issues on each rank, by kind, as scalerl's layouts run them: what the cost
model times. Bytes follow `scalerl.comm.counting.accounting` (docs/comm-accounting.md), counts follow the code:

- ``grad``: DDP (plain replication only) all-reduces the whole gradient once per optimizer step
  (compression: the bytes it sends). Every other data-parallel layout runs FSDP2 on the (dp_replicate,
  dp_shard) mesh: each unit (decoder layers + the root) is reduce-scattered over ``dp_shard`` and its shard
  all-reduced over ``dp_replicate`` after every micro-batch's backward (once per optimizer step for a
  pipeline stage); a tied embedding split over pipeline stages sums its gradient over ``pp`` once per
  optimizer step.
- ``param``: FSDP all-gathers every decoder layer in each training forward and its backward re-gather, and
  once per forward-only pass and per generation (the units stay gathered through a pass's micro-batches and
  the decode steps: `scalerl.parallel.fsdp_generation`); the root (embedding, norm, head) stays gathered
  from a forward to its backward: once per training micro-batch, pass and generation.
- ``tp``: per decoder layer, 2 all-reduces of the hidden states in forward (o and down projections) and 2
  in backward (the attention and MLP blocks' input gradients: q/k/v's and gate/up's partial gradients are
  summed before one all-reduce per block); an untied head split by vocabulary all-gathers the logits.
- ``pp``: each micro-batch's activations forward and their gradients backward at every stage boundary,
  padded to the fixed widths; ``rollout``: the pipeline ranks' shares of the generation exchanged (each
  generates 1/pp of the rows); ``weight_sync``: the full replica refreshed from the stages once per step
  (one broadcast per tensor), or, with standalone rollout workers, the weights pushed to them.
- ``sequence``: Ulysses sequence parallelism (``sp``): per decoder layer, 4 all-to-alls (q, k, v in; the
  attention output back) in every forward and 4 in every backward, and one all-gather of float32 per-token
  results per forward (2 a token in the policy loss, 1 in a log-prob or value pass; the head runs on each
  rank's shard), over the sp ranks (`scalerl.parallel.sequence_parallel.sequence_parallel_bytes`);
  gradients are then reduced over ``dp x sp`` (DDP's group, or FSDP2's shard group ``dp_shard x sp``).
  Generation runs unsplit (no sequence traffic).
- ``metrics``: small control collectives (metric reduction, token counts per mini-batch, finish votes
  every 4 decode steps, gradient-norm partial sums); latency-bound.

A group's placement follows `scalerl.parallel.mesh`: ranks node by node, mesh dims (pp, dp_replicate,
dp_shard, sp, tp) with tp innermost, so a dimension's group lies inside a node, or spans nodes with ``share``
of its groups crossing each node's link at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from scalerl.bench.cost_model.collective_cost import sent_bytes
from scalerl.models.config import ModelConfig
from scalerl.parallel.sequence_parallel import sequence_parallel_bytes
from scalerl.perf.flops import decoder_layer_tensor_count, decoder_param_count
from scalerl.rollout.engines.builtin import FINISH_CHECK_EVERY_CPU
from scalerl.rollout.sources import (
    MIN_ROWS_PER_PIPELINE_RANK,  # the behaviour modelled, defined by the code
)
from scalerl.rollout.worker.messages import header_bytes
from scalerl.rollout.worker.protocol import OUTPUT_TENSOR_DIMS

# Megatron's count, as scalerl/parallel/tensor_parallel.py lays TP out: a row-parallel output all-reduce per block
# forward (attention, MLP), one input-gradient all-reduce per block backward.
TP_ALL_REDUCES_FORWARD, TP_ALL_REDUCES_BACKWARD = 2, 2
ROLLOUT_HEADER_BYTES = header_bytes(OUTPUT_TENSOR_DIMS)  # a generation output's tensor-message header


@dataclass(frozen=True)
class StepShape:
    """The work of one step on one data-parallel rank (sequences it generates and trains on)."""

    rows: int  # sequences per DP rank (prompts x n / dp)
    prompt_len: float  # padded prompt width during generation
    response_len: float  # decode steps (the longest response)
    train_width: float  # padded width of a training micro-batch
    micro_rows: int  # sequences per micro-batch
    mini_rows: int  # sequences per optimizer step, this rank's share
    epochs: int = 1
    forward_passes: int = 0  # forward-only passes over the batch (recomputed old log-probs, reference)
    pp_width: int = 0  # pipeline: fixed padded width (max prompt + max new tokens)
    pp_microbatches: int = 4
    act_bytes: int = 4  # activation element size (fp32; 2 under bf16 autocast)
    param_bytes: int = 4  # parameter / gradient element size
    # rounds of decode steps: the rows a rank generates over the rows its engine decodes at once
    # (rollout.max_num_seqs: each round pays every decode step's fixed cost, on a GPU the weights read once per
    # step, again; `step_projection.compute_seconds`)
    decode_waves: int = 1

    @property
    def micro_batches(self) -> int:
        return self.epochs * math.ceil(self.rows / self.micro_rows)

    @property
    def optimizer_steps(self) -> int:
        return self.epochs * math.ceil(self.rows / self.mini_rows)


@dataclass(frozen=True)
class Layout:
    """How ranks are arranged: the mesh sizes and the nodes they sit on."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    sp: int = 1  # Ulysses sequence parallelism inside each data-parallel replica
    ranks_per_node: int = 1
    backend: str = "gloo"
    grad_ratio: float = 1.0  # bytes gradient reduction sends / dense (compression)
    allreduce: str = "flat"  # or "hierarchical" (DDP across nodes)
    rollout_workers: int = 0  # standalone workers, on a node of their own
    weight_sync_ratio: float = 1.0  # bytes a sync sends / a full push (delta sync)
    rollout_param_bytes: int = 4  # rollout.dtype element size

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.sp * self.tp * self.pp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.world / self.ranks_per_node))

    def size_and_stride(self, dim: str) -> tuple[int, int]:
        order = ("pp", "dp_replicate", "dp_shard", "sp", "tp")
        sizes = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "sp": self.sp,
                 "tp": self.tp, "dp": self.dp}
        if dim == "dp":
            return self.dp, self.sp * self.tp
        if self.sp > 1 and dim == "dp_shard" and self.dp_shard > 1:  # FSDP2 shards over (dp_shard, sp)
            return self.dp_shard * self.sp, self.tp
        if self.sp > 1 and dim == "dp_replicate" and self.dp_shard == 1:  # DDP over (dp_replicate, sp)
            return self.dp_replicate * self.sp, self.tp
        inner = order[order.index(dim) + 1:]
        return sizes[dim], math.prod(sizes[d] for d in inner)

    def placement(self, dim: str) -> GroupPlacement:
        """Where a group of ``dim`` lies: its size, nodes spanned and concurrent groups per node link."""
        size, stride = self.size_and_stride(dim)
        rpn = self.ranks_per_node
        if size <= 1 or stride * size <= rpn:
            return GroupPlacement(size, nodes=1, share=1)
        if stride >= rpn:
            return GroupPlacement(size, nodes=size, share=rpn)  # one member per node, every local rank a group
        per_node = rpn // stride
        return GroupPlacement(size, nodes=max(1, size // per_node), share=stride)


@dataclass(frozen=True)
class GroupPlacement:
    size: int
    nodes: int
    share: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class Collective:
    """``count`` collectives of one kind and op, each of ``payload_bytes``, over a group of ``group`` ranks."""

    kind: str
    op: str
    payload_bytes: float
    count: float
    group: GroupPlacement
    backend: str = "gloo"
    hierarchical: bool = False
    per_rank_fraction: float = 1.0  # the share of ranks that issue it (a send from one stage of several)
    pipelined: bool = False  # back-to-back from one sender with no reduction between: latencies overlap
    time_fraction: float | None = None  # share of its time on the step's critical path (default: per rank)
    extra: dict = field(default_factory=dict)

    @property
    def sent_bytes(self) -> float:
        """Bytes the mean rank sends for all ``count`` of them."""
        return self.count * self.per_rank_fraction * sent_bytes(self.op, self.payload_bytes, self.group.size,
                                                                self.backend)


def stage_params(model: ModelConfig, layout: Layout) -> float:
    """Parameters one rank holds before data-parallel sharding: its pipeline stage, split by TP."""
    return decoder_param_count(model) / (layout.pp * layout.tp)


def root_params(model: ModelConfig) -> int:
    """Parameters of the FSDP root unit: the embedding, the final norm and (untied) the output head."""
    embedding = model.vocab_size * model.hidden_size
    return embedding * (1 if model.tie_word_embeddings else 2) + model.hidden_size


def step_collectives(model: ModelConfig, step: StepShape, layout: Layout) -> list[Collective]:
    """Every collective of one step on one (mean) trainer rank."""
    out: list[Collective] = []
    be, layers = layout.backend, model.num_hidden_layers // layout.pp
    p_bytes = stage_params(model, layout) * step.param_bytes
    units = layers + 1  # FSDP: each decoder layer, then the root (embedding, norm, head)
    # prefill makes the first token, then one forward per decode step; standalone workers generate elsewhere
    gen_forwards = 0.0 if layout.rollout_workers else step.response_len
    train_forwards = step.micro_batches
    fwd_only = step.forward_passes * math.ceil(step.rows / step.micro_rows)  # their micro-batches
    dp_rep, dp_shard = layout.placement("dp_replicate"), layout.placement("dp_shard")
    if layout.dp > 1 and (layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1):
        # FSDP2 on the (dp_replicate, dp_shard) mesh; a pipeline stage syncs once per optimizer step
        unit = p_bytes / units
        syncs = step.optimizer_steps if layout.pp > 1 else train_forwards
        if layout.dp_shard > 1 and layout.pp > 1:
            # The schedule keeps a stage's layers gathered from a backward to the next forward and reshards
            # them only after the last backward: per optimizer step each layer is gathered m + 1 times (m
            # micro-batches, any of GPipe / 1F1B; measured: 2 stages x 4 micro-batches), the root once.
            # A stage's root is its share of the embedding, final norm and head (a tied head is a copy).
            root = (2 * model.vocab_size * model.hidden_size + model.hidden_size) / (layout.pp * layout.tp)
            root *= step.param_bytes
            layer_unit = (p_bytes - root_params(model) / (layout.pp * layout.tp) * step.param_bytes) / layers
            out.append(Collective("param", "all_gather", layer_unit,
                                  step.optimizer_steps * (step.pp_microbatches + 1) * layers, dp_shard, be))
            out.append(Collective("param", "all_gather", root, step.optimizer_steps, dp_shard, be))
            # refreshing the generation replica gathers each sharded stage whole first
            out.append(Collective("weight_sync", "all_gather", p_bytes, 1, dp_shard, be))
        elif layout.dp_shard > 1:
            # Layers: every training forward and its backward's re-gather, once per forward-only pass (old /
            # reference log-probs, values: gathered for the whole pass) and once per generation. The root
            # stays gathered from a forward to its backward: once per training micro-batch, pass and generation.
            root = root_params(model) / layout.tp * step.param_bytes
            layer_unit = (p_bytes - root) / layers
            once = step.forward_passes + min(gen_forwards, 1.0)
            out.append(Collective("param", "all_gather", layer_unit, (2 * train_forwards + once) * layers, dp_shard, be))
            out.append(Collective("param", "all_gather", root, train_forwards + once, dp_shard, be))
        if layout.dp_shard > 1:
            out.append(Collective("grad", "reduce_scatter", unit * layout.grad_ratio, syncs * units, dp_shard, be))
        if layout.dp_replicate > 1:
            out.append(Collective("grad", "all_reduce", unit / dp_shard.size * layout.grad_ratio, syncs * units,
                                  dp_rep, be))
    elif layout.dp_replicate * layout.sp > 1:  # DDP: plain replication, one bucketed all-reduce per optimizer step
        hierarchical = layout.allreduce == "hierarchical" and dp_rep.crosses_nodes and layout.ranks_per_node > 1
        out.append(Collective("grad", "all_reduce", p_bytes * layout.grad_ratio, step.optimizer_steps, dp_rep, be,
                              hierarchical=hierarchical))
    if layout.tp > 1:
        out += _tensor_parallel(model, step, layout, layers, gen_forwards, fwd_only)
    if layout.pp > 1:
        out += _pipeline(model, step, layout, p_bytes)
    if layout.sp > 1:
        out += _sequence_parallel(model, step, layout, fwd_only)
    if layout.rollout_workers:
        full = decoder_param_count(model) * layout.rollout_param_bytes * layout.weight_sync_ratio
        # trainer rank 0 pushes to every worker (on a node of their own when the trainer spans nodes); the
        # metric is the mean over trainer ranks
        worker_group = GroupPlacement(2, nodes=2 if layout.nodes > 1 else 1, share=1)
        out.append(Collective("weight_sync", "send", full, layout.rollout_workers, worker_group, be,
                              per_rank_fraction=1 / layout.world, pipelined=True, time_fraction=1.0))
    out += _control(step, layout, gen_forwards)
    return out


def _tensor_parallel(model: ModelConfig, step: StepShape, layout: Layout, layers: int, gen_forwards: float,
                     fwd_only: int) -> list[Collective]:
    be, h, tp = layout.backend, model.hidden_size, layout.placement("tp")
    micro_tokens = step.micro_rows * step.train_width
    per_layer_train = TP_ALL_REDUCES_FORWARD + TP_ALL_REDUCES_BACKWARD
    out = [
        Collective("tp", "all_reduce", micro_tokens * h * step.act_bytes, step.micro_batches * per_layer_train * layers,
                   tp, be),
        Collective("tp", "all_reduce", micro_tokens * h * step.act_bytes, fwd_only * TP_ALL_REDUCES_FORWARD * layers,
                   tp, be),
        Collective("tp", "all_reduce", step.rows * step.prompt_len * h * step.act_bytes, TP_ALL_REDUCES_FORWARD * layers,
                   tp, be),  # prefill
        Collective("tp", "all_reduce", step.rows * h * step.act_bytes,
                   max(0.0, gen_forwards - 1) * TP_ALL_REDUCES_FORWARD * layers, tp, be),  # decode steps
    ]
    if not model.tie_word_embeddings:  # the vocabulary-split head gathers the logits in every forward
        v = model.vocab_size * step.act_bytes
        out.append(Collective("tp", "all_gather", micro_tokens * v, step.micro_batches + fwd_only, tp, be))
        out.append(Collective("tp", "all_gather", step.rows * v, gen_forwards, tp, be))
    return out


def _sequence_parallel(model: ModelConfig, step: StepShape, layout: Layout, fwd_only: int) -> list[Collective]:
    """Ulysses' all-to-alls and per-token gathers on a training micro-batch (forward and backward; the policy
    loss gathers 2 results a token, log-prob and entropy) and on each forward-only pass's micro-batches (1 a
    token: log-probs or values); the width is padded up to a multiple of sp, as the code does."""
    s, be, sp = layout.sp, layout.backend, layout.placement("sp")
    width = math.ceil(step.train_width / s) * s
    layers = model.num_hidden_layers

    def payload(backward: bool) -> dict[str, float]:
        return sequence_parallel_bytes(step.micro_rows, width, model.num_attention_heads, model.num_key_value_heads,
                                       model.head_dim, layers, s, outputs_per_token=2 if backward else 1,
                                       element_bytes=step.act_bytes, backward=backward)

    train, forward = payload(True), payload(False)
    return [Collective("sequence", "all_to_all", train["all_to_all"] / (8 * layers), 8 * layers * step.micro_batches,
                       sp, be),
            Collective("sequence", "all_to_all", forward["all_to_all"] / (4 * layers), 4 * layers * fwd_only, sp, be),
            Collective("sequence", "all_gather", train["all_gather"], step.micro_batches, sp, be),
            Collective("sequence", "all_gather", forward["all_gather"], fwd_only, sp, be)]


def _pipeline(model: ModelConfig, step: StepShape, layout: Layout, p_bytes: float) -> list[Collective]:
    be, k = layout.backend, layout.pp
    pp = layout.placement("pp")
    width = step.pp_width or step.train_width
    micro = step.mini_rows / step.pp_microbatches
    activation = micro * width * model.hidden_size * step.act_bytes
    boundary_sends = step.optimizer_steps * step.pp_microbatches  # per mini-batch, every micro-batch
    full = decoder_param_count(model) * step.param_bytes / layout.tp
    tensors = decoder_layer_tensor_count(model) * model.num_hidden_layers + 2
    out = [
        # each of the k-1 boundaries: one forward send and one backward send per micro-batch, over k ranks
        Collective("pp", "send", activation, 2 * boundary_sends,
                   GroupPlacement(2, nodes=2 if pp.crosses_nodes else 1, share=pp.share), be,
                   per_rank_fraction=(k - 1) / k, pipelined=True),
        Collective("weight_sync", "broadcast", full / tensors, tensors, pp, be, pipelined=True),
    ]
    if not layout.rollout_workers and step.rows >= MIN_ROWS_PER_PIPELINE_RANK * k:
        # generation is split over the pipeline ranks' replicas; each broadcasts its rows' outputs to the
        # others: prompt and response ids and masks (int64), log-probs (fp32), policy versions (int32), a stop
        # flag, and the header
        per_row = 16 * step.prompt_len + 24 * step.response_len + 1
        out.append(Collective("rollout", "broadcast", step.rows / k * per_row + ROLLOUT_HEADER_BYTES, k, pp, be))
    if model.tie_word_embeddings:  # the embedding and the head live on the first and last stage
        emb = model.vocab_size * model.hidden_size * step.param_bytes / layout.tp
        out.append(Collective("grad", "all_reduce", emb, step.optimizer_steps, pp, be))
    return out


def _control(step: StepShape, layout: Layout, gen_forwards: float) -> list[Collective]:
    """Latency-bound control traffic: metric reduction, mini-batch token counts, finish votes."""
    if layout.world <= 1:
        return []
    world = GroupPlacement(layout.world, nodes=layout.nodes, share=1)
    dp = layout.placement("dp")
    out = [Collective("metrics", "all_gather", 8 * 64 * layout.world, 1, world, layout.backend),
           Collective("metrics", "all_reduce", 4, math.ceil(gen_forwards / FINISH_CHECK_EVERY_CPU), world,
                      layout.backend)]
    if layout.dp > 1:
        out.append(Collective("metrics", "all_reduce", 8, step.optimizer_steps, dp, layout.backend))
    if layout.dp_shard > 1 or layout.tp > 1 or layout.pp > 1:
        out.append(Collective("metrics", "all_reduce", 4, step.optimizer_steps, world, layout.backend))
    return out


def bytes_by_kind(collectives: list[Collective]) -> dict[str, float]:
    """Bytes the mean rank sends per step, by kind (comparable with ``comm/bytes/<kind>``)."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0.0) + c.sent_bytes
    return out
