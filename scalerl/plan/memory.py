"""Peak memory of one rank in each phase of an RL step, split into its parts.

What every phase holds (the persistent state): the rank's share of the parameters (FSDP: 1/(dp_shard x sp)
of each, and 1/(tp x pp)), the AdamW moments (two per trainable parameter, in the parameter's dtype: torch
keeps them so; float32 for float32 models and for LoRA adapters), a frozen reference copy when the loss or
the reward takes a KL (none under LoRA: the base model with the adapters off is the reference), and DDP's
gradient buckets (torch's DDP with ``gradient_as_bucket_view=False``, as scalerl builds it, keeps one
bucket copy of the gradients from the first backward on). Gradients are freed by ``zero_grad(set_to_none)``
after each optimizer step, so only the update holds them. Then, per phase:

| phase | adds |
| --- | --- |
| generation | FSDP: the full model gathered in the compute dtype, on the CPU twice (the all-gather's output is not reused: `scalerl.parallel.fsdp_generation`); the KV cache, rows decoding at once x (prompt + new tokens) x layers x kv heads x head dim x 2 x bytes; the prefill's activations of one layer and the last position's logits |
| old / reference log-prob | FSDP: two gathered layers and the root (twice on the CPU); one micro-batch's forward: one layer's activations and the logits (float32) with their log-softmax |
| update | gradients, and one layer's gradients in flight (computed, then added into the accumulated ones); FSDP: gathered units; the activations saved for backward (with activation checkpointing: each layer's input, plus one layer recomputed) and the logits x 3 (float32 logits, log-softmax, their gradient) |
| weight sync | colocated built-in engine: its decode copy laid out again in place, one fused matrix (q/k/v or gate/up) concatenated at a time; standalone workers: the bucket gathered in rollout.dtype and its encoding; delta mode: the source rank's snapshot of what the workers hold (the whole model in rollout.dtype) |
| checkpoint save | safetensors serialises the model's state into one buffer: the rank's parameters once more (host memory) |
| evaluation | generation of the validation rows (up to 256 at once), greedy |

Activations per token come from the decoder itself: one and two layers of the config are built on the meta
device and run under ``saved_tensors_hooks``; the difference is what one layer saves for backward at that
width (exact for scalerl's decoder in float32; halved for 16-bit autocast). On the CPU every phase also
holds the process's runtime (Python, torch, the data, the tokenizer, the kernels' code once paged in):
measured here by `timing` in a fresh process that imports the trainer, builds the run's data and runs two
steps of the run on a 32-wide model. What glibc keeps of memory freed inside a phase is not counted; the
trainer gives it back at the switch to generation (`scalerl.perf.memory.release_host_memory`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from scalerl.bench.cost_model.step_traffic import Layout
from scalerl.models.config import ModelConfig
from scalerl.perf.flops import decoder_param_count

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8,
               "fp8": 1}
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EVAL_CHUNK_ROWS = 256  # `scalerl.trainer.evaluation`'s batch_size: rows one generate call takes
PHASES = ("generation", "old_log_prob", "ref_log_prob", "update", "weight_sync", "checkpoint_save", "evaluation")


@dataclass(frozen=True)
class PlanSetup:
    """What the plan needs from a config and a cluster (per data-parallel rank unless said)."""

    model: ModelConfig
    layout: Layout  # the trainer ranks' mesh, rollout workers, ranks per node
    rows: int  # sequences each trainer DP rank generates and trains on per step
    prompt_width: int  # data.max_prompt_length: the widest a prompt may be (pipeline stages pad to it)
    new_tokens: int  # rollout.max_new_tokens; a multi-turn agent's episode budget after the prompt
    micro_rows: int
    mini_rows: int  # sequences per optimizer step on this rank
    prompt_len: float = 0.0  # mean real prompt length (time); 0 = prompt_width
    response_len: float = 0.0  # mean decode steps (time); 0 = new_tokens
    micro_max_tokens: int = 0  # actor.micro_batch_max_tokens (0 = fixed micro_rows)
    epochs: int = 1
    old_pass: bool = False  # old log-probs recomputed (a forward pass over the batch)
    reference: bool = False  # a frozen reference model and its log-prob pass
    critic: bool = False
    param_bytes: int = 4  # model.dtype
    compute_bytes: int = 4  # what FSDP gathers in / autocast computes in
    act_bytes: int = 4
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("all-linear",)
    lora_base_bytes: int = 0  # model.lora.base_dtype (0 = param_bytes)
    activation_checkpointing: bool = False
    standalone: bool = False
    rollout_bytes: int = 4  # rollout.dtype
    weight_sync_mode: str = "delta"
    bucket_bytes: int = 64 * MIB
    max_num_seqs: int = 0
    eval_rows: int = 0  # validation rows of this rank (data.num_val x trainer.val_n / dp)
    export_bytes: int = 4
    runtime_bytes: float = 0.0  # CPU: the process's own RSS before any model state
    device: str = "cpu"
    longest_prompt: int = 0  # the longest prompt of the run's data, when known (0: prompt_width)
    staleness: int = 0  # rollout.staleness with standalone workers: generation overlaps the trainer's work
    # forward calls a row's generation takes at most, when fewer than new_tokens: a multi-turn agent decodes its
    # turns (max_turns x rollout.max_new_tokens) and prefills each environment answer in one call (0 = new_tokens)
    decode_calls: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def fsdp(self) -> bool:
        lay = self.layout
        return lay.dp_shard > 1 or ((lay.tp > 1 or lay.pp > 1) and lay.dp > 1)

    @property
    def ddp(self) -> bool:
        lay = self.layout
        return lay.dp > 1 and not self.fsdp and lay.tp == 1 and lay.pp == 1

    @property
    def shard(self) -> int:
        """How many ranks each parameter is split over."""
        lay = self.layout
        return lay.tp * lay.pp * (lay.dp_shard * lay.sp if lay.dp_shard > 1 else 1)

    @property
    def padded_prompt(self) -> int:
        """The prompt width a batch is padded to: its longest prompt (bounded by the data's longest when the data
        is known), except under pipeline parallelism, whose stages pad every batch to data.max_prompt_length."""
        if self.longest_prompt and self.layout.pp == 1:
            return min(self.prompt_width, self.longest_prompt)
        return self.prompt_width

    @property
    def decode_steps(self) -> int:
        return min(self.decode_calls or self.new_tokens, self.new_tokens)

    @property
    def train_width(self) -> int:
        return self.padded_prompt + self.new_tokens

    @property
    def micro_tokens(self) -> int:
        tokens = self.micro_rows * self.train_width
        return min(tokens, self.micro_max_tokens) if self.micro_max_tokens else tokens

    @property
    def generated_rows(self) -> int:
        """Rows one rank (a worker, when standalone) generates per step."""
        if self.standalone:
            return math.ceil(self.rows * self.layout.dp / max(1, self.layout.rollout_workers))
        return self.rows

    def decoding_at_once(self, rows: int) -> int:
        """Of ``rows`` given to the engine, how many decode at once (rollout.max_num_seqs; at least 1)."""
        return max(1, min(rows, self.max_num_seqs) if self.max_num_seqs else rows)

    @property
    def gen_rows(self) -> int:
        """Rows one rank (a worker, when standalone) decodes at once."""
        return self.decoding_at_once(self.generated_rows)

    def replace(self, **changes) -> PlanSetup:
        return dataclasses.replace(self, **changes)


def lora_param_count(cfg: ModelConfig, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters: r x (in + out) for every targeted linear layer of every decoder layer."""
    if rank <= 0:
        return 0
    hidden, q, kv, inter = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                            cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    chosen = LORA_MODULES if "all-linear" in targets else [m for m in LORA_MODULES
                                                            if any(t.endswith(m) for t in targets)]
    return cfg.num_hidden_layers * sum(rank * sum(shapes[m]) for m in chosen)


