"""Rollout routing replay (R3) for scalerl's MoE blocks: the experts the rollout engine routed each token to
are recorded during generation and replayed in the trainer's forwards (``actor.router_replay``), so router
drift between the engine's numerics and the trainer's (bf16 decode vs an fp32 forward, a different kernel, a
KV cache) cannot send a token to other experts in the two and blow up its importance ratio.

Routes are laid out like the rollout, ``[B, P + R, num_sparse_layers, top_k]`` (int32, ``NO_ROUTE`` = -1
where nothing was recorded: padding, and the last response token, which the engine never fed back).

Replay (verl's / Megatron's R3, slime's and NeMo-RL's routing replay) uses the recorded expert ids in place of
the router's top-k and weights them with the *current* router's softmax probabilities gathered at those ids,
renormalised as the model does (``norm_topk_prob``), so the gate weights keep their gradient; the router
logits (aux loss, load metrics) are the router's own. A position without a record uses the router's own
choice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Self

import torch
from torch import nn

from scalerl.models.moe import SparseMoeBlock, moe_blocks

NO_ROUTE = -1
ROUTE_DTYPE = torch.int32  # half of int64's bytes for [B, T, L, k]; gloo (the rebalance all-gather) has no int16
_FLAG = "router_replay"  # attribute on a model whose log-prob passes replay the batch's routes


def _blocks(model: nn.Module) -> list[SparseMoeBlock]:
    return moe_blocks(getattr(model, "backbone", model))


def route_shape(model: nn.Module) -> tuple[int, int]:
    """``(num_sparse_layers, top_k)`` of ``model``'s sparse blocks; (0, 0) for a dense model."""
    blocks = _blocks(model)
    return (len(blocks), blocks[0].top_k) if blocks else (0, 0)


def enable_router_replay(model: nn.Module) -> None:
    """Mark ``model`` (and the copies later made of it: the reference, the old policy) as one whose log-prob
    passes replay a batch's recorded routes; a dense model is a ValueError naming the key."""
    if not _blocks(model):
        raise ValueError(f"actor.router_replay=true replays a MoE model's routed experts, but this model "
                         f"({type(model).__name__}, model_type={getattr(getattr(model, 'config', None), 'model_type', '?')}"
                         ") has no sparse MoE block (qwen2_moe / qwen3_moe with model.implementation=scalerl); "
                         "set actor.router_replay=false")
    setattr(model, _FLAG, True)


def replays_routes(model: nn.Module) -> bool:
    """Whether `enable_router_replay` marked ``model``."""
    return bool(getattr(model, _FLAG, False))


class RouteRecorder:
    """Records, while entered, the expert ids every sparse block's router picks in each forward of ``model``
    (a forward hook on each router: nothing is recorded, and nothing costs, outside the context)."""

    def __init__(self, model: nn.Module):
        self.blocks = _blocks(model)
        self._latest: list[torch.Tensor | None] = [None] * len(self.blocks)
        self._handles = []

    def __enter__(self) -> Self:
        for i, block in enumerate(self.blocks):
            self._handles.append(block.gate.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, layer: int):
        def record(module, args, output):
            self._latest[layer] = output[2]
        return record

    def take(self) -> torch.Tensor:
        """The latest forward's routes ``[N, num_sparse_layers, top_k]`` (``N`` its flattened tokens)."""
        if any(x is None for x in self._latest):
            raise RuntimeError("no forward recorded routes in every sparse layer since the last take()")
        routes = torch.stack(self._latest, dim=1).to(ROUTE_DTYPE)  # type: ignore[arg-type]
        self._latest = [None] * len(self.blocks)
        return routes


def forward_routes(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The routes a full forward of ``model`` takes over ``input_ids`` ``[B, T]`` -> ``[B, T, L, k]``."""
    with RouteRecorder(model) as rec, torch.no_grad():
        model(input_ids, attention_mask=attention_mask)
        return rec.take().reshape(*input_ids.shape, *route_shape(model))


def _set(blocks: list[SparseMoeBlock], routes: torch.Tensor | None) -> None:
    for layer, block in enumerate(blocks):
        block.replay_experts = None if routes is None else routes[:, :, layer].reshape(-1, routes.shape[-1])


@contextlib.contextmanager
def replaying_routes(model: nn.Module, routes: torch.Tensor | Sequence[torch.Tensor] | None) -> Iterator[None]:
    """Forwards of ``model`` inside the context route by recorded ``routes`` (`TopKRouter.forward`'s
    ``replay``). A tensor ``[B, T, L, k]`` applies to every forward (each must take ``[B, T]`` ids); a
    sequence of them is taken one per forward, in order (the update's micro-batches inside one
    forward_backward). A backward (and an activation-checkpointing recompute) between two forwards still sees
    the routes of the forward it belongs to. None: no replay."""
    if routes is None:
        yield
        return
    blocks = _blocks(model)
    layers, top_k = route_shape(model)
    queue = [routes] if isinstance(routes, torch.Tensor) else list(routes)
    repeat = isinstance(routes, torch.Tensor)
    for r in queue:
        if r is None or r.dim() != 4 or tuple(r.shape[2:]) != (layers, top_k):
            raise ValueError(f"routes must be [B, T, {layers}, {top_k}] for this model's {layers} sparse layers of "
                             f"top-{top_k}; got {None if r is None else tuple(r.shape)}")

    def before_forward(module, args, kwargs):
        input_ids = args[0] if args else kwargs.get("input_ids")
        if not queue:
            raise RuntimeError("replaying_routes: more forwards than recorded routes were given for")
        nxt = queue[0] if repeat else queue.pop(0)
        if tuple(nxt.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(f"recorded routes of {tuple(nxt.shape[:2])} tokens for a forward over "
                             f"{tuple(input_ids.shape)} ids: the routes are not this batch's")
        _set(blocks, nxt.to(input_ids.device))

    handle = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        _set(blocks, None)


def pad_routes(routes: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``routes`` ``[B, T, L, k]`` with ``left`` / ``right`` columns of `NO_ROUTE` added along T."""
    return torch.nn.functional.pad(routes, (0, 0, 0, 0, left, right), value=NO_ROUTE)
