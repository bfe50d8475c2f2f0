"""Weight sync on real GRPO updates: bytes per sync, delta vs a full push measured in the same run.

    python benchmarks/weight_sync.py [--sft-steps 400] [--grpo-steps 8] [--lrs 1e-6 3e-5] [--dtypes bf16 fp32]
                                     [--network [--rate-mbit 200] [--rounds 3] [--skip-grpo]] [--memory] [--json FILE]
    python benchmarks/weight_sync.py --checksum [--checksum-model qwen2.5-0.5b] [--dtypes bf16 fp32] [--rounds 3]

1. Warm start: the demo's SFT phase (weak-teacher demonstrations, `scalerl/configs/demo.yaml`),
   ``--sft-steps`` steps, cached in ``<out>/sft`` for later runs with the same step count.
2. For each learning rate: GRPO from that model (the demo config, ``actor.warmup_steps`` 0 unless
   ``--warmup-steps``, so the first steps move the weights by the full rate), ``--grpo-steps`` calls of
   ``RLTrainer.train_step()``. Before the first step and after every step the policy is synced, per rollout
   dtype, (a) as deltas to a built-in engine holding its own weights and (b) as full pushes to a second
   receiver. Every delta sync is checked bit-exact against the trainer's weights in that dtype. Printed:
   changed fraction, bytes of each, their ratio, the encodings chosen; the average saving after the first
   sync (the first is a full push either way).
3. ``--network``: the trainer weight states saved by step 2 (every sync, each learning rate), then a
   synthetic 12M-parameter model changing ~2% of its bf16 elements per step (4 MiB buckets), replayed in
   bf16 from one emulated node to another (network namespaces, a ``--rate-mbit`` tbf-shaped link; root +
   iproute2) over gloo broadcast: median time per sync after the first, full vs delta, same run, and
   how much of it the sender spent preparing (gathering, comparing, encoding).
4. ``--memory``: extra resident memory of one delta sync of a synthetic 48M-element model (192 fp32
   tensors of 1 MiB, bf16 rollout, sender and an in-process receiver together) for several bucket sizes,
   each in a fresh process (VmHWM after resetting it, glibc told to unmap every buffer over 128 KiB).
5. ``--checksum`` (alone: no GRPO, no warm start): `bucket_checksum` against `bucket_checksum_reference`
   (its first implementation) on a ``--checksum-model``-shaped state dict with random weights, built in
   memory, per rollout dtype: once per tensor (what a vLLM load checksums, on each side) and once per
   ``--bucket-mb`` slice of the flat state (what the sender and receiver do). Both ways alternate for
   ``--rounds`` rounds; the first call of each is reported apart (it pays page faults and allocations),
   then the median of the rest, the ratio old / new, and a check that both gave the same values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scalerl.comm.weights.channel import InProcessChannel
from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
from scalerl.comm.weights.sender import WeightSender
from scalerl.core.config import ROLLOUT_DTYPES
from scalerl.core.device import PRECISION_DTYPES

DEMO = ROOT / "scalerl" / "configs" / "demo.yaml"
MiB = 1 << 20


def warm_start(out: Path, steps: int) -> Path:
    """The demo's SFT phase (teacher rows, then train_sft); reused when already run with ``steps``."""
    from scalerl.core.config import load_config
    from scalerl.demo import write_teacher_demonstrations
    from scalerl.trainer.sft_trainer import train_sft

    marker = out / "sft" / "warm_start.json"
    model_dir = out / "sft" / "model"
    if marker.exists() and json.loads(marker.read_text()).get("steps") == steps and model_dir.exists():
        print(f"warm start: reusing {model_dir} ({steps} SFT steps)", flush=True)
        return model_dir
    cfg = load_config(DEMO, [f"sft.steps={steps}", f"trainer.output_dir={out}", "trainer.logger=[jsonl]",
                             "data.num_val=0", f"sft.output_dir={out / 'sft'}"])
    cfg.data.train_files = [str(write_teacher_demonstrations(cfg, out / "teacher.jsonl", 0))]
    start = time.perf_counter()
    train_sft(cfg)
    marker.write_text(json.dumps({"steps": steps}))
    print(f"warm start: {steps} SFT steps in {time.perf_counter() - start:.0f} s -> {model_dir}", flush=True)
    return model_dir


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