def _meta_saved_bytes(cfg: ModelConfig, layers: int, rows: int, width: int) -> int:
    """Bytes of the activations the decoder saves for backward (parameters left out) in a float32 forward of
    ``rows`` x ``width`` tokens, on the meta device (no memory, no compute)."""
    import torch

    from scalerl.models.decoder import CausalLM

    small = dataclasses.replace(cfg, num_hidden_layers=layers, layer_types=None)
    with torch.device("meta"):
        model = CausalLM(small)
    seen: dict[int, int] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if not (base.is_leaf and base.requires_grad):  # a parameter (or a view of one) is not an activation
            seen[id(base)] = base.numel() * base.element_size()
        return t

    ids = torch.zeros(rows, width, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, attention_mask=torch.ones(rows, width, dtype=torch.long, device="meta"))
    return sum(seen.values())


_LAYER_FITS: dict[str, tuple[float, float, float]] = {}


def _layer_fit(cfg: ModelConfig) -> tuple[float, float, float]:
    """(bytes per token, bytes per token per position attended, root bytes per token) one float32 layer saves:
    from two widths, one and two layers on the meta device (cached per architecture)."""
    key = repr(dataclasses.replace(cfg, num_hidden_layers=1, layer_types=None))
    if key not in _LAYER_FITS:
        _LAYER_FITS[key] = _fit_layer(cfg)
    return _LAYER_FITS[key]


