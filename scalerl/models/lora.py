"""LoRA adapters on the decoder's linear layers, in PEFT's format.

`apply_lora` swaps each targeted ``nn.Linear`` for a `LoRALinear` that keeps the very same weight and bias
(frozen) and adds ``lora_A`` ([r, in], kaiming-uniform as PEFT) and ``lora_B`` ([out, r], zeros), so the
model starts equal to its base and the base's state-dict names do not change (checkpoints, weight plans and
shard loading read them as before); only the adapters stay trainable, so the optimizer holds their state
alone. It runs once, on the policy, before the layout is applied.

Names follow PEFT on a transformers model: targets match a module's HF name (``model.layers.0.self_attn.
q_proj``) whole or as a dotted suffix, ``all-linear`` is every linear layer of the decoder layers (so not
``lm_head``; routers and gates are not projections and stay out), and `save_adapter` / `load_adapter` write
and read ``adapter_config.json`` + ``adapter_model.safetensors`` with ``base_model.model.<hf name>.lora_A.
weight`` keys, which ``peft.PeftModel.from_pretrained`` loads onto the transformers model of the same base.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from scalerl.core.config import ConfigError
from scalerl.models.decoder import CausalLM
from scalerl.models.hf_checkpoint import _hf_name

ALL_LINEAR = "all-linear"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The projections `all-linear` adapts wherever they sit (attention, dense MLP, each expert, a shared expert).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_DTYPE = torch.float32  # adapters train in fp32 whatever the base is held in (PEFT's autocast default)


class LoRALinear(nn.Linear):
    """``base(x) + B(A(dropout(x))) * alpha / r``: the base's own weight and bias, frozen; A and B in fp32."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float,
                 generator: torch.Generator | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight.requires_grad_(False)
        self.bias = base.bias.requires_grad_(False) if base.bias is not None else None
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=ADAPTER_DTYPE)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=ADAPTER_DTYPE)
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        if device.type != "meta":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)  # PEFT's init
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        low_rank = self.lora_B(self.lora_A(self.lora_dropout(x.to(self.lora_A.weight.dtype))))
        return out + (low_rank * self.scaling).to(out.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``B @ A * scaling`` in fp32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding ``W + B @ A * scaling`` in the base's dtype (rounded once)."""
        plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            plain.weight.copy_((self.weight.float() + self.delta_weight()).to(self.weight.dtype))
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def lora_enabled(lora_cfg: Any) -> bool:
    return lora_cfg is not None and lora_cfg.rank > 0


def matches_target(hf_name: str, targets: list[str]) -> bool:
    """PEFT's rule for a list of names: the module's name is a target or ends with ``.<target>``."""
    return any(hf_name == t or hf_name.endswith("." + t) for t in targets)


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder layers' linear layers by HF name (``lm_head`` and the embeddings are not in layers)."""
    return {_hf_name(name): m for name, m in model.named_modules()
            if name.startswith("layers.") and isinstance(m, nn.Linear)}


def target_names(model: nn.Module, targets: list[str]) -> list[str]:
    """The HF names of the modules ``targets`` selects; a target that matches none is a config error naming
    the module names there are."""
    linears = linear_modules(model)
    if ALL_LINEAR in targets:
        return [n for n in linears if n.rsplit(".", 1)[-1] in PROJECTIONS]
    chosen = [n for n in linears if matches_target(n, targets)]
    for target in targets:
        if not any(matches_target(n, [target]) for n in linears):
            available = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise ConfigError(f"model.lora.target_modules: {target!r} matches no module of the model; its linear "
                              f"modules are {', '.join(available)} (or all-linear)")
    return chosen


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str], *,
               seed: int = 0, base_dtype: torch.dtype | None = None) -> list[str]:
    """Adapters on ``model``'s targeted linear layers, in place; every other parameter frozen (and cast to
    ``base_dtype`` when given). Returns the adapted modules' HF names. ``seed`` draws the A matrices, the
    same on every rank. Refuses a model that is not scalerl's decoder (the transformers fallback)."""
    if not isinstance(model, CausalLM):
        raise ConfigError(f"model.lora.rank={rank}: LoRA wraps scalerl's own decoder, not {type(model).__name__} "
                          "(model.implementation=transformers); use model.implementation=scalerl")
    names = target_names(model, targets)
    model.requires_grad_(False)
    if base_dtype is not None:
        model.to(base_dtype)
    generator = torch.Generator().manual_seed(seed)
    by_name = dict(model.named_modules())
    for hf_name in names:
        ours = hf_name[len("model."):]
        parent_name, _, child = ours.rpartition(".")
        base = by_name[ours]
        if isinstance(base, LoRALinear):
            raise TypeError(f"{hf_name} already has a LoRA adapter")
        with torch.random.fork_rng(devices=[]):  # nn.Linear's own init draws from the global stream: keep it
            wrapped = LoRALinear(base, rank, alpha, dropout, generator=generator)
        setattr(by_name[parent_name], child, wrapped)
    return names


