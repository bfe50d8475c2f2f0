"""The rollout side of weight sync: how a standalone engine takes weights pushed by the trainer.

An engine implements two methods (the receiving interface, as verl's checkpoint engine hands named
tensors to its inference engines):

- ``load_weights(named_tensors)``: load whole named tensors (trainer names) into the engine's model;
- ``named_weights()``: the engine's own tensors, if it can expose them to be written in place (``None``
  if it cannot, e.g. vLLM, whose fused ``qkv_proj`` / ``gate_up_proj`` parameters have other names).

`EngineWeightStore` turns such an engine into the `WeightStore` a `WeightReceiver` writes buckets into.
When the engine's own tensors are in the rollout dtype, buckets are decoded straight into them (no extra
copy, and the receiver's checksums verify the very bits the engine generates with). Otherwise the store
keeps a shadow copy in the rollout dtype (what the delta is applied to and verified against) and hands
each changed tensor to ``load_weights`` once its last bucket arrived.

The built-in engine exposes its parameters (in place). The vLLM adapter implements ``load_weights`` through
vLLM's worker extension and layerwise reload (`scalerl.rollout.engines.vllm_weight_loading`) and no
``named_weights``; it re-processes whole layers, so it also names its ``layer_groups`` and a changed tensor
is loaded with the rest of its layer (q/k/v, gate/up).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from scalerl.comm.weights.plan import WeightPlan
from scalerl.comm.weights.receiver import WeightReceiver, check_store_fits


class WeightLoadingEngine(Protocol):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load whole tensors by trainer name into the engine's model; returns the bytes loaded."""
        ...

    def named_weights(self) -> dict[str, torch.Tensor] | None:
        """The engine's own tensors by trainer name, writable in place; None when it cannot expose them."""
        ...


class EngineWeightStore:
    """A `WeightStore` over an engine: in place when its tensors fit the plan, else a shadow copy."""

    def __init__(self, engine: WeightLoadingEngine, shadow_device: torch.device | str = "cpu"):
        self.engine = engine
        self.shadow_device = torch.device(shadow_device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.in_place = False
        self.group_of: dict[str, tuple[str, ...]] = {}

    def prepare(self, plan: WeightPlan) -> None:
        own = self.engine.named_weights()
        if own is not None:
            missing = [e.name for e in plan.entries if e.name not in own]
            if missing:
                raise ValueError(f"the engine has no tensor named {missing[0]} (of {len(missing)} missing)")
            for e in plan.entries:
                if tuple(own[e.name].shape) != e.shape:
                    raise ValueError(f"the engine holds {e.name} as {tuple(own[e.name].shape)}, the trainer sends {e.shape}")
            if all(own[e.name].dtype == plan.dtype and own[e.name].is_contiguous() for e in plan.entries):
                self.tensors, self.in_place = {e.name: own[e.name] for e in plan.entries}, True
                return
        self.in_place = False
        self.tensors = {
            e.name: torch.zeros(e.shape, dtype=plan.dtype, device=self.shadow_device) for e in plan.entries
        }
        check_store_fits(self, plan)
        # An engine that re-processes whole layers (vLLM) must get every tensor of a layer that changed.
        groups = getattr(self.engine, "layer_groups", None)
        self.group_of = ({n: tuple(g) for g in groups([e.name for e in plan.entries]) for n in g}
                         if groups is not None else {})

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def loaded(self, names: Sequence[str]) -> None:
        if not self.in_place:
            whole = dict.fromkeys(m for n in names for m in self.group_of.get(n, (n,)))
            self.engine.load_weights([(n, self.tensors[n]) for n in whole])


def engine_weight_receiver(engine: WeightLoadingEngine, shadow_device: torch.device | str = "cpu") -> WeightReceiver:
    """A receiver that applies pushed weights to ``engine`` (see `EngineWeightStore`)."""
    return WeightReceiver(EngineWeightStore(engine, shadow_device))
