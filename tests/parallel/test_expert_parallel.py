"""Expert parallelism under FSDP2: at world 2 (ep2, dense parameters sharded over both ranks) and world 4
(ep2 x 2 expert replicas, dense sharded over 4; and HSDP 2 x 2), one forward + backward of each rank's
share gives the logits and, gathered, the gradients of one process on the whole batch; the gradient
norm is the one process's; the export gathers every expert; the expert all-to-all bytes are counted;
a MoE checkpoint (per-expert and fused layouts) loads slice by slice into the laid-out meta model, equal to
the whole load, each rank reading its experts' share and peaking well below one whole copy; layouts that
cannot work are refused by name. (The DDP layout's checks are in tests/models/test_moe.py.)"""

import pytest
import torch

from scalerl.core.config import BUILTIN_VOCAB_SIZE
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.parallel.mesh import LayoutError, ParallelDims
from tests.spawned_group import run_in_group

pytest.importorskip("safetensors")


def _moe_dir(path, moe_intermediate_size=16, hidden_size=32, dtype=torch.float32):
    cfg = ModelConfig(model_type="qwen2_moe", vocab_size=BUILTIN_VOCAB_SIZE, hidden_size=hidden_size,
                      intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=16,
                      output_router_logits=False, tie_word_embeddings=True)
    save_pretrained(build_model(cfg, seed=0).to(dtype), path)
    return path


