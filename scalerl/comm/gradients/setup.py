"""Builds a DDP model's `GradientReducer` from the `comm` config: node layout -> flat or hierarchical
(with the reason) -> process groups -> compression settings. Collective: every rank calls it alike."""

from __future__ import annotations

import logging

import torch.distributed as dist
from torch import nn

from scalerl.comm.counting.counted_collectives import SendCallback
from scalerl.comm.gradients.allreduce_choice import AllReduceChoice, choose_allreduce
from scalerl.comm.gradients.hierarchical import HierarchicalGroups, gather_node_layout
from scalerl.comm.gradients.reducer import CompressionSettings, GradientReducer
from scalerl.comm.net.cluster_topology import ClusterTopology, gather_topology

logger = logging.getLogger("scalerl.comm")


def announce(text: str) -> None:
    """Rank 0 says it once (stdout, like the trainers' progress lines) and every rank logs it."""
    logger.info(text)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"[scalerl.comm] {text}", flush=True)


def decide_allreduce(setting: str, group, device_type: str, topology: ClusterTopology | None = None,
                     inter_node_mbit: float = 0.0) -> tuple[AllReduceChoice, HierarchicalGroups | None]:
    """The all-reduce for `group` and, when hierarchical, its process groups."""
    if setting == "flat":
        return choose_allreduce("flat", None), None  # flat needs no layout
    layout = gather_node_layout(group)
    if setting == "auto" and layout.nodes > 1 and topology is None and inter_node_mbit <= 0:
        topology = gather_topology(group)  # link kinds and speeds; only needed when there are nodes to join
    choice = choose_allreduce(setting, layout, topology, device_type, inter_node_mbit)
    if choice.hierarchical and group.size() != dist.get_world_size():
        choice = AllReduceChoice("flat", f"{choice.reason}; but the DP group is not the whole job, and its "
                                         "groups cannot be built collectively: flat")
    return choice, HierarchicalGroups(layout, group) if choice.hierarchical else None


def build_gradient_reducer(comm, group, model: nn.Module, device_type: str, topology: ClusterTopology | None = None,
                           on_send: SendCallback | None = None) -> GradientReducer:
    """`comm` is the config's CommSection; `model` the module DDP wraps (for parameter names)."""
    group = group or dist.group.WORLD
    choice, hierarchy = decide_allreduce(comm.allreduce, group, device_type, topology, comm.inter_node_mbit)
    settings = CompressionSettings.from_config(comm)
    announce(f"gradient all-reduce: {choice.kind} ({choice.reason})")
    if settings.method != "none":
        how = ""
        if settings.sparse_or_low_rank:
            how = (f", layer-adaptive under {settings.budget:g} of dense bytes" if settings.layer_adaptive else
                   f", density {settings.topk_density:g}" if settings.method == "topk" else
                   f", rank {settings.powersgd_rank}")
            how += f", dense for the first {settings.effective_start} optimizer steps"
        where = "inter-node part only" if choice.hierarchical else "whole all-reduce"
        announce(f"gradient compression: {settings.method}{how} ({where})")
    names = {id(p): n for n, p in model.named_parameters()}
    return GradientReducer(group, settings, choice, hierarchy, names, on_send, announce=announce)
