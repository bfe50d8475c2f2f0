"""FLOPs per token of a built-in decoder (any architecture of `scalerl.models.config`), the device's peak FLOP/s, and model FLOPs utilization.

Formula (the one used by PaLM, Appendix B; Megatron-LM, Narayanan et al. 2021, Sec. 5.1; and verl's
``flops_counter``), per token and with ``s`` the context length a token attends over:

    N_matmul         = L * (H*(n_q*d) + 2*H*(n_kv*d) + (n_q*d)*H + 3*H*I) + H*V
    train FLOPs/tok  = 6 * N_matmul + 12 * L * (n_q*d) * s
    forward FLOPs/tok = 2 * N_matmul +  4 * L * (n_q*d) * s

``N_matmul`` counts the weights of every matrix multiply: q/k/v/o (k and v have GQA shapes), the SwiGLU
gate/up/down projections and the lm_head, which is a matmul whether or not it is tied to the embedding.
A sparse MoE layer counts the weights a token is multiplied by (its active parameters): the router, its
``num_experts_per_tok`` experts and the shared expert with its gate, never all ``num_experts``.
The input embedding (a lookup), norms and biases cost no matmul FLOPs and are left out. The attention term
is QK^T plus AV, 2 * (n_q*d) * s multiply-adds each per layer; the backward pass costs twice the forward.
No causal halving is applied: like PaLM and verl, every token is counted as attending to all ``s``
positions. Pass the full sequence length to match their MFU numbers, or ``s/2`` to count causal work only.
"""

from __future__ import annotations

import time

import torch

from scalerl.models.config import ModelConfig
from scalerl.models.moe import is_sparse_layer


def _mlp_has_bias(cfg: ModelConfig) -> bool:
    # HF Llama's `mlp_bias`; ModelConfig keeps unmodelled HF fields in `extra`.
    return bool(cfg.extra.get("mlp_bias", False))


