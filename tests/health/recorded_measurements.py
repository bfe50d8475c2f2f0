"""Recorded measurements for the doctor's rules: a healthy 4-rank world (facts as `scalerl doctor` collects
them, a profile as `--performance-profiling` records it) and helpers that break one thing at a time."""

from __future__ import annotations

import copy

MiB = 2**20
# `CpuCapabilities.as_dict()` of two CPUs: a Sapphire Rapids Xeon (AMX and AVX-512 BF16/FP16; every oneDNN
# blocked layout runs) and the AVX2-only AMD EPYC this project is developed on (recorded here).
XEON_AMX = {"level": "native", "model": "Intel(R) Xeon(R) Platinum 8480+", "machine": "x86_64",
            "flags": ["avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                      "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"],
            "aten": "AVX512", "bf16_matmul": ["amx_bf16", "avx512_bf16"], "fp16_matmul": ["avx512_fp16"],
            "onednn_linear": {"fp32": "", "bf16": "", "fp16": ""}}
EPYC_AVX2 = {"level": "native", "model": "AMD EPYC", "machine": "x86_64", "flags": ["avx2", "fma", "f16c"],
             "aten": "AVX2", "bf16_matmul": [], "fp16_matmul": [],
             "onednn_linear": {"fp32": "", "bf16": "mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                                               "avx_ne_convert or avx512bw, avx512vl and avx512dq",
                               "fp16": "mkldnn_reorder_linear_weight: fp16 path needs the cpu support "
                                       "avx_ne_convert or avx512_fp16"}}


def rank_facts(rank: int, host: str = "node0", node_rank: int = 0, local_world: int = 4, device: str = "cpu",
               interface: str = "eth0", speed_mbit: int | None = 10000) -> dict:
    return {
        "rank": rank, "world_size": 4, "local_rank": rank % local_world, "local_world_size": local_world,
        "node_rank": node_rank, "launcher": "torchrun", "hostname": host, "node_id": f"boot-{host}:net:[1]",
        "device": device, "master": "node0:29500",
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None, "nccl": None, "gpu_driver": None,
                     "scalerl": "0.1.0"},
        "gpus": [], "memory": {"total_gb": 64.0, "available_gb": 60.0}, "cpu": copy.deepcopy(XEON_AMX),
        "interfaces": [{"name": interface, "kind": "ethernet", "speed_mbit": speed_mbit, "ipv4": ["10.0.0.1/24"],
                        "virtual_kind": "", "up": True, "driver": "mlx5_core"}],
        "socket": {"available": [interface, "lo"], "suggestion": interface, "variable": "GLOO_SOCKET_IFNAME",
                   "value": interface, "missing": [], "interface": interface, "kind": "ethernet", "virtual_kind": "",
                   "link_local": False, "speed_mbit": speed_mbit, "address": f"10.0.0.{node_rank + 1}"},
        "paths": [{"role": "output", "path": "/shared/run", "exists": True, "free_bytes": 500 * 2**30},
                  {"role": "checkpoint", "path": "/shared/run/checkpoints", "exists": True, "free_bytes": 500 * 2**30}],
    }


