"""`scalerl verify distributed-vs-single`: the same GRPO and SFT steps, single-process and under each
parallel layout, compared loss by loss and weight by weight.

Every run uses one seed and the same global batches: each rank draws the global batch and keeps its share,
rollout sampling draws its random numbers per global row, and each step makes one optimizer update over
the whole batch (so no shuffling order can differ). In fp32 the only differences left are summation order
(sharded matmuls, reductions), which the 1e-4 relative tolerance absorbs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from scalerl.core.net import free_port

# torch and safetensors are imported where used: `scalerl verify --help` lists LAYOUTS without them.

# Layouts checked at each world size (the single-process run is the reference for all of them).
LAYOUTS: dict[int, dict[str, dict[str, int]]] = {
    2: {
        "ddp": {"dp_replicate": 2},
        "fsdp": {"dp_replicate": 1, "dp_shard": 2},
        "tp": {"dp_replicate": 1, "tp": 2},
        "pp-1f1b": {"dp_replicate": 1, "pp": 2},
        "pp-gpipe": {"dp_replicate": 1, "pp": 2, "pp_schedule": "gpipe"},
        "pp-interleaved": {"dp_replicate": 1, "pp": 2, "pp_schedule": "interleaved_1f1b"},
        "sp2": {"dp_replicate": 1, "sp": 2},
        "sp2-packed": {"dp_replicate": 1, "sp": 2},
    },
    4: {
        "ddp": {"dp_replicate": 4},
        "hsdp": {"dp_replicate": 2, "dp_shard": 2},
        "dp2xtp2": {"dp_replicate": 2, "tp": 2},
        "fsdp2xtp2": {"dp_replicate": 1, "dp_shard": 2, "tp": 2},
        "pp2xdp2": {"dp_replicate": 2, "pp": 2},
        "pp2xfsdp2": {"dp_replicate": 1, "dp_shard": 2, "pp": 2},
        "pp2xtp2": {"dp_replicate": 1, "tp": 2, "pp": 2},
        "sp2xdp2": {"dp_replicate": 2, "sp": 2},
        "sp2xfsdp2": {"dp_replicate": 1, "dp_shard": 2, "sp": 2},
        "sp4": {"dp_replicate": 1, "sp": 4},  # 2 kv heads over 4 ranks: each replicated twice
    },
}
# Rows that change more than the layout (their reference is still the plain single-process run): packed rows
# agree with padded ones far inside the tolerance.
LAYOUT_OVERRIDES: dict[str, tuple[str, ...]] = {"sp2-packed": ("actor.use_remove_padding=true",)}
# Expert-parallel rows on a generated MoE model (`moe_verification_model`), each against its own single-process
# run on that model: (the layout, overrides of both runs). A micro-batch is a rank's whole share (the reference's
# the whole batch) and rows stay in place (trainer.balance_batch=false), so the tokens one EP forward routes are
# the reference's forward's, in its order: what a capacity factor's token-order drops need to agree.
MOE_LAYOUTS: dict[int, dict[str, tuple[dict[str, int], tuple[str, ...]]]] = {
    2: {
        "ep2-moe": ({"dp_replicate": 2, "ep": 2}, ()),
        "ep2-moe-cf1": ({"dp_replicate": 2, "ep": 2}, ("model.moe_capacity_factor=1.0",)),
        # FSDP2: dense parameters sharded over both ranks, each rank its two experts (one replica each).
        "ep2-moe-fsdp": ({"dp_shard": 2, "ep": 2}, ()),
    },
    4: {
        # ep2 x fsdp2: dense parameters sharded over 4 ranks; experts split over ranks (0,1) and (2,3), each
        # half FSDP-sharded over its two replicas (ranks 0,2 / 1,3); and the same under HSDP (2 x 2).
        "ep2-moe-fsdp4": ({"dp_shard": 4, "ep": 2}, ()),
        "ep2-moe-hsdp": ({"dp_replicate": 2, "dp_shard": 2, "ep": 2}, ()),
    },
}
KINDS = ("grpo", "sft")  # default; "ppo" (GAE with a critic) is also available
COMPARED_METRICS = {
    "grpo": ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean"),
    # PPO's first on-policy pg_loss is -mean(whitened advantage) = 0 up to rounding: nothing to compare.
    "ppo": ("actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"),
    "sft": ("sft/loss", "sft/grad_norm"),
}
TOLERANCE = 1e-4
# The ranks fork from one server process that imported these once (multiprocessing's "forkserver"), rather
# than each importing torch afresh (seconds per rank on a small machine).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.pipelining",
           "torch.distributed.fsdp", "torch.distributed.checkpoint", "safetensors.torch",
           "scalerl.trainer.rl_trainer", "scalerl.trainer.sft_trainer"]


def response_length_reward(response: str, ground_truth: str) -> float:
    """Reward for verification runs: an untrained model never answers right, and an all-zero reward would
    make every advantage 0 and every comparison trivially pass; response length varies within a group."""
    return len(response) / 10.0


def verification_overrides(steps: int) -> list[str]:
    """A tiny model whose heads (4) and kv heads (2) split over tp=2 and whose 4 layers split into 4 pipeline
    stages (interleaved: 2 per rank); one optimizer update per step over the whole batch."""
    return [
        "model.hidden_size=32", "model.intermediate_size=64", "model.num_attention_heads=4", "model.num_hidden_layers=4",
        "model.num_key_value_heads=2", "data.num_train=256", "data.num_val=8",
        f"data.reward={__name__}:response_length_reward", "rollout.n=4", "rollout.max_new_tokens=8",
        "trainer.batch_size=8", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size=4",
        "actor.lr=1e-3", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.entropy_coeff=0.01",
        f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.logger=[jsonl]",
        f"sft.steps={steps}", "sft.batch_size=16", "sft.micro_batch_size=4", "sft.lr=1e-3",
    ]


def moe_verification_model(directory: Path) -> Path:
    """A random Qwen2-MoE over the built-in tokenizer's vocabulary (4 experts, top-2, a shared expert, 2 layers),
    saved as a Hugging Face directory. Its router's aux loss is off: each rank's would be over its own tokens
    (as under plain DDP), which one process cannot reproduce."""
    from scalerl.core.config import BUILTIN_VOCAB_SIZE
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.models.hf_checkpoint import save_pretrained

    cfg = ModelConfig(model_type="qwen2_moe", vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=16, output_router_logits=False, tie_word_embeddings=True)
    save_pretrained(build_model(cfg, seed=0), directory)
    return directory


def moe_overrides(model_dir: Path, single: bool, extra: tuple[str, ...], ranks: int = 2) -> list[str]:
    """The MoE rows' overrides: the model, one micro-batch per rank's share, rows kept where they are."""
    share = 1 if single else ranks  # the ranks of the row's world
    return [f"model.path={model_dir}", "model.tokenizer=builtin", "trainer.balance_batch=false",
            f"actor.ppo_micro_batch_size={32 // share}", f"sft.micro_batch_size={16 // share}", *extra]


def run_kind(kind: str, overrides: list[str], output_dir: Path) -> Path:
    """Train ``kind`` (grpo | sft) with ``overrides`` into ``output_dir``; returns the saved model directory."""
    from scalerl.core.config import load_config

    extra = ["algorithm.adv_estimator=gae", "algorithm.lam=0.95"] if kind == "ppo" else []
    # Verification runs are scratch: a rerun replaces the previous one's outputs.
    cfg = load_config(None, [*overrides, *extra, f"trainer.output_dir={output_dir}", "trainer.overwrite=true"])
    if kind in ("grpo", "ppo"):
        from scalerl.trainer.rl_trainer import train

        return Path(train(cfg)["final_model"])
    from scalerl.trainer.sft_trainer import train_sft

    return Path(train_sft(cfg)["model_dir"])


def supported(kind: str, layout: dict[str, int]) -> bool:
    """PPO's critic does not run under pipeline parallelism yet (the trainer refuses it at start)."""
    return not (kind == "ppo" and layout.get("pp", 1) > 1)


