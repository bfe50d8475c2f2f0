"""Parallel layout: the sizes of the named mesh dimensions, checked against the world and the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class LayoutError(ValueError):
    """A parallel layout that does not fit the world size or the model; the message names the dimensions."""


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def from_config(cls, parallel_cfg, world_size: int) -> "ParallelDims":
        """Resolve the one ``-1`` dimension to fill the world; the product must equal ``world_size``."""
        sizes = {d: getattr(parallel_cfg, d) for d in MESH_DIMS}
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
                "make pp * dp_replicate * dp_shard * tp equal the number of ranks"
            )
        return cls(**sizes)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check_model(self, model_cfg) -> None:
        """Heads, kv heads and layers must split evenly over the tensor / pipeline dimensions."""
        problems = []
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(model_cfg, name)
            if value % self.tp:
                problems.append(f"model {name}={value} is not divisible by parallel.tp={self.tp}")
        if model_cfg.num_hidden_layers % self.pp:
            problems.append(
                f"model num_hidden_layers={model_cfg.num_hidden_layers} is not divisible by parallel.pp={self.pp}"
            )
        if problems:
            raise LayoutError("; ".join(problems))

    def build_mesh(self, device_type: str, ranks: list[int] | None = None) -> tuple[DeviceMesh, DeviceMesh]:
        """One 4-D mesh named ``(pp, dp_replicate, dp_shard, tp)``, and its ``(dp_replicate, dp_shard)``
        dimensions flattened into the 1-D ``dp`` mesh that data loading and loss counts reduce over.

        ``ranks``: the global ranks the mesh spans, in mesh order (default: all of them). Every rank of the
        world calls this, those outside the mesh (standalone rollout workers) too: creating its process
        groups is collective over the world."""
        shape = tuple(getattr(self, d) for d in MESH_DIMS)
        if ranks is None:
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)
        else:
            mesh = DeviceMesh(device_type, torch.tensor(ranks).view(shape), mesh_dim_names=MESH_DIMS)
        return mesh, mesh["dp_replicate", "dp_shard"]._flatten("dp")


def _describe(sizes: dict) -> str:
    return ", ".join(f"{d}={v}" for d, v in sizes.items())