def matmul_param_count(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul per token: attention and MLP projections plus lm_head."""
    hidden, heads_dim = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    attention = hidden * heads_dim + 2 * hidden * kv_dim + heads_dim * hidden
    sparse = _sparse_layer_count(cfg)
    mlp = (cfg.num_hidden_layers - sparse) * 3 * hidden * cfg.intermediate_size
    mlp += sparse * _moe_mlp_params(cfg, cfg.num_experts_per_tok)
    return cfg.num_hidden_layers * attention + mlp + hidden * cfg.vocab_size


def _sparse_layer_count(cfg: ModelConfig) -> int:
    return sum(is_sparse_layer(cfg, i) for i in range(cfg.num_hidden_layers))


def _moe_mlp_params(cfg: ModelConfig, experts: int) -> int:
    """Weights of a sparse MoE block's router, ``experts`` routed experts and shared expert (with its gate)."""
    hidden, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
    return hidden * cfg.num_experts + experts * 3 * hidden * cfg.moe_intermediate_size + \
        (3 * hidden * shared + hidden if shared else 0)


def decoder_param_count(cfg: ModelConfig) -> int:
    """Total parameters, equal to ``sum(p.numel())`` of the HF model built from the same config.

    Bias layout follows HF: Qwen2 puts biases on q/k/v only; Llama with ``attention_bias`` puts them on
    q/k/v/o. A tied lm_head shares the embedding's weight and adds nothing.
    """
    hidden = cfg.hidden_size
    heads_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_key_value_heads * cfg.head_dim
    per_layer = hidden * heads_dim + 2 * hidden * kv_dim + heads_dim * hidden + 3 * hidden * cfg.intermediate_size
    per_layer += (4 if cfg.traits.gemma_norms else 2) * hidden  # RMSNorm weights around the blocks
    if cfg.traits.qk_norm:
        per_layer += 2 * cfg.head_dim
    if cfg.attention_bias:
        per_layer += heads_dim + 2 * kv_dim
        if not cfg.traits.qkv_bias_only:
            per_layer += hidden  # o_proj bias
    if _mlp_has_bias(cfg):
        per_layer += 2 * cfg.intermediate_size + hidden
    embedding = cfg.vocab_size * hidden
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * hidden
    sparse = _sparse_layer_count(cfg)  # each holds all its experts in place of the dense MLP
    moe = sparse * (_moe_mlp_params(cfg, cfg.num_experts) - 3 * hidden * cfg.intermediate_size)
    return cfg.num_hidden_layers * per_layer + moe + embedding + lm_head + hidden  # + final norm


def decoder_layer_tensor_count(cfg: ModelConfig) -> int:
    """Parameter tensors of one decoder layer (q/k/v/o, gate/up/down, two norms, and the biases the config
    has), equal to ``len(list(layer.parameters()))`` of the built model: what a per-tensor copy moves.
    For a MoE model it is a dense layer's count (sparse layers hold ``3 * num_experts + 1`` MLP tensors, plus
    4 with a shared expert)."""
    count = 4 + 3 + (4 if cfg.traits.gemma_norms else 2) + (2 if cfg.traits.qk_norm else 0)
    if cfg.attention_bias:
        count += 3 + (0 if cfg.traits.qkv_bias_only else 1)
    if _mlp_has_bias(cfg):
        count += 3
    return count


def _attention_flops_per_token(cfg: ModelConfig, seq_len: float) -> float:
    """Forward FLOPs of QK^T and AV for one token attending over ``seq_len`` positions, all layers; a
    sliding-window layer attends over at most its window."""
    attended = sum(min(seq_len, cfg.layer_window(i) or seq_len) for i in range(cfg.num_hidden_layers))
    return 4.0 * cfg.num_attention_heads * cfg.head_dim * attended


def flops_per_token(cfg: ModelConfig, seq_len: float) -> float:
    """Training (forward + backward) FLOPs per token: ``6 * N_matmul + 12 * L * n_q * d * seq_len``."""
    return 6.0 * matmul_param_count(cfg) + 3.0 * _attention_flops_per_token(cfg, seq_len)


def forward_flops_per_token(cfg: ModelConfig, seq_len: float) -> float:
    """Forward-only FLOPs per token (generation, reference log-probs): ``2 * N_matmul + 4 * L * n_q * d * s``.

    With a KV cache a token at position t attends over t positions, so for decoding pass the mean
    context length rather than the final one.
    """
    return 2.0 * matmul_param_count(cfg) + _attention_flops_per_token(cfg, seq_len)


# Dense (no sparsity) tensor-core peaks in FLOP/s, from the vendors' datasheets: NVIDIA A100, H100, H200,
# L40S, L40, L4, A10 datasheets, the Ada (RTX 4090) architecture whitepaper, AMD Instinct MI300X datasheet.
# Matched in order as substrings of `torch.cuda.get_device_name()`, so more specific names come first.
# Columns: 16-bit (bf16/fp16), tf32 (fp32 matmuls when TF32 is allowed), plain fp32.
_CUDA_PEAK_FLOPS: tuple[tuple[str, float, float, float], ...] = (
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100 PCIe", 756e12, 378e12, 51.2e12),
    ("H100", 989.4e12, 494.7e12, 66.9e12),  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    ("H800", 989.4e12, 494.7e12, 66.9e12),
    ("H200", 989.4e12, 494.7e12, 66.9e12),  # same compute as H100 SXM, more memory
    ("A100", 312e12, 156e12, 19.5e12),
    ("A800", 312e12, 156e12, 19.5e12),
    ("L40S", 362.05e12, 183.2e12, 91.6e12),
    ("L40", 181.05e12, 90.5e12, 90.5e12),
    ("L4", 121e12, 60e12, 30.3e12),
    ("A10", 125e12, 62.5e12, 31.2e12),  # also matches A10G
    ("RTX 4090", 165.2e12, 82.6e12, 82.6e12),  # bf16 with fp32 accumulate
    ("MI300X", 1307.4e12, 653.7e12, 163.4e12),
)

_MEASURED_PEAK_CACHE: dict[tuple[str, torch.dtype, int], float] = {}


def _table_peak_flops(device_name: str, dtype: torch.dtype, tf32_allowed: bool) -> float | None:
    for name, half, tf32, fp32 in _CUDA_PEAK_FLOPS:
        if name in device_name:
            if dtype in (torch.bfloat16, torch.float16):
                return half
            if dtype == torch.float32:
                return tf32 if tf32_allowed else fp32
            return None
    return None


def datasheet_peak_flops(device_name: str, dtype: torch.dtype = torch.bfloat16) -> float:
    """The datasheet peak of a GPU named like ``"H100"`` or ``"NVIDIA A100-SXM4-80GB"`` for ``dtype`` (fp32 as
    plain fp32, not TF32): what projections to devices nobody measured here use."""
    peak = _table_peak_flops(device_name.upper(), dtype, tf32_allowed=False)
    if peak is None:
        known = ", ".join(name for name, *_ in _CUDA_PEAK_FLOPS)
        raise KeyError(f"no datasheet peak for {device_name!r}; known: {known}")
    return peak


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, repeats: int = 5) -> float:
    """Best observed FLOP/s of ``size``-square matmuls on ``device`` (one warm-up, then ``repeats`` timed)."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    with torch.no_grad():
        torch.mm(a, b)
        synchronize()
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b)
            synchronize()
            best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def _probe_size(device: torch.device, dtype: torch.dtype) -> int:
    """Matrix size for the peak measurement: 4096 on GPUs (a 1024 matmul cannot keep one busy); on CPUs
    up to 1024, stopping early where a dtype has no fast kernels (fp16 on many CPUs runs at ~1 GFLOP/s,
    so a 1024 matmul would take seconds)."""
    if device.type == "cuda":
        return 4096
    size = 256
    while size < 1024:
        a = torch.randn(size, size, device=device).to(dtype)
        torch.mm(a, a)  # the first call pays one-time costs (thread pool, kernel choice)
        start = time.perf_counter()
        torch.mm(a, a)
        if time.perf_counter() - start > 0.02:
            break
        size *= 2
    return size


def device_peak_flops(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Peak matmul FLOP/s of one device for ``dtype``.

    CUDA GPUs in the datasheet table get the datasheet number; other devices (CPUs, unknown GPUs) get a
    measured best-of-five square matmul, cached per (device, dtype, torch thread count) in this process.
    A measured peak is what the device actually reaches, so MFU against it reads higher than against a
    datasheet number.
    """
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = _table_peak_flops(name, dtype, tf32_allowed=torch.backends.cuda.matmul.allow_tf32)
        if peak is not None:
            return peak
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _MEASURED_PEAK_CACHE:
        _MEASURED_PEAK_CACHE[key] = measure_matmul_flops(device, dtype, size=_probe_size(device, dtype))
    return _MEASURED_PEAK_CACHE[key]