def grpo_bytes(sft_dir: Path, out: Path, lr: float, args) -> list[dict]:
    """GRPO steps at ``lr``, syncing after each: one row per (sync, dtype)."""
    from safetensors.torch import save_file

    from scalerl.core.config import load_config
    from scalerl.models.decoder import build_model
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.weight_loading import engine_weight_receiver
    from scalerl.trainer.rl_trainer import RLTrainer

    cfg = load_config(DEMO, [f"actor.lr={lr}", f"actor.warmup_steps={args.warmup_steps}", "data.num_val=0",
                             f"trainer.total_steps={args.grpo_steps}", "trainer.logger=[jsonl]",
                             f"trainer.output_dir={out / f'grpo_lr{lr:g}'}", f"trainer.init_from={sft_dir}"])
    trainer = RLTrainer.from_config(cfg)
    policy = trainer.policy.model
    pairs = {}
    for name in args.dtypes:
        dtype = PRECISION_DTYPES[name]
        engine = BuiltinEngine(build_model(policy.config, seed=1).to(dtype).eval(), trainer.tokenizer.pad_token_id)
        delta = WeightSender(dtype, int(args.bucket_mb * MiB), InProcessChannel([engine_weight_receiver(engine)]))
        full = WeightSender(dtype, int(args.bucket_mb * MiB), InProcessChannel([WeightReceiver(TensorDictStore())]),
                            mode="full")
        pairs[name] = (engine, delta, full)
    rows = []
    states = out / "states" / f"lr{lr:g}"
    states.mkdir(parents=True, exist_ok=True)
    for step in range(args.grpo_steps + 1):
        if step:
            trainer.train_step()
        save_file({n: p.detach().contiguous() for n, p in policy.named_parameters()}, str(states / f"{step:03d}.safetensors"))
        for name, (engine, delta, full) in pairs.items():
            d = delta.sync(policy.named_parameters())
            f = full.sync(policy.named_parameters())
            trained = dict(policy.named_parameters())
            exact = all(torch.equal(_bits(p), _bits(trained[n].to(PRECISION_DTYPES[name])))
                        for n, p in engine.model.named_parameters())
            rows.append({"lr": lr, "dtype": name, "step": step, "changed_fraction": d.changed_fraction,
                         "delta_bytes": d.bytes, "full_bytes": f.bytes, "ratio": d.bytes / f.bytes,
                         "dynamic_tensors": d.dynamic_tensors, "static_tensors": d.static_tensors,
                         "encodings": d.encodings, "delta_s": d.seconds, "full_s": f.seconds, "bit_exact": exact})
            r = rows[-1]
            print(f"lr {lr:g} {name} sync {step}: changed {r['changed_fraction']:7.2%}  delta {r['delta_bytes']:9d} B  "
                  f"full {r['full_bytes']:9d} B  delta/full {r['ratio']:.4f}  encode {r['delta_s'] * 1e3:6.1f} ms  "
                  f"bit-exact {exact}  {r['encodings']}", flush=True)
            if not exact:
                raise AssertionError(f"delta sync not bit-exact at lr {lr} {name} step {step}")
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for lr in sorted({r["lr"] for r in rows}):
        for dtype in sorted({r["dtype"] for r in rows}):
            after = [r for r in rows if r["lr"] == lr and r["dtype"] == dtype and r["step"] > 0]
            if not after:
                continue
            saving = 1 - sum(r["delta_bytes"] for r in after) / sum(r["full_bytes"] for r in after)
            out.append({"lr": lr, "dtype": dtype, "syncs": len(after), "mean_saving": saving,
                        "changed_first": after[0]["changed_fraction"], "changed_last": after[-1]["changed_fraction"],
                        "all_bit_exact": all(r["bit_exact"] for r in rows if r["lr"] == lr and r["dtype"] == dtype)})
            s = out[-1]
            print(f"lr {lr:g} {dtype}: {s['syncs']} syncs after the first: delta sends {s['mean_saving']:.2%} fewer bytes "
                  f"than full pushes (changed {s['changed_first']:.2%} -> {s['changed_last']:.2%}), "
                  f"bit-exact {s['all_bit_exact']}", flush=True)
    return out


