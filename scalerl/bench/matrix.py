"""The benchmark matrix: strategies x node counts x link rates x gradient compression x all-reduce kind x
weight-sync mode, expanded into cells, each a complete set of config overrides.

Strategies are written as components joined by ``+``: ``ddp`` (replicate), ``fsdp`` (shard), ``hsdp``
(shard inside a node, replicate across nodes), ``tp[N]``, ``pp[N]``. A component without N fills the ranks
left over (at most one may), e.g. ``ddp``, ``fsdp``, ``tp2+ddp``, ``pp2+fsdp``, ``tp2+pp2``.

Scaling is weak per data-parallel replica: each DP rank gets ``prompts_per_rank`` prompts (x rollout.n
samples), so the global batch grows with the DP size and the ideal throughput grows with the devices.
Compression and all-reduce kinds are plain config overrides (``comm.gradient_compression``,
``comm.allreduce``): the value ``none`` / ``default`` sets nothing, so the matrix runs on any scalerl, and a
value that the installed config does not know skips its cells with the config's own message.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, replace

STRATEGY_HELP = {
    "ddp": "data parallel: every rank a full replica, gradients all-reduced (DDP)",
    "fsdp": "fully sharded data parallel over all DP ranks (FSDP2)",
    "hsdp": "sharded inside a node, replicated across nodes (HSDP)",
    "tpN": "tensor parallel over N ranks (inside a node when they fit)",
    "ppN": "pipeline parallel over N stages",
}
# colocated: no weight sync; full / delta / auto: standalone workers with that weight_sync.mode
WEIGHT_SYNC_MODES = ("colocated", "full", "delta", "auto")
_COMPONENT = re.compile(r"^(ddp|fsdp|hsdp|tp|pp)(\d*)$")

# What every cell runs besides its own keys: the built-in model at 4 layers (so up to 4 pipeline stages and
# 2-way tensor parallelism fit), 4 samples of 16 new tokens per prompt, no evaluation, logging or checkpoints.
# The reward is the response length (as `scalerl verify` uses): an untrained model never answers right, and an
# all-zero reward would make every gradient zero, the weights never change and a delta weight sync send nothing.
BENCH_BASE = (
    "rollout.n=4", "rollout.max_new_tokens=16", "actor.ppo_micro_batch_size=4", "data.num_val=0",
    "data.reward=scalerl.verify:response_length_reward",
    "trainer.eval_every=0", "trainer.logger=[]", "trainer.monitor_every=0", "trainer.save_every=0",
    "trainer.overwrite=true",
)
BUILTIN_MODEL = ("model.num_hidden_layers=4",)


class NotApplicable(ValueError):
    """A strategy that cannot be laid out on a cell's ranks; the message says why."""


def parse_strategy(name: str) -> list[tuple[str, int | None]]:
    parts = []
    for part in name.lower().split("+"):
        match = _COMPONENT.match(part.strip())
        if match is None:
            raise ValueError(f"strategy {name!r}: {part!r} is not one of ddp, fsdp, hsdp, tp[N], pp[N]")
        kind, size = match.group(1), int(match.group(2)) if match.group(2) else None
        if kind in ("ddp", "fsdp", "hsdp") and size is not None:
            raise ValueError(f"strategy {name!r}: {kind} takes no size (it fills the ranks left over)")
        parts.append((kind, size))
    kinds = [k for k, _ in parts]
    if len(set(kinds)) != len(kinds) or sum(k in ("ddp", "fsdp", "hsdp") for k in kinds) > 1:
        raise ValueError(f"strategy {name!r}: each of tp/pp at most once and one of ddp/fsdp/hsdp at most")
    return parts


