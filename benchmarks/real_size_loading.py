"""Real-size models on CPU ranks: peak host memory per rank, load, step, checkpoint and export times, at
world 1, 2 and 4 under FSDP2, on Qwen2.5-0.5B- and Qwen2.5-1.5B-shaped random checkpoints.

    OMP_NUM_THREADS=1 python benchmarks/real_size_loading.py [--models 0.5b 1.5b] [--worlds 1 2 4]
        [--loading sharded|whole] [--out /tmp/real_size] [--batch 2] [--seq 32] [--no-checkpoint] [--load-only]
        [--json FILE] [--mmap-threshold pinned|climbing]

1. The checkpoint: the published config.json values of each model (hard-coded below, never downloaded),
   random weights (normal 0.02, unit norms, zero biases) in bf16, four safetensors shards with an index.
   Written shard by shard from the architecture on the meta device: the generator never holds more than
   one shard. Cached in ``--out``.
2. Each configuration runs in fresh processes (one per rank, gloo on loopback, OMP_NUM_THREADS=1): world 1
   loads the whole model (`from_pretrained`, as a single process does); world > 1 builds on meta, lays the
   model out with FSDP2 (``parallel.dp_shard`` = world) and reads its own slices (`load_local_shards`;
   ``--loading whole`` loads the whole model on every rank first, as scalerl did before). Then one
   training step (forward, backward, AdamW) on ``--batch`` sequences of ``--seq`` tokens, a checkpoint save
   and load (scalerl's own: DCP shards per rank when distributed), and the Hugging Face export (bf16,
   one tensor at a time). Each rank's peak resident memory (VmHWM) is read after every phase.
3. Before each configuration the available memory is compared with an estimate of what it needs
   (fp32 parameters, gradients and AdamW state: 16 bytes a parameter, split over the ranks, plus a whole
   fp32 copies per rank for loading where they are made, the whole state read back by a single-process
   checkpoint load); a configuration that does not fit is skipped with the reason printed.
   ``--load-only``: loading and the export alone (no optimizer state), for a model too large to train here.
4. ``--mmap-threshold climbing`` keeps glibc's own mmap threshold in the sharded ranks (the loader pins it
   at 128 KiB by default, `pin_mmap_threshold`), to measure what pinning changes; world 1 loads whole
   (`from_pretrained`) and keeps glibc's default either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GiB = 1 << 30
SHARDS = 4

# The published config.json values (Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B on the Hugging Face Hub).
PUBLISHED_CONFIGS = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "max_position_embeddings": 32768, "rope_theta": 1000000.0},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "max_position_embeddings": 131072, "rope_theta": 1000000.0},
}
COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643,
          "eos_token_id": 151643, "use_sliding_window": False, "attention_bias": True}


# ------------------------------------------------------------------------------------------ the checkpoint
def generate_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """The ``name``-shaped random bf16 checkpoint in ``SHARDS`` files, written one shard at a time."""
    from safetensors.torch import save_file

    from scalerl.models.decoder import CausalLM
    from scalerl.models.hf_checkpoint import _hf_name, model_config_from_hf

    if (directory / "model.safetensors.index.json").is_file():
        return directory
    raw = {**COMMON, **PUBLISHED_CONFIGS[name]}
    cfg = model_config_from_hf(raw)
    with torch.device("meta"):
        model = CausalLM(cfg)
    shapes = {_hf_name(n): tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}
    sizes = {n: 2 * torch.Size(s).numel() for n, s in shapes.items()}
    total = sum(sizes.values())
    plan: list[list[str]] = [[] for _ in range(SHARDS)]
    done = 0
    for n in sorted(shapes):  # cut where the running total crosses each quarter
        plan[min(SHARDS - 1, done * SHARDS // total)].append(n)
        done += sizes[n]
    staged = directory.with_name(directory.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for i, names in enumerate(plan, start=1):
        fname = f"model-{i:05d}-of-{SHARDS:05d}.safetensors"
        shard = {}
        for n in names:
            if n.endswith("norm.weight"):
                shard[n] = torch.ones(shapes[n], dtype=torch.bfloat16)
            elif n.endswith(".bias"):
                shard[n] = torch.zeros(shapes[n], dtype=torch.bfloat16)
            else:
                shard[n] = (torch.randn(shapes[n], generator=generator) * 0.02).to(torch.bfloat16)
        save_file(shard, str(staged / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
        del shard
    (staged / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (staged / "config.json").write_text(json.dumps(raw, indent=2))
    staged.rename(directory)
    return directory


def parameter_count(name: str) -> int:
    from scalerl.models.decoder import CausalLM
    from scalerl.models.hf_checkpoint import model_config_from_hf

    with torch.device("meta"):
        return CausalLM(model_config_from_hf({**COMMON, **PUBLISHED_CONFIGS[name]})).num_parameters()


# ------------------------------------------------------------------------------------------------ one rank
def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / GiB
    return float("nan")


def directory_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GiB


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one configuration: load, step, checkpoint save + load, export; a JSON line to --report."""
    from torch.optim.lr_scheduler import LambdaLR

    from scalerl import checkpoint
    from scalerl.core.config import ParallelSection
    from scalerl.models.hf_checkpoint import from_pretrained, model_config_to_hf
    from scalerl.models.sharded_loading import load_local_shards, meta_model
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize

    torch.set_num_threads(1)
    if args.mmap_threshold == "climbing":  # the loader leaves glibc's threshold as it is
        import scalerl.models.sharded_loading as sharded_loading

        sharded_loading.pin_mmap_threshold = lambda *a, **k: False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = init_distributed(ParallelSection(dp_replicate=1, dp_shard=world), torch.device("cpu"))
    report: dict[str, float] = {"rank": ctx.rank}
    start = time.perf_counter()
    if world == 1 or args.loading == "whole":
        model = from_pretrained(args.model_dir)
        parts = parallelize(model, ctx)
    else:
        model = meta_model(args.model_dir)
        parts = parallelize(model, ctx)
        load_local_shards(model, args.model_dir)
    ctx.barrier()
    report["load_s"], report["rss_load_gib"] = time.perf_counter() - start, peak_rss_gib()

    out = Path(args.work_dir)
    if args.load_only:
        _export(model, ctx, args, out, report)
        return
    optimizer = torch.optim.AdamW(parts.parameters(), lr=1e-5, foreach=False)
    scheduler = LambdaLR(optimizer, lambda _: 1.0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    start = time.perf_counter()
    logits = parts.trained(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del logits
    ctx.barrier()
    report["step_s"], report["rss_step_gib"], report["loss"] = time.perf_counter() - start, peak_rss_gib(), loss.item()

    if not args.no_checkpoint:
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "generators": {}}
        start = time.perf_counter()
        saved = checkpoint.save(out / "checkpoints", 1, ctx=ctx, trainer_state={"step": 1}, config={}, keep_last=1,
                                model_config=model_config_to_hf(model.config), **state)
        ctx.barrier()
        report["save_s"] = time.perf_counter() - start
        report["checkpoint_gib"] = directory_gib(saved)
        start = time.perf_counter()
        checkpoint.load(saved, ctx=ctx, expected_config={}, strict_config_keys=[], **state)
        ctx.barrier()
        report["ckpt_load_s"], report["rss_checkpoint_gib"] = time.perf_counter() - start, peak_rss_gib()
    _export(model, ctx, args, out, report)


def _export(model, ctx, args: argparse.Namespace, out: Path, report: dict[str, float]) -> None:
    """The bf16 HF export (shards like the source's), timed; the rank's report line written."""
    from scalerl.checkpoint.export import export_hf_model

    start = time.perf_counter()
    export_hf_model(model, None, out / "export", ctx, dtype=torch.bfloat16,
                    max_shard_bytes=directory_gib(Path(args.model_dir)) * GiB / SHARDS + 1)
    report["export_s"], report["rss_export_gib"] = time.perf_counter() - start, peak_rss_gib()
    report["export_gib"] = directory_gib(out / "export")
    with open(args.report, "a") as f:
        f.write(json.dumps(report) + "\n")


# ---------------------------------------------------------------------------------------------- the runner
def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GiB
    return 0.0


def needed_gib(params: int, world: int, loading: str, checkpointing: bool, training: bool = True) -> float:
    """What a configuration needs on the machine, all ranks together (an estimate, on the safe side)."""
    train = (16 if training else 4) * params / GiB  # fp32 parameters (+ gradients, AdamW's two moments)
    whole_copy = 4 * params / GiB  # one fp32 copy of the model
    per_rank = 0.6 + train / world  # the interpreter and torch, the rank's share
    if world == 1 or loading == "whole":
        per_rank += 2 * whole_copy  # the loaded tensors and the model they fill
    if checkpointing and training and world == 1:
        per_rank += 12 * params / GiB  # a single-process checkpoint is read back whole (DCP: in place)
    return world * per_rank


def run_configuration(model: str, model_dir: Path, world: int, args: argparse.Namespace) -> list[dict] | str:
    """The rank reports of one configuration, or why it was skipped."""
    need = needed_gib(parameter_count(model), world, args.loading, not args.no_checkpoint, not args.load_only)
    have = available_gib()
    print(f"-- {model} world {world}: needs about {need:.1f} GiB, {have:.1f} GiB available (free -g below)",
          flush=True)
    subprocess.run(["free", "-g"], check=False)
    if need > 0.9 * have:
        return f"skipped: needs about {need:.1f} GiB, only {have:.1f} GiB available"
    work = Path(args.out) / f"run-{model}-w{world}-{args.loading}-{args.mmap_threshold}{'-load' if args.load_only else ''}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    report = work / "report.jsonl"
    from scalerl.core.net import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, __file__, "--rank-main", "--model-dir", str(model_dir), "--work-dir", str(work),
               "--report", str(report), "--loading", args.loading, "--batch", str(args.batch), "--seq", str(args.seq),
               "--mmap-threshold", args.mmap_threshold]
    command += [flag for flag, on in (("--no-checkpoint", args.no_checkpoint), ("--load-only", args.load_only)) if on]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(world)]
    codes = [_wait_or_kill(p, procs, RANK_LIMIT_S) for p in procs]
    if any(codes):
        return f"failed: exit codes {codes}"
    rows = sorted((json.loads(line) for line in report.read_text().splitlines()), key=lambda r: r["rank"])
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # gigabytes; the sizes are in the reports
    return rows