# ------------------------------------------------------------------------------------ emulated network
def synthetic_states(out: Path, syncs: int = 6, tensors: int = 48, elems: int = 256 * 1024,
                     fraction: float = 0.02) -> Path:
    """Weight states of a synthetic 12M-parameter model whose every step moves ~``fraction`` of its bf16
    elements by about one ulp (the pattern of the demo's GRPO steps at lr 1e-6), large enough that a full
    bf16 push (24 MiB) takes about a second on a 200 Mbit link."""
    from safetensors.torch import save_file

    folder = out / "states" / "synthetic"
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(elems, generator=g) * 0.02 for i in range(tensors)}
    for step in range(syncs):
        if step:
            for t in state.values():
                pick = torch.rand(elems, generator=g) < fraction
                t[pick] *= 1 + 2.0 ** -7 * torch.randn(int(pick.sum()), generator=g).sign()
        save_file(state, str(folder / f"{step:03d}.safetensors"))
    return folder


def replay_rank(states: Path, result: Path, rounds: int, bucket_mb: float) -> None:
    """One rank of the network replay (launched by `network_timing` inside an emulated node)."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from scalerl.comm.weights.channel import BroadcastChannel, serve_broadcast

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=300))
    files = sorted(states.glob("*.safetensors"))
    times: dict[str, list[float]] = {"full": [], "delta": []}
    prepare: dict[str, list[float]] = {"full": [], "delta": []}
    sizes: dict[str, list[int]] = {"full": [], "delta": []}
    for _ in range(rounds):
        for mode in ("full", "delta"):
            if dist.get_rank() == 1:
                receiver = WeightReceiver(TensorDictStore())
                for _ in files:
                    serve_broadcast(receiver.handle, None, src=0, timeout_s=300)
                continue
            sender = WeightSender(torch.bfloat16, int(bucket_mb * MiB), BroadcastChannel(None, src=0, timeout_s=300),
                                  mode=mode)
            for i, path in enumerate(files):
                state = load_file(str(path))
                start = time.perf_counter()
                report = sender.sync(state.items())
                if i:  # after the first (full) sync
                    times[mode].append(time.perf_counter() - start)
                    prepare[mode].append(report.prepare_seconds)
                    sizes[mode].append(report.bytes)
    if dist.get_rank() == 0:
        result.write_text(json.dumps({"times": times, "prepare": prepare, "bytes": sizes}))
    dist.destroy_process_group()


def network_timing(states: Path, rate_mbit: float, rounds: int, bucket_mb: float) -> dict:
    from scalerl.launch.emulated_cluster import EmulatedCluster

    result = states.parent / "network_result.json"
    result.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--replay", str(states), str(result), str(rounds),
            str(bucket_mb)]
    with EmulatedCluster(nodes=2, rate_mbit=rate_mbit) as cluster:
        ranks = cluster.run_ranks(argv, ranks_per_node=1, env={"PYTHONPATH": str(ROOT)}, timeout_s=600)
    if any(r.returncode for r in ranks):
        raise RuntimeError("network replay failed: " + " | ".join(f"rank {r.rank}: {r.describe()} {r.output}" for r in ranks))
    data = json.loads(result.read_text())
    full, delta = statistics.median(data["times"]["full"]), statistics.median(data["times"]["delta"])
    row = {"states": str(states), "rate_mbit": rate_mbit, "full_s": full, "delta_s": delta, "speedup": full / delta,
           "full_prepare_s": statistics.median(data["prepare"]["full"]),
           "delta_prepare_s": statistics.median(data["prepare"]["delta"]),
           "full_bytes": statistics.mean(data["bytes"]["full"]), "delta_bytes": statistics.mean(data["bytes"]["delta"])}
    print(f"{states.name}, {rate_mbit:g} Mbit link: median sync full {full * 1e3:.1f} ms ({row['full_bytes']:.0f} B, "
          f"{row['full_prepare_s'] * 1e3:.1f} ms preparing), delta {delta * 1e3:.1f} ms ({row['delta_bytes']:.0f} B, "
          f"{row['delta_prepare_s'] * 1e3:.1f} ms preparing): {row['speedup']:.2f}x", flush=True)
    return row


# ----------------------------------------------------------------------------------------------- memory
def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def memory_rank(bucket_mb: float) -> None:
    """Measure one delta sync's extra resident memory (printed as JSON); run in a fresh process."""
    g = torch.Generator().manual_seed(0)
    params = [(f"t{i}", torch.randn(256 * 1024, generator=g)) for i in range(192)]  # 48M fp32 elements
    store = TensorDictStore()
    sender = WeightSender(torch.bfloat16, int(bucket_mb * MiB), InProcessChannel([WeightReceiver(store)]))
    sender.sync(params)  # full push: allocates the snapshot and the receiver's copy (not transient)
    for _, p in params:
        p.add_(torch.randn(p.shape, generator=g) * 1e-3)  # most bf16 elements move: the heaviest delta
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    report = sender.sync(params)
    extra = (_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"bucket_mb": bucket_mb, "extra_bytes": extra, "accounted_peak_bytes": report.peak_bucket_bytes,
                      "changed_fraction": report.changed_fraction, "model_bf16_bytes": report.full_bytes}))