def strategy_layout(name: str, world: int, ranks_per_node: int) -> dict[str, int]:
    """``parallel.*`` sizes of ``name`` on ``world`` trainer ranks, ``ranks_per_node`` per node."""
    parts = dict(parse_strategy(name))
    sizes = {"tp": parts.get("tp") or 1, "pp": parts.get("pp") or 1}
    fill = [k for k in ("tp", "pp") if k in parts and parts[k] is None]
    dp_kind = next((k for k in ("ddp", "fsdp", "hsdp") if k in parts), None)
    if fill and dp_kind:
        raise ValueError(f"strategy {name!r}: give {fill[0]} a size when it is combined with {dp_kind}")
    if len(fill) > 1:
        raise ValueError(f"strategy {name!r}: give tp or pp a size (only one part may fill the ranks)")
    fixed = sizes["tp"] * sizes["pp"]
    if world % fixed:
        raise NotApplicable(f"{name} needs a multiple of {fixed} ranks, the cell has {world}")
    rest = world // fixed
    if fill:
        sizes[fill[0]] = rest
        rest = 1
    layout = {"dp_replicate": 1, "dp_shard": 1, **sizes}
    if dp_kind == "ddp":
        layout["dp_replicate"] = rest
    elif dp_kind == "fsdp":
        layout["dp_shard"] = rest
    elif dp_kind == "hsdp":
        per_node = max(1, ranks_per_node // (sizes["tp"] if sizes["tp"] <= ranks_per_node else 1))
        shard = math.gcd(per_node, rest)
        layout["dp_shard"], layout["dp_replicate"] = shard, rest // shard
    elif rest != 1:
        raise NotApplicable(f"{name} uses {fixed} ranks, the cell has {world}: add +ddp or +fsdp")
    return layout


@dataclass(frozen=True)
class Cell:
    """One configuration the bench measures."""

    strategy: str
    nodes: int
    ranks_per_node: int
    rate_mbit: float  # inter-node link (0: one node, loopback)
    compression: str = "none"
    allreduce: str = "default"
    weight_sync: str = "colocated"
    parallel: dict = field(default_factory=dict, hash=False, compare=False)
    calibration: bool = False  # the world-1 reference: baselines and the cost model's compute rates

    @property
    def world(self) -> int:
        """Trainer ranks (standalone rollout workers come on a node of their own)."""
        return self.nodes * self.ranks_per_node

    @property
    def workers(self) -> int:
        return self.ranks_per_node if self.weight_sync != "colocated" else 0

    @property
    def total_nodes(self) -> int:
        """Nodes to start: the trainer's, plus a node of rollout workers behind the link when there is one
        (on a single node the workers are more local ranks)."""
        return self.nodes + (1 if self.workers and self.nodes > 1 else 0)

    @property
    def launch_ranks_per_node(self) -> int:
        return self.ranks_per_node if self.total_nodes > 1 else self.world + self.workers

    @property
    def devices(self) -> int:
        return self.world + self.workers

    @property
    def dp(self) -> int:
        return self.parallel.get("dp_replicate", 1) * self.parallel.get("dp_shard", 1)

    @property
    def variant(self) -> str:
        """Everything but the strategy and the size: cells of one variant form one scaling curve."""
        return f"{self.rate_mbit:g}M|{self.compression}|{self.allreduce}|{self.weight_sync}|{self.ranks_per_node}rpn"

    @property
    def id(self) -> str:
        return f"{self.strategy}|{self.nodes}x{self.ranks_per_node}|{self.rate_mbit:g}M|{self.compression}|" \
               f"{self.allreduce}|{self.weight_sync}"

    def to_dict(self) -> dict:
        return {**asdict(self), "id": self.id, "world": self.world, "devices": self.devices,
                "workers": self.workers}


@dataclass
class BenchMatrix:
    strategies: list[str] = field(default_factory=lambda: ["ddp", "fsdp"])
    nodes: list[int] = field(default_factory=lambda: [1, 2])
    ranks_per_node: int = 1
    rates_mbit: list[float] = field(default_factory=lambda: [1000.0])
    compression: list[str] = field(default_factory=lambda: ["none"])
    allreduce: list[str] = field(default_factory=lambda: ["default"])
    weight_sync: list[str] = field(default_factory=lambda: ["colocated"])
    steps: int = 20
    warmup: int = 3
    model: str = "builtin"  # or a Hugging Face model directory
    prompts_per_rank: int = 4
    mini_batches: int = 2  # optimizer steps per training step
    threads_per_rank: int = 1
    baselines: bool = True  # plain PyTorch update and HF generate in the calibration cell
    overrides: list[str] = field(default_factory=list)  # key=value for every cell, applied last

    def check(self) -> None:
        for name in self.strategies:
            parse_strategy(name)
        if any(n < 1 for n in self.nodes) or self.ranks_per_node < 1:
            raise ValueError("nodes and ranks per node must be >= 1")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps must be >= 1 and warmup >= 0, got {self.steps} and {self.warmup}")
        if self.prompts_per_rank < 1 or self.mini_batches < 1 or self.threads_per_rank < 1:
            raise ValueError("prompts per rank, mini-batches and threads per rank must be >= 1")
        unknown = [w for w in self.weight_sync if w not in WEIGHT_SYNC_MODES]
        if unknown:
            raise ValueError(f"weight-sync mode(s) {unknown}: choose from {', '.join(WEIGHT_SYNC_MODES)}")
        if any(r <= 0 for r in self.rates_mbit):
            raise ValueError("link rates must be > 0 Mbit/s")

    def cells(self) -> tuple[list[Cell], list[dict]]:
        """The cells to measure (the world-1 calibration cell first) and those skipped, with the reason."""
        self.check()
        cells = [calibration_cell()]
        skipped: list[dict] = []
        for strategy in self.strategies:
            for nodes in sorted(set(self.nodes)):
                rates = [0.0] if nodes == 1 else sorted(set(self.rates_mbit))
                for rate in rates:
                    for comp in self.compression:
                        for kind in self.allreduce:
                            for sync in self.weight_sync:
                                cell = Cell(strategy, nodes, self.ranks_per_node, rate, comp, kind, sync)
                                try:
                                    cells.append(replace(cell, parallel=strategy_layout(
                                        strategy, cell.world, self.ranks_per_node)))
                                except NotApplicable as e:
                                    skipped.append({**cell.to_dict(), "status": "skipped", "reason": str(e)})
        return cells, skipped

    def cell_overrides(self, cell: Cell, samples_per_prompt: int) -> list[str]:
        """Every config override of ``cell``, in order: bench base, model, layout, batch, variant, user's."""
        out = list(BENCH_BASE)
        out += list(BUILTIN_MODEL) if self.model == "builtin" else [f"model.path={self.model}"]
        out += [f"parallel.{k}={v}" for k, v in sorted(cell.parallel.items())]
        rows = self.prompts_per_rank * samples_per_prompt * cell.dp
        out += [f"trainer.batch_size={self.prompts_per_rank * cell.dp}",
                f"actor.ppo_mini_batch_size={max(1, rows // self.mini_batches)}",
                f"trainer.cpu_threads={self.threads_per_rank}",
                f"trainer.total_steps={self.warmup + self.steps}"]
        if cell.compression != "none":
            # compress from the second optimizer step (inside the warm-up), so the measured steps compress
            out += [f"comm.gradient_compression={cell.compression}", "comm.compression_start_step=1"]
        if cell.allreduce != "default":
            out.append(f"comm.allreduce={cell.allreduce}")
        if cell.weight_sync != "colocated":
            out += ["rollout.placement=standalone", f"rollout.workers={cell.workers}",
                    f"weight_sync.mode={cell.weight_sync}"]
        return out + list(self.overrides)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> BenchMatrix:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown matrix key(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(**data)


def calibration_cell() -> Cell:
    """One rank, one node, colocated: the reference for scaling, baselines and compute rates."""
    return Cell("single", 1, 1, 0.0, parallel={"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1},
                calibration=True)