def apply_lora_from_config(model: nn.Module, lora_cfg: Any, seed: int) -> list[str]:
    """`apply_lora` with the ``model.lora`` section (nothing when its rank is 0)."""
    if not lora_enabled(lora_cfg):
        return []
    base_dtype = getattr(torch, lora_cfg.base_dtype) if lora_cfg.base_dtype else None
    return apply_lora(model, lora_cfg.rank, lora_cfg.alpha, lora_cfg.dropout, list(lora_cfg.target_modules),
                      seed=seed, base_dtype=base_dtype)


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    return ((name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear))


def has_lora(model: nn.Module) -> bool:
    return any(True for _ in lora_modules(model))


def is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The adapters' parameters by scalerl name (``layers.0.self_attn.q_proj.lora_A.weight``)."""
    return ((n, p) for n, p in model.named_parameters() if is_adapter_name(n))


def peft_name(name: str) -> str:
    return PEFT_PREFIX + _hf_name(name)


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """PEFT key -> full adapter tensor on the CPU. Under FSDP2 every rank must call it (each DTensor is
    gathered whole, in the same order on all ranks)."""
    out = {}
    for name, p in adapter_parameters(model):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[peft_name(name)] = full.detach().to("cpu", copy=True).contiguous()
    return out


def adapter_config(model: nn.Module, base_model: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``model``'s adapters (target modules by full HF name, as PEFT writes
    them once it has resolved ``all-linear``)."""
    modules = dict(lora_modules(model))
    if not modules:
        raise ValueError("the model has no LoRA adapters to save")
    first = next(iter(modules.values()))
    dropout = first.lora_dropout.p if isinstance(first.lora_dropout, nn.Dropout) else 0.0
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": first.rank, "lora_alpha": first.alpha,
            "lora_dropout": dropout, "target_modules": sorted(_hf_name(n) for n in modules), "bias": "none",
            "base_model_name_or_path": base_model, "fan_in_fan_out": False, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_rslora": False, "use_dora": False}


def save_adapter(model: nn.Module, path: str | Path, base_model: str | None = None, is_main: bool = True) -> Path:
    """``adapter_config.json`` + ``adapter_model.safetensors`` at ``path`` (every rank calls; ``is_main``
    writes)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = adapter_state_dict(model)
    if is_main:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        (path / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config(model, base_model), indent=2) + "\n")
    return path


def load_adapter(model: nn.Module, path: str | Path) -> list[str]:
    """A PEFT adapter directory onto ``model`` (scalerl's decoder, without adapters yet): adapters applied as
    its config says, their weights loaded. Returns the adapted modules' HF names."""
    from safetensors.torch import load_file

    path = Path(path)
    raw = json.loads((path / ADAPTER_CONFIG_FILE).read_text())
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{path / ADAPTER_CONFIG_FILE}: peft_type {raw.get('peft_type')!r} is not LORA")
    for unsupported in ("use_dora", "use_rslora"):
        if raw.get(unsupported):
            raise ValueError(f"{path / ADAPTER_CONFIG_FILE}: {unsupported} is not supported")
    targets = raw["target_modules"]
    targets = [targets] if isinstance(targets, str) else list(targets)
    names = apply_lora(model, int(raw["r"]), float(raw["lora_alpha"]), float(raw.get("lora_dropout") or 0.0),
                       targets)
    saved = load_file(str(path / ADAPTER_WEIGHTS_FILE))
    params = dict(adapter_parameters(model))
    expected = {peft_name(n): n for n in params}
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise ValueError(f"{path / ADAPTER_WEIGHTS_FILE} lacks {len(missing)} adapter tensors, e.g. {missing[0]}")
    with torch.no_grad():
        for key, name in expected.items():
            params[name].copy_(saved[key])
    return names


def merged_adapted_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(<module>.weight, W + B @ A * scaling)`` of each adapted module, in the base's dtype: all an engine
    that cannot take adapters needs once it holds the base. Under FSDP2 every rank must call it."""
    out = []
    for name, module in lora_modules(model):
        weight, a, b = (p.full_tensor() if isinstance(p, DTensor) else p
                        for p in (module.weight, module.lora_A.weight, module.lora_B.weight))
        with torch.no_grad():
            merged = (weight.float() + (b.float() @ a.float()) * module.scaling).to(weight.dtype)
        out.append((f"{name}.weight", merged))
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """Every `LoRALinear` replaced by its merged plain linear layer, in place (for export); the model."""
    for name, module in list(lora_modules(model)):
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, module.merged())
    return model