def memory_table(bucket_sizes: list[float]) -> list[dict]:
    rows = []
    for mb in bucket_sizes:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--memory-rank", str(mb)],
                              capture_output=True, text=True, timeout=600, check=True,
                              # Every buffer over 128 KiB its own mapping, unmapped when freed: the high-water
                              # mark then counts buffers alive at once, not what glibc's heap kept for reuse.
                              env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                                   "MALLOC_MMAP_THRESHOLD_": "131072"})
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["extra_per_bucket"] = row["extra_bytes"] / (mb * MiB)
        rows.append(row)
        print(f"bucket {mb:5g} MiB: extra RSS during a delta sync {row['extra_bytes'] / MiB:7.1f} MiB "
              f"({row['extra_per_bucket']:.1f} x bucket; model in bf16 {row['model_bf16_bytes'] / MiB:.0f} MiB; "
              f"sender's own count {row['accounted_peak_bytes'] / MiB:.1f} MiB)", flush=True)
    return rows


def checksum_state(model: str, dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat bit view of ``model``'s parameters (random, normal * 0.02, in ``dtype``) and each tensor's view of it."""
    from scalerl.bench.cost_model.model_shapes import model_shape
    from scalerl.comm.weights.delta import int_view_dtype
    from scalerl.models.decoder import CausalLM

    with torch.device("meta"):
        shapes = [p.shape for _, p in CausalLM(model_shape(model)).named_parameters()]
    flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype)
    g = torch.Generator().manual_seed(0)
    step = 1 << 24
    for start in range(0, flat.numel(), step):  # filled piecewise: no fp32 copy of the whole model
        piece = flat[start : start + step]
        piece.copy_(torch.randn(piece.numel(), generator=g) * 0.02)
    bits = flat.view(int_view_dtype(dtype))
    views, offset = [], 0
    for shape in shapes:
        views.append(bits[offset : offset + shape.numel()])
        offset += shape.numel()
    return bits, views


def checksum_timing(model: str, dtypes: list[str], rounds: int, bucket_mb: float) -> list[dict]:
    """Old against new checksum, same process, alternating; one row per (dtype, granularity)."""
    from scalerl.comm.weights.delta import bucket_checksum, bucket_checksum_reference

    rows = []
    for name in dtypes:
        bits, views = checksum_state(model, PRECISION_DTYPES[name])
        per_bucket = max(1, int(bucket_mb * MiB) // bits.element_size())
        buckets = [bits[s : s + per_bucket] for s in range(0, bits.numel(), per_bucket)]
        for what, pieces in (("per tensor", views), ("per bucket", buckets)):
            times: dict[str, list[float]] = {"old": [], "new": []}
            values: dict[str, list[int]] = {}
            for r in range(rounds + 1):
                for way, fn in ((("old", bucket_checksum_reference), ("new", bucket_checksum)) if r % 2 == 0 else
                                (("new", bucket_checksum), ("old", bucket_checksum_reference))):
                    start = time.perf_counter()
                    values[way] = [fn(p) for p in pieces]
                    times[way].append(time.perf_counter() - start)
            same = values["old"] == values["new"]
            row = {"dtype": name, "granularity": what, "elements": bits.numel(), "calls": len(pieces), "same": same,
                   **{f"{w}_first_s": t[0] for w, t in times.items()},
                   **{f"{w}_s": statistics.median(t[1:]) for w, t in times.items()}}
            row["ratio"] = row["old_s"] / row["new_s"]
            row["ratio_first"] = row["old_first_s"] / row["new_first_s"]
            rows.append(row)
            print(f"{model} {name:4s} {what}: {len(pieces):4d} calls over {bits.numel() / 1e6:.0f}M elements | "
                  f"old {row['old_s']:.3f} s ({row['old_s'] / bits.numel() * 1e9:.2f} ns/el, first "
                  f"{row['old_first_s']:.3f} s) | new {row['new_s']:.3f} s ({row['new_s'] / bits.numel() * 1e9:.2f} "
                  f"ns/el, first {row['new_first_s']:.3f} s) | old/new {row['ratio']:.1f}x (first "
                  f"{row['ratio_first']:.1f}x) | same values: {same}", flush=True)
            if not same:
                raise SystemExit("bucket_checksum differs from bucket_checksum_reference")
        del bits, views, buckets
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replay":
        return replay_rank(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-rank":
        return memory_rank(float(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "outputs" / "bench_weight_sync"))
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--grpo-steps", type=int, default=8)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 3e-5])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=sorted(ROLLOUT_DTYPES))
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--network", action="store_true", help="time syncs over an emulated link (root)")
    parser.add_argument("--rate-mbit", type=float, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="network: full and delta passes each")
    parser.add_argument("--memory", action="store_true", help="extra RSS of a delta sync per bucket size")
    parser.add_argument("--skip-grpo", action="store_true", help="reuse the states of an earlier run (network only)")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--checksum", action="store_true", help="old against new bucket_checksum, nothing else")
    parser.add_argument("--checksum-model", default="qwen2.5-0.5b")
    args = parser.parse_args()
    if args.checksum:  # torch's default threads: what the trainer and vLLM's worker checksum with
        rows = checksum_timing(args.checksum_model, args.dtypes, args.rounds, args.bucket_mb)
        if args.json:
            Path(args.json).write_text(json.dumps({"checksum": rows}, indent=2))
        return
    torch.set_num_threads(1)
    out = Path(args.out)
    result: dict = {}
    if args.lrs and not args.skip_grpo:
        sft_dir = warm_start(out, args.sft_steps)
        rows = [row for lr in args.lrs for row in grpo_bytes(sft_dir, out, lr, args)]
        result["syncs"], result["summary"] = rows, summarize(rows)
    if args.network:
        result["network"] = [network_timing(out / "states" / f"lr{lr:g}", args.rate_mbit, args.rounds, args.bucket_mb)
                             for lr in args.lrs]
        result["network"].append(network_timing(synthetic_states(out), args.rate_mbit, args.rounds, 4))
    if args.memory:
        result["memory"] = memory_table([1, 4, 16, 64])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