def _fit_layer(cfg: ModelConfig) -> tuple[float, float, float]:
    if cfg.num_experts:  # a MoE layer's saved tensors depend on routing; the dense MLP's stand in
        cfg = dataclasses.replace(cfg, num_experts=0)
    points = {}
    for width in (16, 64):
        one, two = _meta_saved_bytes(cfg, 1, 1, width), _meta_saved_bytes(cfg, 2, 1, width)
        points[width] = ((two - one) / width, (one - (two - one)) / width)
    slope = (points[64][0] - points[16][0]) / 48
    return points[16][0] - slope * 16, slope, points[16][1]


def layer_activation_bytes(cfg: ModelConfig, tokens: float, width: float, act_bytes: int = 4) -> float:
    """What one decoder layer saves for backward over ``tokens`` tokens in sequences of ``width``."""
    per_token, per_position, _ = _layer_fit(cfg)
    return tokens * (per_token + per_position * width) * act_bytes / 4


def root_activation_bytes(cfg: ModelConfig, tokens: float, act_bytes: int = 4) -> float:
    """What the embedding, final norm and head save for backward (the logits are the loss's, counted apart)."""
    return tokens * _layer_fit(cfg)[2] * act_bytes / 4


def policy_counts(s: PlanSetup) -> tuple[int, int]:
    """(all parameters, trainable parameters) of the policy, LoRA adapters included."""
    base = decoder_param_count(s.model)
    adapters = lora_param_count(s.model, s.lora_rank, s.lora_targets)
    return base + adapters, (adapters if s.lora_rank > 0 else base)


def decode_layout_bytes(s: PlanSetup) -> float:
    """The built-in engine's decode layout on a colocated rank (`scalerl.models.decode_model.DecodeModel`):
    each layer's q/k/v, o, gate/up and down matrices and the LM head copied once more in the compute dtype,
    kept from the first generation on (0 where generation runs the model's own forward: sharded or
    tensor-parallel parameters, MoE and Gemma-style layers, and standalone workers, which hold their own)."""
    cfg, lay = s.model, s.layout
    traits = getattr(cfg, "traits", None)
    unfused = (cfg.num_experts or (traits is not None and (traits.gemma_norms or traits.scaled_embeddings))
               or cfg.rope_local_theta is not None or cfg.attn_logit_softcapping is not None
               or cfg.final_logit_softcapping is not None)
    if s.standalone or s.fsdp or lay.tp > 1 or unfused:
        return 0.0
    hidden, q, kv, inter = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim,
                            cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size)
    per_layer = hidden * (q + 2 * kv) + q * hidden + 2 * inter * hidden + inter * hidden
    return (cfg.num_hidden_layers * per_layer + cfg.vocab_size * hidden) * s.compute_bytes


def persistent_parts(s: PlanSetup) -> dict[str, float]:
    """Bytes every phase of a trainer rank holds."""
    total, trainable = policy_counts(s)
    base = total - (trainable if s.lora_rank > 0 else 0)
    base_bytes = (s.lora_base_bytes or s.param_bytes) if s.lora_rank > 0 else s.param_bytes
    trainable_bytes = 4 if s.lora_rank > 0 else s.param_bytes
    params = (base * base_bytes + (trainable * trainable_bytes if s.lora_rank > 0 else 0)) / s.shard
    parts = {"parameters": params,
             "optimizer": 2 * trainable * trainable_bytes / s.shard}
    if s.reference and s.lora_rank <= 0:
        parts["reference"] = base * s.param_bytes / s.shard
    if s.critic:  # a value model of the policy's size: weights, gradients' buckets aside, and two moments
        parts["critic"] = 3 * base * s.param_bytes / s.shard
    if s.ddp:
        parts["ddp_buckets"] = trainable * trainable_bytes
    if s.layout.pp > 1 and not s.standalone:  # every pipeline rank generates with a full replica of its own
        parts["generation_replica"] = total * s.param_bytes
    if decode_layout_bytes(s):
        parts["decode_layout"] = decode_layout_bytes(s)
    if s.runtime_bytes:
        parts["runtime"] = s.runtime_bytes
    return parts