def _critic_trained(run_dir: Path) -> bool:
    rows = _read_metrics(run_dir / "metrics.jsonl")
    return any(r.get("critic/grad_norm", 0) > 0 for r in rows)


def _metrics_file(kind: str, output_dir: Path) -> Path:
    return output_dir / ("sft" if kind == "sft" else "") / "metrics.jsonl"


def _worker(rank: int, world: int, port: int, layouts: dict, overrides: list[str], out_dir: str,
            kinds_of: dict[str, tuple[str, ...]], layout_extra: dict[str, list[str]], environ: dict[str, str]) -> None:
    os.environ.clear()  # the caller's, not the fork server's (which may be older)
    os.environ.update(environ)
    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    })
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)

    dist.init_process_group("gloo", init_method="env://")
    try:
        # One process group for every layout: each layout builds its own mesh (new subgroups) on it.
        for name, layout in layouts.items():
            layout_overrides = [f"parallel.{k}={v}" for k, v in {"dp_replicate": 1, **layout}.items()]
            layout_overrides += layout_extra.get(name, [])
            for kind in kinds_of[name]:
                if supported(kind, layout):
                    run_kind(kind, [*overrides, *layout_overrides], Path(out_dir) / f"world{world}-{name}" / kind)
    finally:
        dist.destroy_process_group()