def healthy_facts(nodes: int = 1) -> list[dict]:
    per_node = 4 // nodes
    return [rank_facts(r, host=f"node{r // per_node}", node_rank=r // per_node, local_world=per_node) for r in range(4)]


def sweep(scope: str, ranks: list[int], busbw: float) -> dict:
    n = len(ranks)
    results = []
    for size in (MiB, 4 * MiB, 16 * MiB):
        algbw = busbw / (2 * (n - 1) / n)
        results.append({"size": size, "time_s": size / algbw, "algbw": algbw, "busbw": busbw})
    return {"scope": scope, "ranks": ranks, "results": results}


def healthy_cluster_measurements(nodes: int = 2) -> dict:
    """2 nodes x 2 ranks on 10 Gbit/s Ethernet, links at ~85% of it, both paths shared."""
    link = 10e9 / 8
    return {
        "rendezvous": {"world_size": 4, "joined": [0, 1, 2, 3], "missing": [], "join_timeout_s": 60,
                       "master": "node0:29500"},
        "bandwidth": {"sweeps": [sweep("intra-node", [0, 1], 5e9), sweep("intra-node", [2, 3], 5e9),
                                 sweep("inter-node", [0, 2], 0.85 * link)],
                      "pairs": [{"a": "node0", "b": "node1", "size": 16 * MiB, "seconds": 0.016,
                                 "bytes_per_s": 0.85 * link}],
                      "nodes": nodes, "nominal": {"interface": "eth0", "host": "node0", "bytes_per_s": link}},
        "shared": {"paths": [{"role": "output", "path": "/shared/run", "writer": "node0", "shared_with": ["node1"],
                              "not_shared_with": []},
                             {"role": "checkpoint", "path": "/shared/run/checkpoints", "writer": "node0",
                              "shared_with": ["node1"], "not_shared_with": []}]},
    }


def rank_profile(rank: int, busy: float = 1.0, tokens: float = 1000.0, data: float = 0.01, comm: float = 0.05,
                 steps: int = 3) -> dict:
    peer = 0.1
    step = 1.3
    phases = {
        "data": {"time_s": data, "busy_s": data, "wait_s": 0.0, "peer_s": 0.0, "comm_s": 0.0, "peak_gb": 1.0},
        "gen": {"time_s": 0.6, "busy_s": busy * 0.5, "wait_s": 0.1, "peer_s": 0.08, "comm_s": 0.02, "peak_gb": 3.0},
        "update_actor": {"time_s": 0.6, "busy_s": busy * 0.5, "wait_s": 0.05, "peer_s": 0.02, "comm_s": 0.03,
                         "peak_gb": 4.0},
    }
    return {"rank": rank, "host": "node0", "step_s": step, "busy_s": busy, "busy_by_step": [busy] * steps,
            "peer_s": peer, "comm_s": comm, "wait_s": peer + comm, "update_tokens": tokens, "phases": phases,
            "capacity_gb": 16.0, "state_bytes": 10 * MiB,
            # host RAM peaks (GiB) around the steps, the node's memory, the run's own save (s)
            "host_ram": {"load": 2.0, "checkpoint": 2.5, "export": 2.2}, "node_memory_gb": 64.0, "save_s": 3.0}


def healthy_profile() -> tuple[dict, list[dict], dict]:
    """(reduced metrics, per-rank records, context) of a healthy data-parallel profile."""
    records = [rank_profile(r, busy=1.0 + 0.02 * r, tokens=1000 + 10 * r) for r in range(4)]
    metrics = {"timing_s/step": 1.3, "timing_s/data": 0.01, "perf/max_memory_gb": 4.0,
               "actor/pg_loss": 0.1, "actor/grad_norm": 0.5, "critic/score/mean": 0.4,
               "balance/token_imbalance_before": 1.3, "balance/token_imbalance": 1.01}
    context = {"device": "cpu", "world_size": 4, "dp_size": 4, "tp": 1, "pp": 1, "dp_replicate": 4,
               "microbatches": 4, "pp_schedule": "1f1b", "balance_batch": True, "hidden_size": 896,
               "dtype_bytes": 2, "layer_params": 14.9e6, "link_busbw": 5e9, "checkpoint_bytes": 2 * 2**30,
               "write_bytes_per_s": 500 * MiB, "save_every": 50, "keep_last": 2, "free_bytes": 400 * 2**30,
               "checkpoint_path": "/shared/run/checkpoints", "save_s": 3.0, "total_steps": 500,
               # dtype_bytes 2: the run computes in bf16 (on a CPU with AVX-512 BF16, probed 3.1x fp32)
               "precision": "bf16", "bf16_hardware": "avx512_bf16", "bf16_over_fp32": 3.1}
    return metrics, records, context


def modified(value, **changes):
    out = copy.deepcopy(value)
    out.update(changes)
    return out
