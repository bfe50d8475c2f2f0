"""Ulysses sequence parallelism: the longest context whose training step fits a fixed per-rank memory limit, at
sp=1, 2 and 4, and the step time, all in one run.

    python benchmarks/long_context.py [--limit-mib 160] [--lengths 1024,2048,4096,8192,16384] [--sps 1,2,4]

Each sp runs in its own gloo group of sp processes (one thread each), through `parallelize` (DDP over the sp
ranks, the all-to-alls around attention) on the built-in model's architecture (hidden 128, 2 layers, 4 heads
over 2 kv heads; positions up to the longest length). A step is one forward + backward of a next-token loss
on one sequence of L tokens (a packed row or one long response: plain causal attention, no padding mask),
the log-probs taken as the trainer's losses take them (`MicroBatchObjective.response_token_outputs`).
Lengths are tried in increasing order until a step's peak goes over the limit on some rank.

Memory method: each rank's resident set (``/proc/self/statm``) sampled every millisecond by a thread during
the step, minus its resident set just before it: the memory the step itself takes (activations saved for
backward, gradients, attention workspaces, the all-to-all buffers). glibc is told to map every allocation
over 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the resident set and each step
starts from the same base. The bytes autograd saves for backward are reported beside it (exact, per rank).
Step time: the best of ``--repeats`` steps after an untimed one.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

BUILTIN = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2}
PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakSampler:
    """The largest resident set seen while the ``with`` block runs, sampled every millisecond."""

    def __enter__(self):
        self.base = self.peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)  # the sampler stops within a millisecond of the event
        self.peak = max(self.peak, resident_bytes())


def _loss(output, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token negative log-likelihood, through the losses' own per-token path (under sp: log-probs
    computed on each rank's shard of the logits, only they gathered)."""
    from scalerl.algorithms.entropy import logprobs_from_logits
    from scalerl.trainer.objectives import MicroBatchObjective

    return -MicroBatchObjective.response_token_outputs(output, target[:, 1:], logprobs_from_logits).mean()


def _step(parts, ids: torch.Tensor) -> tuple[int, int, float]:
    """One forward + backward: (peak bytes over the base, bytes saved for backward, seconds)."""
    from scalerl.parallel.parallelize import MicroBatch

    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    for p in parts.model.parameters():
        p.grad = None
    start = time.perf_counter()
    with PeakSampler() as sampler, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        parts.forward_backward([MicroBatch(ids, None, ids)], _loss)
    return sampler.peak - sampler.base, saved[0], time.perf_counter() - start


def _rank(rank: int, sp: int, lengths: list[int], limit: int, repeats: int) -> list[dict]:
    import torch.distributed as dist

    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model
    from scalerl.parallel.distributed import DistContext, single_process_context
    from scalerl.parallel.mesh import ParallelDims
    from scalerl.parallel.parallelize import parallelize

    if sp == 1:
        ctx = single_process_context()
    else:
        dims = ParallelDims(pp=1, dp_replicate=1, dp_shard=1, tp=1, sp=sp)
        mesh, dp_mesh = dims.build_mesh("cpu")
        ctx = DistContext(dims, mesh, dp_mesh, rank=rank)
    model = build_model(ModelConfig(**BUILTIN, max_position_embeddings=max(lengths)), seed=0)
    parts = parallelize(model, ctx)
    parts.train()
    rows = []
    for length in lengths:
        ids = torch.randint(0, BUILTIN["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
        _step(parts, ids)  # untimed: first-call allocations, the rotary table
        runs = [_step(parts, ids) for _ in range(repeats)]
        peak = max(r[0] for r in runs)
        if sp > 1:  # the worst rank decides what fits
            t = torch.tensor([float(peak)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            peak = int(t.item())
        rows.append({"length": length, "peak": peak, "saved": runs[0][1], "seconds": min(r[2] for r in runs)})
        if peak > limit:
            break
    return rows


def measure(sp: int, lengths: list[int], limit: int, repeats: int) -> list[dict]:
    from tests.spawned_group import run_in_group

    if sp == 1:
        return run_in_group(_rank, 1, sp, lengths, limit, repeats, init_group=False, timeout_s=3600)[0]
    return run_in_group(_rank, sp, sp, lengths, limit, repeats, timeout_s=3600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit-mib", type=float, default=160.0, help="per-rank memory limit of one step")
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--sps", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks: freed tensors unmap
    os.environ["MALLOC_TRIM_THRESHOLD_"] = "0"
    limit = int(args.limit_mib * 2**20)
    lengths = [int(x) for x in args.lengths.split(",")]
    results = {sp: measure(sp, lengths, limit, args.repeats) for sp in map(int, args.sps.split(","))}
    print(f"per-rank limit {args.limit_mib:g} MiB; one forward + backward of one sequence on the built-in model")
    print(f"{'sp':>3} {'length':>7} {'peak MiB':>9} {'saved MiB':>10} {'step s':>7}  fits")
    for sp, rows in results.items():
        for r in rows:
            print(f"{sp:>3} {r['length']:>7} {r['peak'] / 2**20:>9.1f} {r['saved'] / 2**20:>10.1f} "
                  f"{r['seconds']:>7.2f}  {'yes' if r['peak'] <= limit else 'no'}")
    longest = {sp: max((r for r in rows if r["peak"] <= limit), key=lambda r: r["length"], default=None)
               for sp, rows in results.items()}
    base = longest.get(1)
    print("\nlongest context within the limit, and its step time:")
    for sp, r in longest.items():
        if r is None:
            print(f"  sp={sp}: nothing fits")
            continue
        ratio = f"  ({r['length'] / base['length']:.1f}x sp=1's context)" if base else ""
        print(f"  sp={sp}: {r['length']} tokens, {r['peak'] / 2**20:.1f} MiB, {r['seconds']:.2f} s{ratio}")
    if base:
        same = base["length"]
        print(f"\nstep time at sp=1's longest ({same} tokens):")
        for sp, rows in results.items():
            at = next((r for r in rows if r["length"] == same), None)
            if at is not None:
                print(f"  sp={sp}: {at['seconds']:.2f} s ({base['seconds'] / at['seconds']:.2f}x sp=1's speed), "
                      f"peak {at['peak'] / 2**20:.1f} MiB ({base['peak'] / max(at['peak'], 1):.2f}x less)")


if __name__ == "__main__":
    main()