@dataclass
class VerificationRow:
    kind: str
    layout: str
    world: int
    max_loss_diff: float
    max_weight_diff: float
    max_abs_weight_diff: float

    @property
    def passed(self) -> bool:
        return self.max_loss_diff <= TOLERANCE and self.max_weight_diff <= TOLERANCE


def _read_metrics(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["step"] > 0]


def max_metric_diff(reference: list[dict], other: list[dict], keys) -> float:
    """Largest relative difference per step, each key scaled by its mean magnitude over the reference run
    (a policy loss hovers around 0, so per-step relative error alone would be ill-conditioned)."""
    if [r["step"] for r in reference] != [r["step"] for r in other]:
        return float("inf")
    worst = 0.0
    for key in keys:
        ref = [r[key] for r in reference if key in r]
        if not ref:
            continue
        scale = max(sum(abs(v) for v in ref) / len(ref), 1e-12)
        for a, b in zip(reference, other):
            worst = max(worst, abs(a[key] - b.get(key, float("inf"))) / scale)
    return worst


def max_weight_diff(reference_dir: Path, other_dir: Path) -> float:
    """Relative difference of the two models' weights, ``||a - b|| / ||a||`` over all parameters together.

    Per-tensor or elementwise ratios are ill-conditioned here: a Qwen2 k-projection bias starts at 0 and
    barely moves (RoPE aside, softmax ignores it), so summation-order noise of 1e-7 on it reads as a large
    ratio while meaning nothing. ``max_abs_weight_diff`` reports the elementwise worst case alongside.
    """
    ref, other = _load_pair(reference_dir, other_dir)
    if ref is None:
        return float("inf")
    diff = sum(float((ref[k] - other[k]).double().pow(2).sum()) for k in ref) ** 0.5
    norm = sum(float(ref[k].double().pow(2).sum()) for k in ref) ** 0.5
    return diff / max(norm, 1e-12)


def max_abs_weight_diff(reference_dir: Path, other_dir: Path) -> float:
    ref, other = _load_pair(reference_dir, other_dir)
    return float("inf") if ref is None else max(float((ref[k] - other[k]).abs().max()) for k in ref)


def _load_pair(reference_dir: Path, other_dir: Path):
    from safetensors.torch import load_file

    ref = load_file(str(reference_dir / "model.safetensors"))
    other = load_file(str(other_dir / "model.safetensors"))
    return (ref, other) if ref.keys() == other.keys() else (None, None)