def print_table(results: dict[str, dict[int, list[dict] | str]]) -> None:
    print("\n| model | world | peak RSS per rank after load / step / ckpt / export (GiB, max over ranks) | "
          "vs world 1 (step, or load with --load-only) | load s | step s | ckpt save / load s | ckpt GiB | export s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, by_world in results.items():
        base = by_world.get(1)
        key = "rss_step_gib" if isinstance(base, list) and "rss_step_gib" in base[0] else "rss_load_gib"
        base_peak = max(r[key] for r in base) if isinstance(base, list) else None
        for world, rows in by_world.items():
            if isinstance(rows, str):
                print(f"| {model} | {world} | {rows} | | | | | | |")
                continue

            def most(key: str) -> float:
                return max(r.get(key, float("nan")) for r in rows)

            ratio = f"{most(key) / base_peak:.2f}x" if base_peak else "-"
            ckpt = f"{most('save_s'):.1f} / {most('ckpt_load_s'):.1f}" if "save_s" in rows[0] else "-"
            print(f"| {model} | {world} | {most('rss_load_gib'):.2f} / {most('rss_step_gib'):.2f} / "
                  f"{most('rss_checkpoint_gib'):.2f} / {most('rss_export_gib'):.2f} | {ratio} | "
                  f"{most('load_s'):.1f} | {most('step_s'):.1f} | {ckpt} | {most('checkpoint_gib'):.2f} | "
                  f"{most('export_s'):.1f} |")


RANK_LIMIT_S = 3600  # one configuration's ranks: load, step, checkpoint; a hung rank must not hold the run


def _wait_or_kill(proc: subprocess.Popen, procs: list[subprocess.Popen], limit_s: float) -> int:
    """``proc``'s exit code; past ``limit_s`` every rank is killed (a rank waiting on a dead peer never ends)."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        for other in procs:
            other.kill()
        proc.wait()
        return -9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["0.5b", "1.5b"], choices=sorted(PUBLISHED_CONFIGS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--loading", choices=["sharded", "whole"], default="sharded")
    parser.add_argument("--out", default="/tmp/real_size")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--no-checkpoint", action="store_true")
    parser.add_argument("--load-only", action="store_true", help="loading and the export only (no step)")
    parser.add_argument("--json")
    parser.add_argument("--mmap-threshold", choices=["pinned", "climbing"], default="pinned",
                        help="sharded ranks: the loader's pinned glibc mmap threshold, or glibc's climbing one")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", help=argparse.SUPPRESS)
    parser.add_argument("--report", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    results: dict[str, dict[int, list[dict] | str]] = {}
    for model in args.models:
        model_dir = generate_checkpoint(model, Path(args.out) / f"qwen2.5-{model}-shaped")
        results[model] = {}
        for world in args.worlds:
            results[model][world] = run_configuration(model, model_dir, world, args)
            print(json.dumps({"model": model, "world": world, "result": results[model][world]}), flush=True)
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