# On the CPU (gloo, glibc's heap) FSDP2's gathered units take twice their size while unsharded: the all-gather's
# output, freed once copied into the parameters, is not reused for the next unit's. Measured on the 0.5B-shaped
# plan cell over 2 ranks: generation, which keeps every unit gathered, peaked 0.22 GiB above its sharded state
# for a 0.11 GiB model. A GPU's caching allocator reuses the freed output: once there.
def fsdp_gather_copies(s: PlanSetup) -> int:
    return 2 if s.device == "cpu" else 1


def _gathered_units(s: PlanSetup) -> float:
    """FSDP during a training or log-prob pass: the unit being run and the next one prefetched (two layers),
    plus the root (embedding, norm, head), gathered in the compute dtype (`fsdp_gather_copies` times)."""
    if not s.fsdp:
        return 0.0
    cfg = s.model
    total = decoder_param_count(cfg)
    root = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    layer = (total - root) / cfg.num_hidden_layers
    return fsdp_gather_copies(s) * min(total, 2 * layer + root) * s.compute_bytes / s.layout.tp


def kv_cache_bytes(cfg: ModelConfig, rows: int, length: int, kv_bytes: int, tp: int = 1) -> float:
    """rows x length x layers x kv heads x head dim x 2 (keys and values) x bytes, split over tensor ranks."""
    return rows * length * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * kv_bytes / tp


def _generation_parts(s: PlanSetup, rows: int, kv_bytes: int) -> dict[str, float]:
    cfg, lay = s.model, s.layout
    length = s.padded_prompt + s.new_tokens
    parts = {"kv_cache": kv_cache_bytes(cfg, rows, length, kv_bytes, lay.tp)}
    if s.fsdp:
        parts["gathered_weights"] = fsdp_gather_copies(s) * policy_counts(s)[0] * s.compute_bytes / lay.tp
    prefill = rows * s.padded_prompt
    parts["activations"] = (layer_activation_bytes(cfg, prefill, s.padded_prompt, s.act_bytes) / lay.tp
                            + 3 * rows * cfg.vocab_size * 4)  # the last position's logits, probabilities, sample
    return parts


def _logit_bytes(s: PlanSetup, tokens: float, copies: int) -> float:
    cfg = s.model
    split = 1 if cfg.tie_word_embeddings else s.layout.tp
    return copies * tokens * cfg.vocab_size * 4 / split


def phase_parts(s: PlanSetup) -> dict[str, dict[str, float]]:
    """Per phase (PHASES, those the setup runs), the parts of a trainer rank's peak, in bytes."""
    cfg, lay = s.model, s.layout
    base = persistent_parts(s)
    total, trainable = policy_counts(s)
    trainable_bytes = 4 if s.lora_rank > 0 else s.param_bytes
    layers = cfg.num_hidden_layers / lay.pp
    out: dict[str, dict[str, float]] = {}
    if not s.standalone:
        out["generation"] = {**base, **_generation_parts(s, s.gen_rows, s.compute_bytes)}
    tokens = s.micro_tokens / max(1, lay.sp)
    forward = {"gathered_weights": _gathered_units(s),
               "activations": layer_activation_bytes(cfg, tokens, s.train_width, s.act_bytes) / lay.tp,
               "logits": _logit_bytes(s, tokens, 2)}
    if s.old_pass:
        out["old_log_prob"] = {**base, **forward}
    if s.reference:
        out["ref_log_prob"] = {**base, **forward}
    one_layer = layer_activation_bytes(cfg, tokens, s.train_width, s.act_bytes) / lay.tp
    if s.activation_checkpointing:  # each layer's input kept, one layer's activations recomputed at a time
        saved = layers * tokens * cfg.hidden_size * s.act_bytes + one_layer
    else:
        saved = layers * one_layer
    in_flight = min(lay.pp, 4) if lay.pp > 1 else 1
    out["update"] = {**base, "gradients": trainable * trainable_bytes / s.shard,
                     "gradient_temporaries": gradient_temporary_bytes(s),
                     "gathered_weights": _gathered_units(s),
                     "activations": in_flight * (saved + root_activation_bytes(cfg, tokens, s.act_bytes)),
                     "logits": in_flight * _logit_bytes(s, tokens, 3)}
    if s.standalone:
        sync = {"weight_sync_buckets": sync_buffer_bytes(s)}
        if s.weight_sync_mode == "delta":
            sync["delta_snapshot"] = total * s.rollout_bytes
        if s.fsdp:
            sync["gathered_weights"] = s.bucket_bytes * s.compute_bytes / s.rollout_bytes
        out["weight_sync"] = {**base, **sync}
    if not s.standalone and decode_layout_bytes(s):  # laid out again in place: the old copy goes first
        cfg_q = cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_key_value_heads * cfg.head_dim
        # each fused matrix (q/k/v, gate/up) is concatenated plain before its kernel's layout is made from it
        out["weight_sync"] = {**base, "layout_rebuild": max(cfg_q, 2 * cfg.intermediate_size) * cfg.hidden_size
                              * s.compute_bytes}
    out["checkpoint_save"] = {**base, "checkpoint_spike": total * s.param_bytes / s.shard}
    if s.eval_rows:  # the same engine: at most rollout.max_num_seqs of a chunk decode at once
        rows = s.decoding_at_once(min(s.eval_rows, EVAL_CHUNK_ROWS))
        out["evaluation"] = {**base, **_generation_parts(s, rows, s.compute_bytes)}
    return {name: out[name] for name in PHASES if name in out}