def run_verification(
    out_dir: str | Path, worlds=(2, 4), steps: int = 3, kinds=KINDS, layouts: list[str] | None = None,
    extra_kinds: dict[str, list[str]] | None = None,
) -> list[VerificationRow]:
    """Rows of ``kinds`` under each layout of ``worlds`` (all, or those named in ``layouts``) against the
    single-process runs. ``extra_kinds`` adds kinds for some layouts only ({"ppo": ["ddp", "tp"]}), run in the
    same spawned group per world size (a group's start-up costs more than a tiny run)."""
    import torch.multiprocessing as mp

    out_dir = Path(out_dir)
    overrides = verification_overrides(steps)

    def kinds_of(name: str) -> tuple[str, ...]:
        more = [k for k, names in (extra_kinds or {}).items() if name in names and k not in kinds]
        return (*kinds, *more)

    # Single-process references, one run per distinct (kind, overrides): the MoE rows without overrides of
    # their own share one, whatever their world size.
    references: dict[tuple[str, tuple[str, ...]], tuple[Path, Path]] = {}  # -> (its directory, its model)

    def reference(kind: str, single_overrides: list[str], run_dir: Path) -> tuple[Path, Path]:
        key = (kind, tuple(single_overrides))
        if key not in references:
            references[key] = run_dir, run_kind(kind, [*overrides, *single_overrides], run_dir)
        return references[key]

    model_dir = None
    rows = []
    for world in worlds:
        chosen = {n: l for n, l in LAYOUTS[world].items() if layouts is None or n in layouts}
        moe = {n: v for n, v in MOE_LAYOUTS.get(world, {}).items() if layouts is None or n in layouts}
        if not chosen and not moe:
            continue
        extra: dict[str, list[str]] = {n: list(LAYOUT_OVERRIDES[n]) for n in chosen if n in LAYOUT_OVERRIDES}
        singles: dict[str, dict[str, tuple[Path, Path]]] = {}  # layout -> kind -> its single-process run
        for name, layout in chosen.items():
            singles[name] = {kind: reference(kind, [], out_dir / "single" / kind)
                             for kind in kinds_of(name) if supported(kind, layout)}
        if moe:
            model_dir = model_dir or moe_verification_model(out_dir / "moe-model")
            for name, (layout, moe_extra) in moe.items():
                chosen[name] = layout
                extra[name] = moe_overrides(model_dir, single=False, extra=moe_extra, ranks=world)
                single = moe_overrides(model_dir, single=True, extra=moe_extra)
                singles[name] = {kind: reference(kind, single, out_dir / f"single-{name}" / kind)
                                 for kind in kinds_of(name) if supported(kind, layout)}
        mp.set_forkserver_preload(PRELOAD)  # before its server starts; no effect on one already running
        mp.start_processes(
            _worker, args=(world, free_port(), chosen, overrides, str(out_dir), {n: kinds_of(n) for n in chosen},
                           extra, dict(os.environ)), nprocs=world, start_method="forkserver",
        )
        for name in chosen:
            for kind in kinds_of(name):
                if not supported(kind, chosen[name]):
                    print(f"skipped: {kind} under {name} (the critic does not run with pipeline parallelism yet)")
                    continue
                run_dir = out_dir / f"world{world}-{name}" / kind
                single_dir, single_model = singles[name][kind]
                loss_diff = max_metric_diff(
                    _read_metrics(_metrics_file(kind, single_dir)), _read_metrics(_metrics_file(kind, run_dir)),
                    COMPARED_METRICS[kind],
                )
                run_model = run_dir / ("sft/model" if kind == "sft" else "final")
                if kind == "ppo" and not _critic_trained(run_dir):
                    loss_diff = float("inf")  # a critic that never learned would make the check vacuous
                if name in moe and moe[name][1] and not _dropped_tokens(_metrics_file(kind, run_dir)):
                    loss_diff = float("inf")  # a capacity factor that dropped nothing would check nothing new
                rows.append(VerificationRow(
                    kind, name, world, loss_diff, max_weight_diff(single_model, run_model),
                    max_abs_weight_diff(single_model, run_model),
                ))
    return rows


def _dropped_tokens(metrics_file: Path) -> bool:
    return any(r.get("moe/dropped_tokens", 0) > 0 for r in _read_metrics(metrics_file))


def describe_layouts() -> str:
    """One line per world size naming its layouts (for `scalerl verify --help`)."""
    return "\n".join(f"  world {world}: {', '.join([*layouts, *MOE_LAYOUTS.get(world, {})])}"
                     for world, layouts in LAYOUTS.items())


def format_rows(rows: list[VerificationRow]) -> str:
    lines = [
        f"{'kind':5} {'layout':14} {'world':>5} {'max loss diff':>14} {'max weight diff':>16} "
        f"{'(max abs)':>10}  result (tolerance {TOLERANCE:g}, relative)"
    ]
    for r in rows:
        lines.append(
            f"{r.kind:5} {r.layout:14} {r.world:>5} {r.max_loss_diff:>14.2e} {r.max_weight_diff:>16.2e} "
            f"{r.max_abs_weight_diff:>10.1e}  {'pass' if r.passed else 'FAIL'}"
        )
    return "\n".join(lines)
