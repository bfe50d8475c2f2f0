"""Parallel layout: the sizes of the named mesh dimensions, checked against the world and the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from scalerl.core.config import sequence_parallel_head_problems
from scalerl.core.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "sp", "tp")


class LayoutError(UserError, ValueError):
    """A parallel layout that does not fit the world size or the model; the message names the dimensions."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1  # expert parallelism over the data-parallel ranks (not a mesh dimension of its own)
    sp: int = 1  # Ulysses sequence parallelism: ranks that split one data-parallel replica's sequences

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int) -> "ParallelDims":
        """Resolve the one ``-1`` dimension to fill the world; the product must equal ``world_size``."""
        sizes = {d: getattr(parallel_cfg, d, 1) for d in MESH_DIMS}
        if sizes["sp"] < 1:
            raise LayoutError(f"parallel.sp={sizes['sp']} must be >= 1 (it cannot fill the world: set it explicitly)")
        if world_size % sizes["sp"]:
            raise LayoutError(f"parallel.sp={sizes['sp']} does not divide the world size {world_size}: each "
                              "data-parallel replica splits its sequences over sp ranks")
        fixed = 1
        for d, v in sizes.items():
            if v != -1:
                fixed *= v
        fill = [d for d, v in sizes.items() if v == -1]
        if fill:
            if world_size % fixed:
                raise LayoutError(
                    f"world size {world_size} is not divisible by the fixed parallel dimensions "
                    f"({_describe(sizes)}); parallel.{fill[0]}=-1 cannot fill it"
                )
            sizes[fill[0]] = world_size // fixed
        product = 1
        for v in sizes.values():
            product *= v
        if product != world_size:
            raise LayoutError(
                f"parallel layout {_describe(sizes)} multiplies to {product}, but the world size is {world_size}; "
                "make pp * dp_replicate * dp_shard * sp * tp equal the number of ranks"
            )
        ep = getattr(parallel_cfg, "ep", 1)
        dp = sizes["dp_replicate"] * sizes["dp_shard"]
        if ep > 1 and (sizes["tp"] * sizes["pp"] != 1 or dp % ep or (sizes["dp_shard"] == 1 and ep != dp)):
            raise LayoutError(f"parallel.ep={ep} splits experts over the data-parallel ranks: under DDP it needs "
                              f"parallel.dp_replicate={ep}, under FSDP2 (parallel.dp_shard > 1) dp_replicate x "
                              f"dp_shard divisible by {ep}, and parallel.tp=1 parallel.pp=1; got {_describe(sizes)}")
        if sizes["sp"] > 1 and sizes["tp"] * sizes["pp"] * ep != 1:
            raise LayoutError(f"parallel.sp={sizes['sp']} runs with data parallelism only, got {_describe(sizes)}, "
                              f"ep={ep}: set parallel.tp, parallel.pp and parallel.ep to 1")
        return cls(**sizes, ep=ep)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.sp * self.tp

    def check_model(self, model_cfg) -> None:
        """Heads, kv heads and layers must split evenly over the tensor / pipeline dimensions."""
        problems = []
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(model_cfg, name)
            if value % self.tp:
                problems.append(f"model {name}={value} is not divisible by parallel.tp={self.tp}")
        if getattr(model_cfg, "num_experts", 0) and (self.tp > 1 or self.pp > 1):
            problems.append(f"a MoE model ({model_cfg.model_type}, num_experts={model_cfg.num_experts}) cannot run "
                            f"with parallel.tp={self.tp} parallel.pp={self.pp}: scalerl splits MoE models over "
                            "data-parallel ranks only (parallel.dp_replicate / parallel.dp_shard)")
        if self.ep > 1 and (not getattr(model_cfg, "num_experts", 0) or model_cfg.num_experts % self.ep):
            problems.append(f"parallel.ep={self.ep} needs a MoE model whose num_experts divides by it, got "
                            f"num_experts={getattr(model_cfg, 'num_experts', 0)}")
        if self.sp > 1:
            problems += sequence_parallel_head_problems(self.sp, model_cfg.num_attention_heads,
                                                        model_cfg.num_key_value_heads, "model ")
            if getattr(model_cfg, "num_experts", 0):
                problems.append(f"parallel.sp={self.sp} with a MoE model ({model_cfg.model_type}): the router's "
                                "load-balancing loss would see one sequence shard; use parallel.sp=1")
        if model_cfg.num_hidden_layers % self.pp:
            problems.append(
                f"model num_hidden_layers={model_cfg.num_hidden_layers} is not divisible by parallel.pp={self.pp}"
            )
        if problems:
            raise LayoutError("; ".join(problems))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def build_mesh(self, device_type: str,
                   ranks: Sequence[int] | None = None) -> tuple[DeviceMesh | None, DeviceMesh | None]:
        """One 5-D mesh named ``(pp, dp_replicate, dp_shard, sp, tp)``, and its ``(dp_replicate, dp_shard)``
        dimensions flattened into the 1-D ``dp`` mesh that data loading and loss counts reduce over.

        ``ranks[i]``: the global rank at mesh position i (default: all ranks in the launcher's order). A
        subset of the world (standalone rollout workers hold the rest) or another order (ranks grouped by
        node, `scalerl.comm.net.rank_placement`) keeps that order in every group. Every rank of the world calls
        this, those outside the mesh too (they get ``(None, None)``): creating process groups is collective
        over the world."""
        launcher_order = list(range(dist.get_world_size()))
        if ranks is None or list(ranks) == launcher_order:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
            return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return _mesh_in_order(device_type, torch.tensor(list(ranks), dtype=torch.int).view(self.shape))


def _mesh_in_order(device_type: str, ranks: torch.Tensor) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The mesh over ``ranks`` (a 5-D tensor of global ranks) from groups that keep its order.

    ``DeviceMesh(ranks)`` would have the right members in each group, but creates them with ``new_group``,
    which sorts members by global rank (and uses the default group for a dimension spanning the world):
    a ring then runs in the launcher's order again. Here every group is made with ``sort_ranks=False``
    (every rank creates every group, as ``new_group`` requires) and the mesh is assembled from them."""
    groups = [_group_along(ranks, (d,)) for d in range(ranks.ndim)]
    dp_dims = (MESH_DIMS.index("dp_replicate"), MESH_DIMS.index("dp_shard"))
    dp_group = _group_along(ranks, dp_dims)
    if dp_group is None:  # not in the mesh (a rollout worker): it only took part in creating the groups
        return None, None
    mesh = DeviceMesh.from_group(groups, device_type, mesh=ranks, mesh_dim_names=MESH_DIMS)
    dp_mesh = DeviceMesh.from_group(dp_group, device_type, mesh=dist.get_process_group_ranks(dp_group),
                                    mesh_dim_names=("dp",))
    return mesh, dp_mesh


def _group_along(ranks: torch.Tensor, dims: tuple[int, ...]) -> dist.ProcessGroup | None:
    """This rank's group among the groups that vary over mesh ``dims`` (in mesh order); None outside."""
    others = [d for d in range(ranks.ndim) if d not in dims]
    size = 1
    for d in dims:
        size *= ranks.shape[d]
    rows = ranks.permute(*others, *dims).reshape(-1, size).tolist()
    me, mine = dist.get_rank(), None
    for row in rows:
        group = dist.new_group(row, sort_ranks=False)
        if me in row:
            mine = group
    return mine


def _describe(sizes: dict) -> str:
    return ", ".join(f"{d}={v}" for d, v in sizes.items())
