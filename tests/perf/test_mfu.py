"""MFU of a rank's share: divided over tensor and pipeline degrees as the work is, against the peak of the
precision the matmuls run in; generation counted apart from the update."""

import pytest
import torch

from scalerl.models.config import ModelConfig
from scalerl.perf import flops
from scalerl.perf.flops import flops_per_token, forward_flops_per_token
from scalerl.perf.mfu import RankShare, StepWork, generation_flops, step_mfu
from tests.tiny import tiny_overrides

CFG = ModelConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=4)
WORK = StepWork(prompt_tokens=4000, response_tokens=6000, mean_prompt_len=40, mean_response_len=60,
                forward_passes=1, update_passes=2)
SECONDS = {"step": 10.0, "gen": 4.0, "update": 5.0}


@pytest.fixture
def peaks(monkeypatch):
    """Known peaks: fp32 1e11, bf16 8e11, fp16 4e11 FLOP/s (as a bf16-capable device would have)."""
    threads = torch.get_num_threads()
    table = {("cpu", torch.float32, threads): 1e11, ("cpu", torch.bfloat16, threads): 8e11,
             ("cpu", torch.float16, threads): 4e11}
    monkeypatch.setattr(flops, "_MEASURED_PEAK_CACHE", table)


def test_single_device_mfu_is_flops_over_time_over_peak(peaks):
    out = step_mfu(CFG, WORK, SECONDS, RankShare(), dtype=torch.float32)
    tokens, seq = 10_000, 100
    update = 2 * tokens * flops_per_token(CFG, seq)
    forward = tokens * forward_flops_per_token(CFG, seq)
    gen = generation_flops(CFG, WORK)
    assert out["perf/mfu/update"] == pytest.approx(update / 5.0 / 1e11)
    assert out["perf/mfu/gen"] == pytest.approx(gen / 4.0 / 1e11)
    assert out["perf/mfu"] == pytest.approx((gen + forward + update) / 10.0 / 1e11)
    # prefill over 4000 prompt tokens + 6000 decoded tokens attending over 40 + 30 positions on average
    assert gen == pytest.approx(4000 * forward_flops_per_token(CFG, 40) + 6000 * forward_flops_per_token(CFG, 70))


def test_tensor_parallel_divides_every_phase(peaks):
    one = step_mfu(CFG, WORK, SECONDS, RankShare(tp=1))
    tp2 = step_mfu(CFG, WORK, SECONDS, RankShare(tp=2))
    for key in ("perf/mfu", "perf/mfu/gen", "perf/mfu/update"):
        assert tp2[key] == pytest.approx(one[key] / 2)


def test_pipeline_divides_the_update_but_not_generation(peaks):
    one = step_mfu(CFG, WORK, SECONDS, RankShare(pp=1))
    pp4 = step_mfu(CFG, WORK, SECONDS, RankShare(pp=4))
    assert pp4["perf/mfu/update"] == pytest.approx(one["perf/mfu/update"] / 4)
    assert pp4["perf/mfu/gen"] == pytest.approx(one["perf/mfu/gen"])  # every stage's rank generates it all
    tp2pp2 = step_mfu(CFG, WORK, SECONDS, RankShare(tp=2, pp=2))
    assert tp2pp2["perf/mfu/update"] == pytest.approx(one["perf/mfu/update"] / 4)
    assert tp2pp2["perf/mfu/gen"] == pytest.approx(one["perf/mfu/gen"] / 2)


def test_bf16_and_fp16_are_measured_against_their_own_peak(peaks):
    fp32 = step_mfu(CFG, WORK, SECONDS, RankShare(), dtype=torch.float32)
    bf16 = step_mfu(CFG, WORK, SECONDS, RankShare(), dtype=torch.bfloat16)
    fp16 = step_mfu(CFG, WORK, SECONDS, RankShare(), dtype=torch.float16)
    assert bf16["perf/mfu"] == pytest.approx(fp32["perf/mfu"] / 8)
    assert fp16["perf/mfu"] == pytest.approx(fp32["perf/mfu"] / 4)


def test_gpu_bf16_peak_comes_from_the_tensor_core_column():
    # An A100's fp32 datasheet peak is 16x below its bf16 one: dividing bf16 work by it overstated MFU 16x.
    assert flops._table_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16, False) == 16 * 19.5e12


def test_phase_without_time_is_left_out(peaks):
    out = step_mfu(CFG, WORK, {"update": 1.0}, RankShare())
    assert set(out) == {"perf/mfu/update"}


def test_trainer_reports_mfu_per_phase(tmp_path):
    from scalerl.core.config import load_config
    from scalerl.trainer.rl_trainer import RLTrainer

    cfg = load_config(None, tiny_overrides(
        "data.num_train=64", "data.num_val=0", "rollout.n=2", "rollout.max_new_tokens=4", "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size=8", "trainer.total_steps=1", "trainer.logger=[]", f"trainer.output_dir={tmp_path}",
    ))
    metrics = RLTrainer.from_config(cfg).train_step()
    for key in ("perf/mfu", "perf/mfu/gen", "perf/mfu/update"):
        assert 0 < metrics[key] < 1, key
    assert metrics["perf/mfu/gen"] != metrics["perf/mfu/update"]
