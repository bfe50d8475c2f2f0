"""The doctor's rules as data: for each rule the leaf it lands on, what it measures, its thresholds with the
reason for each, and the fix it proposes. The checking code (`cluster_rules`, `step_rules`) reads them
from here, so changing a threshold is a one-line edit with its reason next to it, and `scalerl doctor
--list-rules` prints this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scalerl.health.tree import FAULT, LEAVES, OK, WARNING


@dataclass(frozen=True)
class Threshold:
    """``warning`` / ``fault`` limits of one measured quantity; ``above=True``: larger values are worse."""

    warning: float | None
    fault: float | None
    above: bool
    unit: str
    reason: str

    def status(self, value: float) -> str:
        def crosses(limit: float | None) -> bool:
            return limit is not None and (value > limit if self.above else value < limit)

        return FAULT if crosses(self.fault) else WARNING if crosses(self.warning) else OK

    def describe(self) -> str:
        sign = ">" if self.above else "<"
        parts = [f"warning {sign} {self.warning:g}{self.unit}" if self.warning is not None else "",
                 f"fault {sign} {self.fault:g}{self.unit}" if self.fault is not None else ""]
        return ", ".join(p for p in parts if p)


@dataclass(frozen=True)
class Severity:
    """A categorical rule's status for one category (e.g. which library differs), with its reason."""

    status: str
    reason: str


@dataclass(frozen=True)
class Rule:
    id: str
    leaf: str
    measures: str
    fix: str  # a template; the rule fills in {placeholders} from what it measured
    thresholds: dict[str, Threshold] = field(default_factory=dict)
    severities: dict[str, Severity] = field(default_factory=dict)

    def __post_init__(self):
        if self.leaf not in LEAVES:
            raise ValueError(f"rule {self.id}: unknown leaf {self.leaf!r}")


