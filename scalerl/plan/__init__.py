"""`scalerl plan`: before a run starts, its predicted time and peak memory per rank and phase on a given
cluster, the first phase that would not fit (with the fix), and recommendations, each with why.

- `memory`: the per-rank memory of each phase, split into its parts (parameters, gradients, optimizer
  state, activations, KV cache, weight-sync buckets, checkpoint spike, host RAM); activations from the
  tensors scalerl's own decoder saves for backward, read on the meta device.
- `timing`: the per-phase time, from the cost model (`scalerl.bench.cost_model`) at rates calibrated here
  by the compute probe (`scalerl.bench.compute_probe`) on the CPU, or from datasheet tables for a GPU.
- `cli`: the setup read from a config and a cluster, fits and fixes, recommendations, the table.

The command's arguments and epilog live here, not in `cli`: `scalerl`'s parser is built without importing
torch, which `memory` and `timing` (through the cost model) do.
"""

from __future__ import annotations

import argparse

EPILOG = """\
what it says, per trainer rank (and per rollout worker when standalone):
  each phase (generation, old/ref log-prob, update, weight sync, checkpoint save, evaluation): predicted
  seconds and peak memory split into parameters, gradients, optimizer, activations, logits, KV cache,
  weight-sync buckets, checkpoint spike; host RAM per node (loading, export); the first phase that does not
  fit with the override that fixes it; recommendations (placement, FSDP/TP degrees, micro-batch, bucket).

examples:
  scalerl plan run.yaml                                       # this machine (CPU), calibrated here
  scalerl plan run.yaml --devices-per-node 2 parallel.dp_shard=2
  scalerl plan run.yaml --model qwen2.5-7b --nodes 1 --devices-per-node 8 --device h100
  scalerl plan run.yaml --memory-gb 0.5 --json plan.json      # a tighter budget per rank
  scalerl plan run.yaml --model qwen2.5-7b --doctor doctor.json  # the cluster a doctor report measured
"""


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [CONFIG.yaml] [key=value ...] [options]"
    parser.add_argument("config_args", nargs="*", metavar="CONFIG.yaml | key=value")
    parser.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes (1; or the --doctor report's)")
    parser.add_argument("--devices-per-node", type=int, default=None, metavar="G",
                        help="ranks per node (GPUs; on the CPU: processes) (1; or the --doctor report's)")
    parser.add_argument("--device", default=None, metavar="NAME",
                        help="cpu (calibrated here) | h100 | h200 | a100 | ... (datasheets) (cpu; or the --doctor "
                             "report's GPU)")
    parser.add_argument("--doctor", metavar="REPORT.json", default=None,
                        help="a `scalerl doctor --distributed-check [--performance-profiling] --json` report of the "
                             "cluster: its shape, GPU and memory, links (its all-reduce sweeps), checkpoint write "
                             "speed and profiled update MFU in place of the datasheet's")
    parser.add_argument("--link", default=None, metavar="PRESET",
                        help="inter-node link for a GPU cluster: ib-ndr | ib-hdr | 100gbe | 25gbe (ib-ndr)")
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="project a named architecture instead of the config's (qwen2.5-0.5b ... qwen2.5-72b)")
    parser.add_argument("--memory-gb", type=float, default=None, metavar="GB",
                        help="memory per rank (default: the GPU's datasheet memory; CPU: host RAM / ranks)")
    parser.add_argument("--mfu-train", type=float, default=None, help="GPU: assumed MFU of training passes (0.35)")
    parser.add_argument("--mfu-gen", type=float, default=None, help="GPU: assumed MFU of generation (0.35)")
    parser.add_argument("--prompt-len", type=float, default=None, help="mean prompt tokens (default: from the "
                        "built-in task's prompts, else half of data.max_prompt_length)")
    parser.add_argument("--response-len", type=float, default=None,
                        help="mean decode steps (default: rollout.max_new_tokens)")
    parser.add_argument("--disk-gb-per-s", type=float, default=None, help="checkpoint write speed per node "
                        "(default: measured here)")
    parser.add_argument("--calibration", metavar="PLAN.json", help="reuse the calibration of an earlier --json")
    parser.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    parser.add_argument("--no-recommend", action="store_true", help="skip the recommendations (faster on the CPU)")