def gradient_temporary_bytes(s: PlanSetup) -> float:
    """The backward's weight gradients in flight: autograd computes a weight's gradient into a new tensor and
    then adds it into ``.grad`` (every micro-batch after the first) or reduce-scatters it (FSDP), so one layer's
    unsharded gradients are alive at once beside the accumulated ones (measured on the 0.5B-shaped plan cell:
    a backward's peak 0.06 GiB above its live state, one layer's weights being 0.05 GiB); under FSDP twice
    that on the CPU, as they are copied into the reduce-scatter's flat input. None with a single micro-batch
    and no sharding (the first gradients are ``.grad`` themselves)."""
    cfg, lay = s.model, s.layout
    if s.micro_rows >= s.mini_rows and not s.fsdp:
        return 0.0
    total, trainable = policy_counts(s)
    root = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    layer = max(0.0, (total - root) / cfg.num_hidden_layers)
    if s.lora_rank > 0:  # only the adapters have gradients
        layer = trainable / cfg.num_hidden_layers
    copies = fsdp_gather_copies(s) if s.fsdp else 1
    return copies * layer * (4 if s.lora_rank > 0 else s.param_bytes) / lay.tp


def sync_buffer_bytes(s: PlanSetup) -> float:
    """The weight sync's two buckets (one being filled, one in flight), each at most the whole model in
    rollout.dtype: a model smaller than weight_sync.bucket_mb fills one bucket once."""
    return 2 * min(s.bucket_bytes, policy_counts(s)[0] * s.rollout_bytes)


def worker_parts(s: PlanSetup) -> dict[str, float]:
    """A standalone rollout worker's generation: its own copy in rollout.dtype, the KV cache, the receive
    bucket and (delta) its decode buffer."""
    cfg = s.model
    total = policy_counts(s)[0]
    length = s.padded_prompt + s.new_tokens
    parts = {"parameters": total * s.rollout_bytes,
             "kv_cache": kv_cache_bytes(cfg, s.gen_rows, length, s.rollout_bytes),
             "activations": layer_activation_bytes(cfg, s.gen_rows * s.padded_prompt, s.padded_prompt, s.rollout_bytes)
             + 3 * s.gen_rows * cfg.vocab_size * 4,
             "weight_sync_buckets": sync_buffer_bytes(s)}
    if s.runtime_bytes:
        parts["runtime"] = s.runtime_bytes
    return parts


def host_parts(s: PlanSetup, checkpoint_from_device: bool) -> dict[str, float]:
    """Host RAM per node beyond the processes' runtime: loading a model directory (safetensors pages, each
    rank's full file read once, shared by the node's ranks through the page cache) and export (rank 0 holds
    the full model in trainer.export_dtype), and on an accelerator the checkpoint's state copied to the host."""
    total = policy_counts(s)[0]
    parts = {"loading": total * s.param_bytes, "export": total * s.export_bytes}
    if checkpoint_from_device:
        parts["checkpoint_staging"] = total * s.param_bytes / s.shard * min(s.layout.ranks_per_node, s.layout.world)
    return parts


def total(parts: dict[str, float]) -> float:
    return sum(parts.values())