_RULES = (
    # ------------------------------------------------------------------------------ communication
    Rule("library_versions", "communication/library_versions",
         "python, torch, CUDA, NCCL, GPU driver, scalerl and vLLM versions reported by every rank",
         "install the same version on every node (`pip install {package}=={majority}` on {hosts}); "
         "`scalerl version` on a node prints what it runs",
         severities={
             "torch": Severity(FAULT, "collectives, DTensor layouts and checkpoints differ between torch versions"),
             "nccl": Severity(FAULT, "NCCL's wire protocol is not guaranteed across versions: hangs or errors"),
             "cuda": Severity(FAULT, "kernels and NCCL are built per CUDA version; mixed builds misbehave"),
             "scalerl": Severity(FAULT, "ranks running different trainer code disagree on collectives and shapes"),
             "python": Severity(WARNING, "not read by collectives, but a sign the nodes' environments differ"),
             "gpu_driver": Severity(WARNING, "same CUDA build, different drivers: usually works, can differ in "
                                             "speed and in bugs"),
             "vllm": Severity(WARNING, "rollout workers on different vLLM builds (or devices) sample differently"),
         }),
    Rule("socket_interface", "communication/topology",
         "*_SOCKET_IFNAME against each node's interfaces; the interface collectives use (kind, address)",
         "export {variable}={suggestion} (an interface every node has, on the network between nodes), or "
         "unset it so scalerl picks the one that reaches MASTER_ADDR",
         severities={
             "missing": Severity(FAULT, "gloo and NCCL stop at start-up when the named interface does not exist"),
             "virtual": Severity(WARNING, "traffic between nodes over a docker bridge / veth / tun is capped by "
                                          "the host's forwarding, not the NIC"),
             "link_local": Severity(WARNING, "169.254.x.x addresses are not routed between nodes"),
         }),
    Rule("rendezvous", "communication/topology",
         "which ranks registered with the rendezvous at MASTER_ADDR:MASTER_PORT within --join-timeout",
         "start rank {ranks} on {hosts} (see that node's launcher log); check it reaches "
         "MASTER_ADDR:MASTER_PORT ({master}); raise --join-timeout if nodes start slowly",
         severities={"missing": Severity(FAULT, "a collective waits for every rank: one absent rank hangs the job")}),
    Rule("rank_placement", "communication/topology",
         "ranks per node (contiguous or not) and GPUs per node",
         "start ranks node by node (torchrun --nnodes N --node-rank K; Slurm --distribution=block; "
         "scalerl launch ray places them so), with the same GPU count on every node",
         severities={
             "not_contiguous": Severity(WARNING, "intra-node groups (tensor parallel, hierarchical all-reduce) "
                                                 "then span nodes and cross the slow links"),
             "uneven_gpus": Severity(WARNING, "nodes with fewer GPUs finish their share later or leave GPUs idle"),
         }),
    Rule("ray_placement", "communication/topology",
         "Ray placement groups that are pending: requested bundles against each node's resources",
         "{fix}",
         severities={"pending": Severity(FAULT, "a pending placement group never starts its ranks; Ray waits "
                                                "silently")}),
    Rule("allreduce_bandwidth", "communication/bandwidth",
         "all-reduce sweep like nccl-tests: algbw = size / time, busbw = algbw x 2(n-1)/n, intra-node and "
         "inter-node, largest size against the slowest node's interface speed",
         "check the interface the ranks use ({interface}): GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, "
         "NCCL_IB_HCA for InfiniBand; `NCCL_DEBUG=INFO` shows what NCCL picked",
         thresholds={"busbw_vs_nominal": Threshold(
             0.4, 0.1, False, "x nominal",
             "a ring all-reduce ran at 82-90% of the link rate on this project's emulated network; below 40% "
             "something else limits it (another interface, a congested or renegotiated link, CPU-bound "
             "transport); below 10% traffic takes a much slower path")}),
    Rule("link_pairs", "communication/bandwidth",
         "point-to-point bandwidth between every pair of nodes (one rank each, rounds of disjoint pairs), "
         "against the best pair",
         "test the link of {hosts} (cable, switch port, NIC speed: `ethtool <iface>`, `ibstat`); until "
         "fixed, leave it out of the job",
         thresholds={"pair_vs_best": Threshold(
             0.5, 0.2, False, "x best pair",
             "links of one fabric should run near each other's speed; a pair at half the best pair's rate "
             "points at that link, and every ring through it runs at its pace")}),
    Rule("achieved_bandwidth", "communication/bandwidth",
         "bytes each rank sent per step (comm/bytes/*) over the time it waited (timing_s/comm/*), against "
         "the all-reduce busbw measured at the start of the profile",
         "overlap or shrink the gradient traffic: parallel.dp_replicate=<nodes> parallel.dp_shard=<GPUs per "
         "node> (HSDP keeps sharded traffic inside nodes); measure the links: scalerl doctor "
         "--distributed-check",
         thresholds={
             "achieved_vs_link": Threshold(0.4, None, False, "x measured link",
                                           "the trainer's collectives should reach most of what a plain "
                                           "all-reduce reaches on the same links; far less means many small "
                                           "messages or contention"),
             "min_s": Threshold(0.25, None, True, " s",
                                "under a quarter second per step in collectives, their time is latency of small "
                                "messages, not bandwidth: a rate computed from it says nothing about the links"),
         }),
    Rule("comm_share", "communication/bandwidth",
         "exposed communication (time blocked in collectives, not overlapped) as a share of the step",
         "parallel.dp_replicate=<nodes> parallel.dp_shard=<GPUs per node> (HSDP), a larger "
         "actor.ppo_micro_batch_size (fewer, larger messages); check the links: scalerl doctor "
         "--distributed-check",
         thresholds={
             "share": Threshold(0.3, 0.7, True, " of the step",
                                "above 30% of the step spent waiting in collectives the network or the layout "
                                "bounds throughput; above 70% the job runs at under a third of its compute speed"),
             "min_s": Threshold(0.25, None, True, " s",
                                "under a quarter second per step, exposed communication is the fixed latency of a "
                                "few small collectives (stop votes, metric reductions) that no layout or network "
                                "change removes; only more is reported"),
         }),
    # ------------------------------------------------------------------------------ compute load
    Rule("token_imbalance", "compute/data_sharding",
         "tokens each data-parallel rank updates on (max / mean over ranks), with balance/token_imbalance "
         "before and after rebalancing",
         "{fix}",
         thresholds={"max_over_mean": Threshold(
             1.15, 2.0, True, "x mean",
             "the update waits for the rank with the most tokens: at 1.15x the mean the others idle 13% of "
             "the update, at 2x half of it")}),
    Rule("tp_granularity", "compute/parallel_granularity",
         "tensor-parallel communication against compute per layer and token, from the cost model: "
         "4 all-reduces of the hidden state (2 forward, 2 backward) against 6 x layer parameters / tp "
         "FLOPs, with the measured link busbw and device peak",
         "parallel.tp={suggestion} (or lower), the freed ranks for data parallelism (parallel.dp_shard); "
         "keep tensor parallelism inside a node",
         thresholds={"comm_over_compute": Threshold(
             0.5, 2.0, True, "x compute",
             "tensor-parallel all-reduces sit on the critical path of every layer; at half the compute time "
             "they cost a third of the step, at twice it the split runs slower than fewer ranks would")}),
    Rule("pp_bubble", "compute/parallel_granularity",
         "pipeline bubble share (pp-1)/(m x v + pp-1) for m micro-batches and v stages per rank",
         "parallel.microbatches={suggestion} (or more), or a lower parallel.pp; "
         "parallel.pp_schedule=interleaved_1f1b halves the bubble",
         thresholds={"bubble": Threshold(
             0.25, 0.5, True, " of the step",
             "every pipeline rank idles for the bubble: a quarter of the update at 25%, half at 50%")}),
    Rule("unused_bf16", "compute/precision",
         "bf16 over fp32 speed of the model's MLP matmul, probed at start (the CUDA peaks' ratio on GPUs), in a "
         "run that computes in fp32 on a device with bf16 matmul hardware",
         "trainer.precision=bf16 (update and log-prob passes in bf16 autocast over fp32 master weights), or "
         "trainer.precision=auto, which probes at start and chooses",
         thresholds={"bf16_over_fp32": Threshold(
             1.5, None, True, "x fp32",
             "the matmuls are most of a large model's step; at 1.5x their bf16 speed a bf16 run's update "
             "and log-prob passes gain more than autocast's casts and the ops that stay fp32 cost")}),
    Rule("cpu_precision", "compute/precision",
         "trainer.precision and rollout.dtype against each CPU rank's instruction sets (`scalerl.core."
         "cpu_capabilities`, after SCALERL_CPU_ISA): bf16/fp16 matmul instructions, and oneDNN's blocked layouts "
         "the built-in engine decodes over",
         "{fix}",
         severities={
             "no_matmul": Severity(WARNING, "without bf16 (fp16) matmul instructions every bf16 (fp16) matmul "
                                            "is converted to fp32 and back: it runs, slower than fp32 (measured on "
                                            "an AVX2-only AMD EPYC: [512x256] @ [256x688] at ~0.1x fp32's speed, "
                                            "[16x896] @ [896x4864] at ~0.3x)"),
             "isa_switch": Severity(FAULT, "SCALERL_CPU_ISA naming no level stops the trainer at start, where it "
                                           "first asks what the CPU runs"),
         }),
    Rule("gpu_precision", "compute/precision",
         "trainer.precision and rollout.dtype against each GPU rank's compute capability and bf16 support",
         "{fix}",
         severities={"no_bf16": Severity(FAULT, "GPUs before compute capability 8.0 have no bf16 tensor cores: "
                                                "torch emulates bf16 matmuls there, far below fp16's speed, and "
                                                "vLLM and flash attention refuse bf16 with an error")}),
    Rule("stragglers", "compute/stragglers",
         "each rank's own work per step (step time minus time blocked waiting for peers and in collectives), "
         "slowest rank against the median rank",
         "look at rank {ranks} on {hosts}: other processes on its node (`top`), a throttled or different "
         "device (`nvidia-smi -q -d PERFORMANCE,CLOCK`), its phase {phase} in the per-rank table",
         thresholds={
             "busy_over_median": Threshold(
                 1.3, 2.0, True, "x median",
                 "synchronous ranks meet at every collective, so the job moves at its slowest rank's pace: "
                 "at 1.3x the median rank's work the others idle 23% of the step, at 2x half of it"),
             "excess_s": Threshold(
                 0.05, None, True, " s",
                 "below 50 ms per step, and below 5% of the step, a difference is scheduling noise"),
             "slowest_in_steps": Threshold(
                 0.5, None, True, " of the steps",
                 "a straggler is slow step after step; a rank that is slowest in at most half the profiled "
                 "steps is noise (other processes on a shared host), not a straggler"),
         }),
    Rule("device_models", "compute/stragglers",
         "GPU model of every rank",
         "run on one GPU type (Slurm --constraint / --gres=gpu:<type>:N; Ray accelerator_type)",
         severities={"mixed": Severity(WARNING, "the slower GPU model sets the pace of every synchronous step")}),
    Rule("mixed_hardware", "compute/stragglers",
         "each CPU rank's CPU model, instruction sets and torch dispatch level; each GPU rank's compute "
         "capability",
         "{fix}",
         severities={
             "cpu": Severity(WARNING, "ranks on different CPUs take different kernels (bf16 instructions on one, "
                                      "conversions to fp32 on another; AVX-512 or AVX2 dispatch): the slowest "
                                      "sets every step's pace, and ranks round differently"),
             "gpu": Severity(WARNING, "GPUs of different compute capabilities differ in bf16 support and in the "
                                      "kernels they pick: speed and numerics differ from rank to rank"),
         }),
    Rule("expert_load_imbalance", "compute/expert_load",
         "moe/expert_load_imbalance: the most loaded expert's tokens over the mean per expert, in the worst "
         "sparse layer, over the step's real tokens and every data-parallel rank, step after step",
         "turn the router's load-balancing loss on (output_router_logits=true in the model's config.json) or "
         "raise its router_aux_loss_coef (transformers' default 0.001; 0.01 as Switch Transformer used); "
         "{capacity}; under expert parallelism more experts per rank (a smaller parallel.ep){per_rank} "
         "average the load of each rank",
         thresholds={
             "max_over_mean": Threshold(
                 1.5, 3.0, True, "x mean",
                 "every expert of a layer waits for the busiest one (under expert parallelism, every rank for the "
                 "rank that owns it): at 1.5x the mean the others idle a third of the experts' time, at 3x two "
                 "thirds, and a router that sends most tokens to few experts trains the rest on little data"),
             "sustained_steps": Threshold(
                 3, None, True, " steps",
                 "a router's load moves from step to step with the batch; only an imbalance that holds over "
                 "several steps in a row is the router's, not the batch's"),
         }),
    Rule("dropped_tokens", "compute/expert_load",
         "moe/dropped_token_fraction: token-to-expert assignments dropped by model.moe_capacity_factor over "
         "all assignments of the step's real tokens",
         "raise model.moe_capacity_factor{now} (Switch/GShard train with 1.0-2.0; 0 = no limit), and balance "
         "the router (output_router_logits=true, router_aux_loss_coef in config.json) so fewer experts overflow",
         thresholds={"fraction": Threshold(
             0.01, 0.1, True, " of assignments",
             "a dropped assignment gives its token no output from that expert (it keeps only its residual and "
             "its other experts): a percent is the usual price of bounded expert buffers; at a tenth the model "
             "trains on a different network than it generates with (generation routes every token)")}),
    # ------------------------------------------------------------------------------ resources
    Rule("memory_peak", "resources/accelerator_memory",
         "peak memory of each rank (GPU: allocated; CPU: resident set of the node's ranks) against the "
         "device's capacity, per phase when profiled",
         "model.activation_checkpointing=true, a smaller actor.ppo_micro_batch_size or "
         "actor.micro_batch_max_tokens, parallel.dp_shard=<ranks> (FSDP shards parameters and optimizer "
         "state); peak was in {phase}",
         thresholds={"fraction": Threshold(
             0.85, 0.95, True, " of capacity",
             "the allocator needs headroom for fragmentation and for the longest batch not seen yet; at 95% "
             "the next longer batch is likely to run out of memory")}),
    Rule("device_memory_free", "resources/accelerator_memory",
         "free device memory on each rank before anything of the run is loaded",
         "free the device: `nvidia-smi --query-compute-apps=pid,used_memory --format=csv` lists who holds "
         "it; CUDA_VISIBLE_DEVICES selects other GPUs",
         thresholds={
             "free_fraction": Threshold(0.9, 0.5, False, " free",
                                        "GPU memory another process holds at start is missing for the run; below "
                                        "half it will not fit"),
             "host_available_fraction": Threshold(0.2, 0.05, False, " available",
                                                  "a CPU run shares the host's RAM with the OS and other processes; "
                                                  "under a fifth available the run competes for it, under 5% the "
                                                  "kernel starts killing processes"),
         }),
    Rule("host_device_copy", "resources/host_device_transfer",
         "pinned host-to-device and device-to-host copy bandwidth of 256 MiB on each GPU rank",
         "check the GPU's PCIe link (`nvidia-smi -q | grep -A3 'Link Width'`) and NUMA placement "
         "(numactl --cpunodebind); keep CUDA_VISIBLE_DEVICES on the socket of the ranks' CPUs",
         thresholds={"gbytes_per_s": Threshold(
             6.0, 1.0, False, " GB/s",
             "PCIe 3.0 x16 is 15.75 GB/s nominal; below 6 GB/s the link runs narrower or slower, or copies "
             "cross sockets")}),
    Rule("host_device_share", "resources/host_device_transfer",
         "time in host<->device copies (torch.profiler Memcpy events) as a share of the step",
         "keep tensors on the device between phases; pin host buffers (pin_memory) for the copies left",
         thresholds={"share": Threshold(
             0.1, 0.3, True, " of the step",
             "copies are pure overhead for a colocated trainer; a tenth of the step is worth removing")}),
    Rule("data_wait", "resources/storage_io",
         "time the step spends fetching and encoding its prompts (timing_s/data) as a share of the step",
         "read data.train_files from local disk (copy them off network storage); pre-tokenize long prompts",
         thresholds={
             "share": Threshold(0.1, 0.5, True, " of the step",
                                "data loading is not overlapped with compute: every accelerator idles while it "
                                "runs; at half the step it halves throughput"),
             "min_s": Threshold(0.1, None, True, " s",
                                "under 100 ms per step, fetching a batch is fixed Python cost, not a starving "
                                "loader; only a slower one is reported"),
         }),
    Rule("disk_space", "resources/storage_io",
         "free space at the output and checkpoint paths (and the checkpoints it must hold, when known)",
         "free space at {path} or point trainer.output_dir at a larger disk; lower trainer.keep_last",
         thresholds={
             "free_gb": Threshold(10.0, 1.0, False, " GiB",
                                  "metrics, logs and one small checkpoint need a few GiB; under 1 GiB the "
                                  "next write fails"),
             "free_over_needed": Threshold(2.0, 1.0, False, "x needed",
                                           "keep_last checkpoints plus the one being written must fit; below "
                                           "1x the save fails mid-run"),
         }),
    Rule("shared_paths", "resources/storage_io",
         "a token written at each path on one node, looked for on every other node",
         "put trainer.output_dir on a filesystem every node mounts (NFS, Lustre, a shared volume)",
         severities={
             "checkpoint": Severity(FAULT, "distributed checkpoints are written by every rank and published "
                                           "by rank 0: a path local to each node leaves every checkpoint "
                                           "incomplete"),
             "output": Severity(WARNING, "outputs end up split across the nodes' local disks"),
         }),
    Rule("checkpoint_interval", "resources/storage_io",
         "estimated checkpoint write time (state bytes / measured write speed at the checkpoint path) "
         "against the time between checkpoints (trainer.save_every x step time)",
         "trainer.save_every={suggestion} (or more), or write checkpoints to faster storage",
         thresholds={"share": Threshold(
             0.1, 0.5, True, " of the interval",
             "saving blocks training: at a tenth of the interval the run loses a tenth of its time")}),
    Rule("host_ram", "resources/host_ram",
         "each rank's peak resident set (VmHWM, host RAM on GPU runs too) while the model loads, while a "
         "checkpoint is saved and while the model is exported, summed over the node's ranks (they do each at "
         "the same time), against the node's memory (MemTotal, or the container's cgroup limit when lower)",
         "{fix}",
         thresholds={"fraction": Threshold(
             0.8, 0.95, True, " of the node's memory",
             "host RAM is shared with the OS, the page cache and the run's other processes (data and reward "
             "workers, Ray's object store), and training nodes rarely swap: past four fifths little is left for "
             "them, past 95% the kernel's OOM killer ends a rank (verl's report: a Ray node at 250 of 251 GB)")}),
    Rule("checkpoint_cost", "resources/checkpoint_cost",
         "seconds of the run's own checkpoint save (its slowest rank, measured by --performance-profiling) "
         "against the training time between two saves (trainer.save_every x the step time; the whole run "
         "when trainer.save_every=0): the share of the run's time spent saving",
         "{fix}",
         thresholds={
             "share": Threshold(0.1, 0.5, True, " of the training time",
                                "saving blocks every rank (scalerl saves synchronously): at a tenth the run loses "
                                "a tenth of its time; at half, as verl's 10,480 s saves did, it trains half the "
                                "time it runs"),
             "min_total_s": Threshold(60.0, None, True, " s over the run",
                                      "the run's saves together (saves x seconds each) under a minute cost less "
                                      "than a restart does: a short run's one save at the end is a large share "
                                      "of little time, not worth a setting"),
         }),
    Rule("phase_switch_memory", "resources/phase_switch_memory",
         "at each switch between training (log-prob, reference and update passes) and generation, in step "
         "order: the peak memory of the phase switched to, split into what was held when it started (left "
         "by the phase before) and what it added, against the device's capacity (GPU: its memory; CPU: the "
         "node's RAM over its ranks)",
         "{fix}",
         thresholds={"fraction": Threshold(
             0.75, 0.95, True, " of capacity",
             "a profile measures a few steps' responses; RL responses grow longer as training goes on, and "
             "generation's KV cache and the update's activations grow with them, on top of what the other "
             "side still holds: a switch needs a quarter of headroom for that; at 95% the next longer batch "
             "runs out of memory")}),
    # ------------------------------------------------------------------------------ training signal
    Rule("non_finite", "training/non_finite",
         "losses, gradient norms and scores in the step metrics; skipped optimizer steps",
         "lower actor.lr (or sft.lr); trainer.precision=bf16 rather than fp16; keep actor.grad_clip > 0",
         severities={
             "value": Severity(FAULT, "a NaN/Inf loss or gradient norm poisons every parameter it reaches"),
             "skipped": Severity(WARNING, "steps with non-finite gradients are skipped, so they are lost work"),
         }),
    Rule("reward_collapse", "training/reward_collapse",
         "critic/score/{mean,max,min} of the last steps",
         "{fix}",
         thresholds={
             "drop_from_best": Threshold(0.5, None, True, " of the best",
                                         "a mean reward that fell by half from its best window usually means "
                                         "the policy collapsed (a KL blow-up, entropy gone)"),
             "flat_steps": Threshold(5, None, True, " steps",
                                      "GRPO's advantage is the reward minus its group mean: when every sample "
                                      "scores the same, advantages are 0 and the policy stops learning"),
         }),
    Rule("logprob_mismatch", "training/logprob_mismatch",
         "rollout/logprob_diff/mean (|trainer log-prob - engine log-prob| per sampled token, where the trainer "
         "recomputes them) over the last steps, and its growth from the first steps",
         "{fix}",
         thresholds={
             "mean": Threshold(0.02, 0.1, True, " nats per token",
                               "two forwards of the same weights in other precisions or kernels differ by a "
                               "little per token; at 0.1 nats the update's importance ratios are off by about 10% "
                               "per token (exp(0.1)), and PPO's clip acts on numerics instead of policy change"),
             "growth": Threshold(2.0, 4.0, True, "x the first steps'",
                                 "a gap that keeps growing is the policy drifting where the two computations "
                                 "disagree (e.g. an MoE router choosing other experts), the pattern the collapse "
                                 "reports filed against verl and TRL describe before their runs collapsed"),
         }),
    # ------------------------------------------------------------------------------ rollout pipeline
    Rule("trainer_idle", "rollout/trainer_idle",
         "timing_s/trainer_idle over timing_s/step: the share of the step the trainer waited for rollouts from "
         "standalone workers (beside it: the workers' own idle share, rollout.staleness, rollout.workers)",
         "{fix}",
         thresholds={"share": Threshold(
             0.3, 0.6, True, " of the step",
             "an asynchronous step should be the update alone: a trainer waiting a third of its step for "
             "rollouts has its devices idle that long, and generation, not the update, sets the pace")}),
    Rule("rollout_idle", "rollout/rollout_idle",
         "timing_s/rollout_idle over timing_s/step: the mean share of the step a standalone worker waited for "
         "requests or weights (receiving them included), as the workers report it",
         "{fix}",
         thresholds={"share": Threshold(
             0.3, 0.6, True, " of the step",
             "a worker waiting a third of the step for work has generation capacity the run does not use: "
             "fewer workers would do, or more steps could be in flight")}),
    Rule("generation_tail", "rollout/generation_tail",
         "response_length/mean over response_length/max with timing_s/gen over timing_s/step: a batch decodes "
         "as many steps as its longest response, so 1 - mean/max of its row-steps are spent on finished rows "
         "or on few rows",
         "{fix}",
         thresholds={"mean_over_max": Threshold(
             0.35, None, False, "x max",
             "below about a third the longest responses make the batch decode 3x the steps an average one "
             "needs; it matters only where generation is a real share of the step (gen_share)"),
             "gen_share": Threshold(
             0.25, None, True, " of the step",
             "below a quarter of the step the tail costs little however long it is")}),
    Rule("tool_latency", "rollout/tool_latency",
         "agent/env_time_share (the mean share of the step an episode spent in its environment's step, tools "
         "included) and agent/tool_s/<tool> (each tool's mean seconds per call, the slowest named)",
         "{fix}",
         thresholds={"share": Threshold(
             0.5, 0.8, True, " of the step",
             "an episode waiting on its tools more than half the step leaves the engine decoding few rows; past "
             "four fifths the step's length is the tools' latency, whatever the model or the layout")}),
    Rule("prefix_breaks", "rollout/prefix_breaks",
         "agent/prefix_breaks: turns whose prompt could not be built as the last prompt + the last completion + "
         "the new messages' tokens, because the chat template renders earlier turns differently once later "
         "messages follow",
         "{fix}",
         thresholds={"breaks": Threshold(
             0, None, True, " turns",
             "at a break the trained context is the tokens the engine sampled, but the model served with this "
             "template sees earlier turns rendered otherwise: it is trained on text it will not be shown")}),
    Rule("weight_sync_stall", "rollout/weight_sync_stall",
         "weight_sync/slowest_step_s over weight_sync/timeout_s: the longest step of a push to standalone workers "
         "(preparing a bucket, sending it, every worker's acknowledgement) against its limit; and the watchdog's "
         "failure record when a step overran it (the side, the rank, the bucket and its tensors, the bytes moved, "
         "the ranks behind)",
         "{fix}",
         thresholds={"share_of_limit": Threshold(
             0.5, 1.0, True, " of weight_sync.timeout_s",
             "a step that takes half its limit leaves no margin: a link that halves its rate or a worker busy "
             "loading a layer trips the watchdog and stops the run; past the limit the push stalled")}),
)
RULES: dict[str, Rule] = {rule.id: rule for rule in _RULES}


def describe_rules() -> str:
    """Every rule with its leaf, what it measures, its thresholds and reasons (`scalerl doctor --list-rules`)."""
    lines = []
    for rule in RULES.values():
        lines.append(f"{rule.id}  ->  {rule.leaf} ({LEAVES[rule.leaf].title})")
        lines.append(f"    measures: {rule.measures}")
        for name, t in rule.thresholds.items():
            lines.append(f"    {name}: {t.describe()} -- {t.reason}")
        for name, s in rule.severities.items():
            lines.append(f"    {name}: {s.status} -- {s.reason}")
        if not rule.fix.startswith("{"):
            lines.append(f"    fix: {rule.fix}")
    return "\n".join(lines)
