"""One rank of a benchmark cell: ``python -m scalerl.bench.cell_rank SPEC.json``, started by the cell runner
with the rank variables set (locally, or inside an emulated node).

The rank joins the group as the trainer does, runs ``warmup`` steps, then ``steps`` measured steps, and
writes ``rank<R>.json`` into the spec's ``out_dir``: its CPU seconds and wall seconds per measured step, the
host's busy CPU seconds over the same steps (to tell other processes' load), and on rank 0 the step
metrics reduced over ranks (``steps.json``). A standalone rollout worker serves until the trainer closes it.
In the calibration cell the baselines run between measured steps (`scalerl.bench.baselines`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

KEPT_PREFIXES = ("timing_s/", "perf/", "comm/", "response_length/", "weight_sync/", "balance/", "rollout/")


def _cpu_seconds() -> float:
    return time.process_time()


def _kept(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k.startswith(KEPT_PREFIXES)}


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def run(spec: dict[str, Any]) -> int:
    threads = int(spec.get("threads", 1))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    from scalerl.core.config import load_config
    from scalerl.core.device import resolve_device
    from scalerl.core.threads import read_cpu_counters
    from scalerl.parallel.process_group import stop_heartbeat
    from scalerl.rollout.worker.worker import RolloutWorker
    from scalerl.trainer.rl_trainer import RLTrainer
    from scalerl.trainer.run import start_run

    out_dir = Path(spec["out_dir"])
    cfg = load_config(None, spec["overrides"])
    device = resolve_device(cfg.trainer.device)
    ctx = start_run(cfg, RLTrainer.kind)
    record: dict[str, Any] = {"rank": ctx.rank, "role": "trainer" if ctx.is_trainer else "rollout_worker",
                              "threads": torch.get_num_threads(), "pid": os.getpid()}
    try:
        if not ctx.is_trainer:
            start_wall, start_cpu = time.perf_counter(), _cpu_seconds()
            RolloutWorker(cfg, device, ctx.rollout_group).serve()
            record.update(wall_s=[time.perf_counter() - start_wall], cpu_s=[_cpu_seconds() - start_cpu])
            _write_json(out_dir / f"rank{ctx.rank}.json", record)
            _leave_together(dist)
            return 0
        captured: dict[str, Any] = {}
        # The step's batch, with advantages, for the baselines.
        trainer = RLTrainer(cfg, ctx, on_batch=lambda batch: captured.update(batch=batch))
        for _ in range(spec["warmup"]):
            trainer.advance()
        plain = generate = compute_probe = None
        baselines: dict[str, list[float]] = {}
        if spec.get("calibration") and ctx.world_size == 1:
            from scalerl.bench.compute_probe import probe_compute

            compute_probe = probe_compute(trainer.policy.model, trainer.tokenizer.pad_token_id,
                                          cfg.actor.ppo_micro_batch_size, cfg.rollout.max_new_tokens)
        if spec.get("baselines") and ctx.world_size == 1:
            from scalerl.bench.baselines import baseline_setup, run_baselines

            plain, generate, record["baseline_notes"] = baseline_setup(trainer, True, True)
            if "batch" in captured:
                run_baselines(trainer, captured["batch"], plain, generate, {})  # warm-up, not recorded
        rounds = min(spec["steps"], int(spec.get("baseline_rounds", 10)))
        every = max(1, spec["steps"] // max(1, rounds))
        steps, walls, cpus, host_busy = [], [], [], []
        for i in range(spec["steps"]):
            counters, wall, cpu = read_cpu_counters(), time.perf_counter(), _cpu_seconds()
            metrics = trainer.advance()
            walls.append(time.perf_counter() - wall)
            cpus.append(_cpu_seconds() - cpu)
            after = read_cpu_counters()
            if counters is not None and after is not None:
                host_busy.append(after.system_busy - counters.system_busy)
            steps.append(_kept(metrics))
            if (plain or generate) and i % every == 0 and len(baselines.get("plain_update_s", [])) < rounds:
                run_baselines(trainer, captured["batch"], plain, generate, baselines)
                steps[-1]["bench/baseline_after"] = 1.0
        trainer.rollouts.close()
        trainer.logger.close()
        record.update(wall_s=walls, cpu_s=cpus, host_busy_s=host_busy, cores=os.cpu_count())
        if ctx.is_main:
            _write_json(out_dir / "steps.json", {"steps": steps, "baselines": baselines,
                                                 "model": _model_facts(trainer), "compute_probe": compute_probe})
        _write_json(out_dir / f"rank{ctx.rank}.json", record)
        _leave_together(dist)
        return 0
    finally:
        stop_heartbeat()
        if dist.is_initialized():
            dist.destroy_process_group()


def _leave_together(dist) -> None:
    """Every rank, rollout workers included, waits here before tearing down: rank 0 hosts the store the
    others' heartbeat threads talk to, and a store gone mid-call aborts a process on its way out."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _model_facts(trainer) -> dict[str, Any]:
    from scalerl.models.hf_checkpoint import model_config_to_hf
    from scalerl.perf.flops import decoder_param_count

    mc = trainer.model_config
    return {"config": model_config_to_hf(mc), "params": decoder_param_count(mc),
            "name": trainer.cfg.model.path or "builtin"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m scalerl.bench.cell_rank SPEC.json", file=sys.stderr)
        return 2
    return run(json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    sys.exit(main())