def _fused_copy(source, path):
    """``source`` with each layer's experts fused as transformers 5 writes them (``experts.gate_up_proj``
    ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        pop = lambda j, kind: tensors.pop(f"{prefix}.{j}.{kind}.weight")  # noqa: E731
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([pop(j, "gate_proj"), pop(j, "up_proj")])
                                                         for j in range(4)])
        tensors[f"{prefix}.down_proj"] = torch.stack([pop(j, "down_proj") for j in range(4)])
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _status_kib(field):
    from pathlib import Path

    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def _sliced_load(ctx, model_dir):
    """(the largest difference from the whole load, parameter by parameter; bytes read; peak RSS rise in
    bytes) of loading ``model_dir`` into its meta model laid out on ``ctx``."""
    from pathlib import Path

    from scalerl.models.hf_checkpoint import from_pretrained
    from scalerl.models.sharded_loading import load_local_shards, meta_model
    from scalerl.parallel.parallelize import parallelize

    whole = dict(from_pretrained(model_dir).named_parameters())
    model = meta_model(model_dir)
    parallelize(model, ctx)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
    before = _status_kib("VmRSS")
    read = load_local_shards(model, model_dir)
    rise = (_status_kib("VmHWM") - before) * 1024
    diff = max(float((_full(p.detach()) - whole[n].detach()).abs().max()) for n, p in model.named_parameters())
    assert {n for n, _ in model.named_parameters()} <= set(whole)
    return diff, read, rise


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_rank(rank, world, model_dir, layouts, export_root, load_dirs=None):
    from scalerl.checkpoint.export import export_hf_model
    from scalerl.core.config import ParallelSection
    from scalerl.models.hf_checkpoint import from_pretrained
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.parallelize import parallelize

    out = {}
    reference = from_pretrained(model_dir)
    ids = torch.randint(3, reference.config.vocab_size, (2 * world, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    probe = torch.randn(2 * world, 6, reference.config.vocab_size, generator=torch.Generator().manual_seed(6))
    ref_logits = reference(ids, attention_mask=mask)
    (ref_logits * probe).sum().backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item()
    mine = slice(2 * rank, 2 * rank + 2)
    for name, section in layouts.items():
        ctx = init_distributed(ParallelSection(**section), torch.device("cpu"))
        model = from_pretrained(model_dir)
        parts = parallelize(model, ctx)
        ctx.comm.reset()
        logits = parts.trained(ids[mine], attention_mask=mask[mine])
        (logits * probe[mine]).sum().backward()
        sent = ctx.comm.step_metrics().get("comm/bytes/expert", 0.0)
        worst, experts = 0.0, set()
        for pname, p in model.named_parameters():
            grad = _full(p.grad) * world  # FSDP2's mean over the ranks, the one process's sum
            ref = ref_grads[pname]
            worst = max(worst, ((grad - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item())
            if ".experts." in pname:
                experts.add(int(pname.split(".experts.")[1].split(".")[0]))
        norm = parts.clip_grad_norm(0.0).item() * world
        export_hf_model(model, None, export_root / name, ctx)
        out[name] = dict(logit_diff=(logits - ref_logits[mine]).detach().abs().max().item(), grad_diff=worst,
                         norm=norm, ref_norm=ref_norm, sent=sent, experts=sorted(experts))
        for kind, directory in (load_dirs or {}).items():
            out[f"{name}/load/{kind}"] = _sliced_load(ctx, directory)
    return out


def _check(results, name, experts_by_rank, export_dir, model_dir):
    from safetensors.torch import load_file

    assert [r[name]["experts"] for r in results] == experts_by_rank
    for r in results:
        row = r[name]
        assert row["logit_diff"] <= 1e-5 and row["grad_diff"] <= 1e-5, row
        assert row["norm"] == pytest.approx(row["ref_norm"], rel=1e-5), row
        assert row["sent"] > 0, row  # the token all-to-alls, counted as expert traffic
    exported = load_file(export_dir / "model.safetensors")
    source = load_file(model_dir / "model.safetensors")
    assert exported.keys() == source.keys()  # every rank's experts, all four of each layer
    assert sum(".mlp.experts." in k and k.endswith("up_proj.weight") for k in exported) == 2 * 4
    assert max(float((exported[k] - source[k]).abs().max()) for k in source) == 0.0  # nothing stepped yet


def _check_loads(results, name, load_dirs, world):
    """Each rank read about its share of the file (experts split by EP, then by FSDP over their replicas,
    the rest by FSDP) and its peak RSS rose by less than 0.7 of one whole fp32 copy: its fp32 share plus
    the pages of the bf16 file it touched (about 6 / world bytes a parameter; measured 0.39-0.55 at world 4),
    never the model."""
    for kind, directory in load_dirs.items():
        total = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        whole_copy = 4 * sum(p.numel() for p in _whole_params(directory))
        for r in results:
            diff, read, rise = r[f"{name}/load/{kind}"]
            assert diff == 0.0, (kind, diff)
            assert read <= 1.1 * total / world, (kind, read, total)
            assert rise < 0.7 * whole_copy, (kind, rise, whole_copy)


def _whole_params(directory):
    from scalerl.models.hf_checkpoint import from_pretrained

    return list(from_pretrained(directory).parameters())


def test_expert_parallel_under_fsdp_at_world_2_equals_one_process(tmp_path):
    model_dir = _moe_dir(tmp_path / "model")
    layouts = {"fsdp": dict(dp_replicate=1, dp_shard=2, ep=2)}
    results = run_in_group(_fsdp_rank, 2, 2, model_dir, layouts, tmp_path / "export")
    _check(results, "fsdp", [[0, 1], [2, 3]], tmp_path / "export" / "fsdp", model_dir)


def test_expert_parallel_under_fsdp_at_world_4_equals_one_process(tmp_path):
    """ep2 x 2 replicas: ranks 0 and 2 hold experts 0-1 (each half of them), ranks 1 and 3 experts 2-3."""
    model_dir = _moe_dir(tmp_path / "model")
    layouts = {"fsdp4": dict(dp_replicate=1, dp_shard=4, ep=2), "hsdp": dict(dp_replicate=2, dp_shard=2, ep=2)}
    # Experts dominate this one (8 x 3 x 128 x 8192 of 25M parameters: the first load's few MB of one-time
    # allocations are noise here), in bf16 as published checkpoints are.
    big = _moe_dir(tmp_path / "big", moe_intermediate_size=8192, hidden_size=128, dtype=torch.bfloat16)
    load_dirs = {"fused": _fused_copy(big, tmp_path / "big-fused"), "per-expert": big}
    results = run_in_group(_fsdp_rank, 4, 4, model_dir, layouts, tmp_path / "export", load_dirs, timeout_s=900)
    for name in layouts:
        _check(results, name, [[0, 1], [2, 3], [0, 1], [2, 3]], tmp_path / "export" / name, model_dir)
        _check_loads(results, name, load_dirs, world=4)


def test_layouts_expert_parallelism_cannot_compose_with_are_refused():
    from scalerl.core.config import ParallelSection

    assert ParallelDims.from_config(ParallelSection(dp_replicate=1, dp_shard=2, ep=2), 2).ep == 2
    assert ParallelDims.from_config(ParallelSection(dp_replicate=2, dp_shard=2, ep=2), 4).ep == 2
    assert ParallelDims.from_config(ParallelSection(dp_replicate=1, dp_shard=4, ep=4), 4).ep == 4
    with pytest.raises(LayoutError, match="parallel.ep=2 .*under DDP it needs parallel.dp_replicate=2"):
        ParallelDims.from_config(ParallelSection(dp_replicate=4, ep=2), 4)  # experts would not be reduced
    with pytest.raises(LayoutError, match="parallel.ep=4 .*divisible by 4"):
        ParallelDims.from_config(ParallelSection(dp_replicate=1, dp_shard=2, tp=2, ep=4), 4)
    with pytest.raises(LayoutError, match="parallel.ep=2 .*parallel.tp=1 parallel.pp=1"):
        ParallelDims.from_config(ParallelSection(dp_replicate=1, dp_shard=2, tp=2, ep=2), 4)


def _fsdp_resume_rank(rank, model_dir, out_dir, reward):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer
    from scalerl.verify import run_kind
    from tests.tiny import tiny_overrides

    common = tiny_overrides(f"model.path={model_dir}", "model.tokenizer=builtin", "actor.lr=1e-3", reward,
                            "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.ep=2")
    run_kind("grpo", [*common, "trainer.total_steps=2"], out_dir / "straight")
    run_kind("grpo", [*common, "trainer.total_steps=1"], out_dir / "resumed")
    trainer = RLTrainer.from_config(load_config(None, [*common, "trainer.total_steps=2", "trainer.resume=auto",
                                                       f"trainer.output_dir={out_dir / 'resumed'}"]))
    start = trainer.step
    return start, trainer.fit()["final_model"]


def test_expert_parallel_under_fsdp_trains_and_resumes(tmp_path):
    """A GRPO run at ep2 x fsdp2 through the trainer (the MoE checkpoint read slice by slice), its
    checkpoint holding each rank's experts sharded; resumed at step 1 it ends where the straight run does,
    which trained."""
    from pathlib import Path

    from scalerl.verify import TOLERANCE, max_weight_diff

    model_dir = _moe_dir(tmp_path / "model")
    (tmp_path / "reward.py").write_text("def score(response, ground_truth):\n    return len(response) / 10\n")
    start, final = run_in_group(_fsdp_resume_rank, 2, model_dir, tmp_path, f"data.reward={tmp_path / 'reward.py'}:score")[0]
    assert start == 1
    assert max_weight_diff(tmp_path / "straight" / "final", Path(final)) <= TOLERANCE
    assert max_weight_diff(model_dir, Path(final)) > 50 * TOLERANCE
