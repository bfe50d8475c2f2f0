"""The GPU self-test: the CUDA and NCCL code paths scalerl has, each run once on one GPU in a few seconds,
one line per check (PASS / FAIL / SKIP, with what was measured). No downloads: tiny random models.

    python scripts/gpu_selftest.py [--budget-s 300]      (or scripts/gpu_selftest.sh)

Checks: device placement, bf16 autocast, fused AdamW, a GRPO step of the trainer on CUDA, an FSDP2 step
over NCCL (world 1), the built-in engine's decode (it captures no CUDA graphs: said so), a bucketed
weight-sync round whose messages go over NCCL, MFU of a bf16 matmul against the datasheet peak, and
`scalerl doctor --distributed-check` on NCCL. Without CUDA every CUDA check is a SKIP naming the reason,
and the script exits 0; it exits 1 when a check failed. Each check that starts processes has a time
limit, and checks left when ``--budget-s`` is spent are SKIPs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Skip(Exception):
    """A check that cannot run here, with the reason."""


def _cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip(f"no CUDA (torch {torch.__version__}, torch.cuda.is_available() is False)")
    return torch.device("cuda", 0)


def _tiny_model(device: torch.device, **changes):
    from scalerl.models.config import ModelConfig
    from scalerl.models.decoder import build_model

    cfg = ModelConfig(**{"vocab_size": 512, "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
                         "num_attention_heads": 8, "num_key_value_heads": 2, **changes})
    return build_model(cfg, seed=0, device=device)


# ---------------------------------------------------------------------------------------------- the checks
def check_device_placement() -> str:
    device = _cuda()
    from scalerl.core.device import resolve_device

    chosen = resolve_device("auto")
    if chosen.type != "cuda":
        raise AssertionError(f"trainer.device=auto chose {chosen}, not cuda")
    model = _tiny_model(device)
    ids = torch.randint(0, 512, (2, 16), device=device)
    logits = model(ids)
    where = {str(p.device) for p in model.parameters()} | {str(logits.device)}
    if where != {"cuda:0"}:
        raise AssertionError(f"tensors on {sorted(where)}")
    return f"auto -> {chosen}, {torch.cuda.get_device_name(device)}, parameters and logits on cuda:0"


def check_bf16_autocast() -> str:
    device = _cuda()
    from scalerl.core.device import Autocast

    model = _tiny_model(device).eval()
    ids = torch.randint(0, 512, (2, 32), device=device)
    with torch.no_grad():
        reference = model(ids).float()
        with Autocast("bf16", device):
            low = model(ids)
    if low.dtype != torch.bfloat16:
        raise AssertionError(f"logits under bf16 autocast are {low.dtype}")
    error = float((low.float() - reference).abs().max() / reference.abs().max())
    if error > 0.05:
        raise AssertionError(f"bf16 logits differ from fp32 by {error:.3f} of the largest")
    return f"logits bf16, max difference {error:.4f} of the largest fp32 logit"


def check_fused_adamw() -> str:
    device = _cuda()
    from scalerl.trainer.optim import build_optimizer

    models = [_tiny_model(device) for _ in range(2)]
    fused, _ = build_optimizer([(models[0].parameters(), 1e-3)], 0.01)
    if not fused.defaults.get("fused"):
        raise AssertionError("build_optimizer did not choose fused AdamW on CUDA")
    loop = torch.optim.AdamW(models[1].parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    ids = torch.randint(0, 512, (2, 32), device=device)
    for model, opt in zip(models, (fused, loop)):
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        fused.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) * 100
    name = "layers.0.mlp.up_proj.weight"
    a, b = dict(models[0].named_parameters())[name], dict(models[1].named_parameters())[name]
    # Different decay grouping (norms/biases) aside, the 2-D weights follow the same update.
    if not torch.allclose(a, b, atol=1e-5):
        raise AssertionError(f"fused AdamW's first step differs from the per-tensor loop on {name}")
    return f"fused AdamW step {step_ms:.2f} ms ({sum(p.numel() for p in models[0].parameters()) / 1e6:.1f}M params)"


def check_grpo_step_cuda() -> str:
    _cuda()
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            "trainer.device=cuda", "trainer.precision=bf16", "model.hidden_size=64", "model.intermediate_size=128",
            "model.num_attention_heads=4", "model.num_key_value_heads=2", "data.num_train=64", "data.num_val=4",
            "rollout.n=4", "rollout.max_new_tokens=16", "trainer.batch_size=8", "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size=16", "trainer.total_steps=1", "trainer.eval_every=0",
            "trainer.logger=[jsonl]", f"trainer.output_dir={out}"])
        trainer = RLTrainer.from_config(cfg)
        metrics = trainer.train_step()
        trainer.close()
    if not all(v == v for k, v in metrics.items() if k.startswith("actor/")):
        raise AssertionError(f"non-finite actor metrics: {metrics}")
    return (f"step {metrics['timing_s/step']:.2f} s, gen {metrics.get('timing_s/gen', float('nan')):.2f} s, "
            f"perf/mfu {metrics.get('perf/mfu', float('nan')):.4f}, peak {metrics['perf/max_memory_gb']:.2f} GB")


def _nccl_world_1() -> None:
    """A one-rank NCCL group in this process (joined once)."""
    import torch.distributed as dist

    from scalerl.core.net import free_port

    if dist.is_initialized():
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    torch.cuda.set_device(0)
    # A one-rank group has nobody to wait for; the limit is there so a broken NCCL set-up fails the check.
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60))


def check_fsdp2_nccl_step() -> str:
    """FSDP2 over a one-rank NCCL mesh (scalerl's own `apply_fsdp`) gives the plain model's loss and
    update; with bf16 parameters over fp32 master weights (trainer.fsdp_param_dtype) a loss within 2%."""
    device = _cuda()
    from torch.distributed.device_mesh import init_device_mesh

    from scalerl.parallel.data_parallel import apply_fsdp

    _nccl_world_1()
    plain, sharded = _tiny_model(device), _tiny_model(device)
    apply_fsdp(sharded, init_device_mesh("cuda", (1,)))
    ids = torch.randint(0, 512, (4, 64), device=device)
    losses = []
    for model in (plain, sharded):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss))
    torch.cuda.synchronize()
    weight = sharded.layers[0].mlp.up_proj.weight.full_tensor()
    if abs(losses[0] - losses[1]) > 1e-4 or not torch.allclose(weight, plain.layers[0].mlp.up_proj.weight, atol=1e-5):
        raise AssertionError(f"FSDP2 loss {losses[1]} / update differ from the plain model's ({losses[0]})")
    mixed = apply_fsdp(_tiny_model(device), init_device_mesh("cuda", (1,)), param_dtype=torch.bfloat16)
    low = float(torch.nn.functional.cross_entropy(mixed(ids)[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))
    if abs(low - losses[0]) > 0.02 * abs(losses[0]):
        raise AssertionError(f"bf16-parameter FSDP2 loss {low} is not within 2% of fp32's {losses[0]}")
    return f"loss {losses[1]:.4f} = plain {losses[0]:.4f}, update equal; bf16 params {low:.4f}"


def check_engine_decode() -> str:
    device = _cuda()
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams

    model = _tiny_model(device).eval()
    engine = BuiltinEngine(model, pad_token_id=0)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(12 + i % 5)] for i in range(32)]
    sampling = SamplingParams(max_new_tokens=64, temperature=1.0, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, seed=0))  # warm-up (kernels, cache tables)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, sampling)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = int(out.response_mask.sum())
    if tokens == 0:
        raise AssertionError("no tokens generated")
    return (f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.0f} tok/s, 32 rows, KV cache); "
            "no CUDA graph capture (the built-in engine decodes eagerly)")


class _NcclAndLocal:
    """Each weight-sync message broadcast over the one-rank NCCL group (the wire path, on the GPU) and
    applied by an in-process receiver, whose acks answer (one GPU: NCCL refuses two ranks on a device)."""

    def __init__(self, broadcast, local):
        self.broadcast, self.local = broadcast, local

    def exchange(self, message):
        self.broadcast.exchange(message)
        return self.local.exchange(message)

    def abort(self, message):
        self.broadcast.abort(message)
        self.local.abort(message)


def check_weight_sync_nccl() -> str:
    device = _cuda()
    import torch.distributed as dist

    from scalerl.comm.weights.channel import BroadcastChannel, InProcessChannel
    from scalerl.comm.weights.receiver import TensorDictStore, WeightReceiver
    from scalerl.comm.weights.sender import WeightSender

    _nccl_world_1()
    model = _tiny_model(device)
    tensors = {name: p.detach() for name, p in model.named_parameters()}
    store = TensorDictStore({n: torch.zeros_like(t, dtype=torch.bfloat16) for n, t in tensors.items()}, device=device)
    channel = _NcclAndLocal(BroadcastChannel(dist.group.WORLD, 0, device, timeout_s=60),
                            InProcessChannel([WeightReceiver(store)]))
    sender = WeightSender(torch.bfloat16, 1 << 20, channel, mode="delta")
    start = time.perf_counter()
    first = sender.sync(list(tensors.items()))
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.add_(1e-2)
    second = sender.sync([(n, p.detach()) for n, p in model.named_parameters()])
    seconds = time.perf_counter() - start
    wrong = [n for n, p in model.named_parameters() if not torch.equal(store.tensors[n], p.detach().to(torch.bfloat16))]
    if wrong:
        raise AssertionError(f"receiver differs from the sender after sync: {wrong[:3]}")
    m1, m2 = first.metrics(), second.metrics()
    return (f"2 syncs in {seconds:.2f} s, 1 MiB buckets over NCCL broadcast; bytes full {m1['weight_sync/bytes']:.0f}"
            f" then delta {m2['weight_sync/bytes']:.0f}, receiver bit-exact")


def check_mfu_datasheet() -> str:
    device = _cuda()
    from scalerl.perf.flops import _table_peak_flops

    name = torch.cuda.get_device_name(device)
    peak = _table_peak_flops(name, torch.bfloat16, tf32_allowed=False)
    if peak is None:
        raise Skip(f"{name} is not in the datasheet table (scalerl/perf/flops.py); MFU would use a measured peak")
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    reps = 20
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    achieved = 2 * n**3 * reps / (time.perf_counter() - start)
    mfu = achieved / peak
    if not 0.05 < mfu <= 1.05:
        raise AssertionError(f"bf16 matmul at {achieved / 1e12:.0f} TFLOP/s is {mfu:.2f} of the datasheet "
                             f"{peak / 1e12:.0f}: the table or the timing is off")
    return f"bf16 {n}^3 matmul {achieved / 1e12:.0f} TFLOP/s = {mfu:.2f} of {name}'s datasheet {peak / 1e12:.0f}"


def check_doctor_distributed() -> str:
    _cuda()
    command = [sys.executable, "-m", "scalerl", "doctor", "--distributed-check"]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # the doctor starts its own world; this process's one-rank group is not it
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    last = (done.stdout.strip().splitlines() or [""])[-1][:160]
    if done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    return f"exit 0: {last}"


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("device placement", check_device_placement),
    ("bf16 autocast", check_bf16_autocast),
    ("fused AdamW", check_fused_adamw),
    ("GRPO step on CUDA (trainer, bf16)", check_grpo_step_cuda),
    ("FSDP2 step on NCCL (world 1)", check_fsdp2_nccl_step),
    ("built-in engine decode", check_engine_decode),
    ("bucketed weight sync over NCCL", check_weight_sync_nccl),
    ("MFU vs datasheet peak", check_mfu_datasheet),
    ("scalerl doctor --distributed-check", check_doctor_distributed),
]


def run_checks(budget_s: float = 300.0) -> int:
    """Every check, one line each; returns the exit status (1 when one failed)."""
    deadline = time.monotonic() + budget_s
    failed = 0
    for name, check in CHECKS:
        start = time.perf_counter()
        if time.monotonic() > deadline:
            status, detail = "SKIP", f"the {budget_s:.0f} s budget is spent"
        else:
            try:
                status, detail = "PASS", check()
            except Skip as reason:
                status, detail = "SKIP", str(reason)
            except Exception as err:  # a failed check is reported and the next one runs
                status, detail = "FAIL", f"{type(err).__name__}: {err}"
                traceback.print_exc(file=sys.stderr)
                failed += 1
        print(f"{status} {name}: {detail} [{time.perf_counter() - start:.1f} s]", flush=True)
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=300.0)
    return run_checks(parser.parse_args().budget_s)


if __name__ == "__main__":
    sys.exit(main())
