"""`--from-verl`: verl example scripts' Hydra overrides translate into the scalerl run they describe."""

from __future__ import annotations

import json

import pyarrow
import pyarrow.parquet
import pytest
import yaml

from scalerl.cli import main
from scalerl.core.config import ConfigError
from scalerl.core.verl_overrides import VERL_KEYS, load_verl_config, parse_hydra_value, translate

# The overrides of verl's examples/grpo_trainer/run_qwen2-7b.sh (volcengine/verl at b178a3cd, Apache-2.0),
# as the shell passes them (quotes removed), with the data paths left to the test.
GRPO_QWEN2_7B = """
algorithm.adv_estimator=grpo data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.name=vllm
actor_rollout_ref.rollout.gpu_memory_utilization=0.6 actor_rollout_ref.rollout.n=5
actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40 actor_rollout_ref.ref.fsdp_config.param_offload=True
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_grpo_example_gsm8k trainer.experiment_name=qwen2_7b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=5 trainer.total_epochs=15
""".split()

# The overrides of verl's examples/ppo_trainer/run_deepseek7b_llm.sh (same commit).
PPO_DEEPSEEK_7B = """
algorithm.adv_estimator=gae data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=512
data.filter_overlong_prompts=True data.truncation=error actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat
actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.model.use_remove_padding=True
actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
actor_rollout_ref.actor.fsdp_config.param_offload=False actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.model.enable_gradient_checkpointing=True
actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 actor_rollout_ref.rollout.tensor_model_parallel_size=4
actor_rollout_ref.rollout.name=vllm actor_rollout_ref.rollout.gpu_memory_utilization=0.4 critic.optim.lr=1e-5
critic.model.use_remove_padding=True critic.model.path=deepseek-ai/deepseek-llm-7b-chat
critic.model.enable_gradient_checkpointing=True critic.ppo_micro_batch_size_per_gpu=32
critic.model.fsdp_config.param_offload=False critic.model.fsdp_config.optimizer_offload=False
algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.logger=["console","wandb"]
trainer.project_name=verl_example_gsm8k trainer.experiment_name=deepseek_llm_7b_function_rm trainer.n_gpus_per_node=8
trainer.nnodes=1 trainer.save_freq=20 trainer.test_freq=1 trainer.use_legacy_worker_impl=auto trainer.total_epochs=15
""".split()


# A model directory the translation only names (nothing loads it): verl's default lengths (512 + 512) are
# longer than the built-in model's positions.
MODEL = "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B"


def _rows_parquet(path, rows):
    """A parquet file of `rows` rows (only its row count matters to the translation)."""
    pyarrow.parquet.write_table(pyarrow.table({"data_source": ["openai/gsm8k"] * rows}), path)
    return str(path)


def _data(tmp_path, rows=7473):  # GSM8K's training split has 7473 rows
    return [f"data.train_files={_rows_parquet(tmp_path / 'train.parquet', rows)}",
            f"data.val_files={_rows_parquet(tmp_path / 'test.parquet', 8)}"]


def _rows(translation):
    return {key.removesuffix(" (verl default)"): target for key, _, target in translation.rows}


def test_grpo_example_script_translates_to_the_same_run(tmp_path):
    cfg, translation = load_verl_config(GRPO_QWEN2_7B + _data(tmp_path))
    assert (cfg.algorithm.adv_estimator, cfg.model.path) == ("grpo", "Qwen/Qwen2-7B-Instruct")
    assert (cfg.trainer.batch_size, cfg.rollout.n, cfg.rollout.max_new_tokens) == (1024, 5, 1024)
    # verl's mini-batch is 256 prompts = 1280 sequences; the micro-batch is per GPU in both
    assert (cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size) == (256 * 5, 40)
    assert (cfg.actor.lr, cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (
        1e-6, True, 0.001, "low_var_kl")
    assert cfg.actor.weight_decay == 0.01 and cfg.actor.grad_clip == 1.0  # verl's defaults, not scalerl's
    assert cfg.data.train_files == [str(tmp_path / "train.parquet")] and cfg.data.max_prompt_length == 512
    assert cfg.rollout.engine == "vllm" and cfg.rollout.top_k == 0 and cfg.model.activation_checkpointing
    assert cfg.trainer.total_steps == 7473 // 1024 * 15  # verl's dataloader drops the last partial batch
    assert (cfg.trainer.save_every, cfg.trainer.eval_every, cfg.trainer.resume) == (20, 5, "auto")
    assert cfg.trainer.logger == ["console", "wandb", "jsonl"]
    assert cfg.trainer.output_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"
    rows = _rows(translation)
    assert rows["actor_rollout_ref.actor.ppo_mini_batch_size"].startswith("actor.ppo_mini_batch_size=1280")
    for tuning in ("actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.actor.fsdp_config.param_offload",
                   "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "trainer.n_gpus_per_node"):
        assert rows[tuning].startswith("no effect here: ")  # reported, not dropped


def test_ppo_example_script_translates_to_the_same_run(tmp_path):
    cfg, translation = load_verl_config(PPO_DEEPSEEK_7B + _data(tmp_path))
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.lr == 1e-5
    assert (cfg.rollout.n, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size) == (1, 256, 16)
    assert (cfg.rollout.max_new_tokens, cfg.trainer.eval_every, cfg.actor.use_kl_loss) == (512, 1, False)
    rows = _rows(translation)
    assert rows["critic.model.path"].startswith("no effect here: scalerl's critic starts from the policy")
    assert rows["critic.ppo_micro_batch_size_per_gpu"].startswith("no effect here: ")
    assert rows["trainer.use_legacy_worker_impl"].startswith("no effect here: ")


@pytest.mark.parametrize("prompts, mini_prompts, n", [(1024, 256, 5), (64, 16, 8), (32, 32, 1)])
def test_optimizer_steps_per_training_step_match_verl(prompts, mini_prompts, n):
    estimator = "rloo" if n > 1 else "reinforce_plus_plus"
    cfg, _ = load_verl_config([f"data.train_batch_size={prompts}", f"actor_rollout_ref.rollout.n={n}",
                               f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_prompts}",
                               f"algorithm.adv_estimator={estimator}",
                               "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", MODEL])
    # verl: train_batch_size / ppo_mini_batch_size updates per step (both in prompts); scalerl in sequences
    assert cfg.trainer.batch_size * cfg.rollout.n // cfg.actor.ppo_mini_batch_size == prompts // mini_prompts


def test_warmup_ratio_and_total_steps():
    cfg, _ = load_verl_config([MODEL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                               "trainer.total_training_steps=50", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
                               "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"])
    assert (cfg.trainer.total_steps, cfg.actor.warmup_steps, cfg.actor.lr_schedule) == (50, 5, "cosine")
    cfg, _ = load_verl_config([MODEL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                               "actor_rollout_ref.actor.optim.lr_warmup_steps=3",
                               "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"])
    assert cfg.actor.warmup_steps == 3  # verl: the step count wins over the ratio


def test_total_epochs_count_the_training_rows(tmp_path):
    cfg, _ = load_verl_config([MODEL, "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4",
                               "data.train_batch_size=32", "trainer.total_epochs=3",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                               f"data.train_files=[{_rows_parquet(tmp_path / 'a.parquet', 70)},"  # noqa: ISC004
                               f"{_rows_parquet(tmp_path / 'b.parquet', 30)}]"])
    assert cfg.trainer.total_steps == 100 // 32 * 3
    with pytest.raises(ConfigError, match="total_epochs needs its row count|not a file"):
        load_verl_config(["data.train_files=/nonexistent/train.parquet", "trainer.total_epochs=2"])


@pytest.mark.parametrize("override, named", [
    ("trainer.critic_warmup=5", "trainer.critic_warmup=5"),
    ("data.truncation=left", "data.truncation"),
    ("actor_rollout_ref.model.lora.rank=32", "lora.rank"),
    ("critic.model.path=other/model", "critic.model.path"),
    ("custom_reward_function.reward_kwargs={scale: 2}", "reward_kwargs"),
    ("actor_rollout_ref.actor.made_up_key=1", "actor_rollout_ref.actor.made_up_key"),
    ("actor_rollout_ref.rollout.name=mystery", "mystery"),
])
def test_a_key_that_changes_the_run_without_an_equivalent_is_an_error(override, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("=", "=")):
        translate(["actor_rollout_ref.model.path=m", override])


def test_verls_lora_keys_set_the_adapters_and_are_ignored_without_a_rank():
    on = translate(["actor_rollout_ref.model.path=m", "actor_rollout_ref.model.lora_rank=32",
                    "actor_rollout_ref.model.lora_alpha=64", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    assert on.values["model.lora.rank"] == 32 and on.values["model.lora.alpha"] == 64
    assert on.values["model.lora.target_modules"] == ["q_proj", "v_proj"]
    off = translate(["actor_rollout_ref.model.path=m", "actor_rollout_ref.model.lora_alpha=64"])
    assert off.values.get("model.lora.alpha") is None  # verl reads lora_alpha only with lora_rank > 0
    assert _rows(off)["actor_rollout_ref.model.lora_alpha"].startswith("no effect here: ")


def test_verls_on_policy_distillation_keys_set_algorithm_distill():
    """verl 0.9.1's distillation.* in its policy-gradient form; the supervised form (its yaml's default) and a
    second teacher are refused saying why; without distillation.enabled the keys change nothing."""
    D = "distillation."
    on = translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t",
                    f"{D}distillation_loss.use_policy_gradient=true", f"{D}distillation_loss.loss_mode=k1",
                    f"{D}distillation_loss.distillation_loss_coef=0.5", f"{D}distillation_loss.loss_max_clamp=10"])
    assert {k: v for k, v in on.values.items() if k.startswith("algorithm.distill.")} == {
        "algorithm.distill.teacher": "t", "algorithm.distill.estimator": "k1", "algorithm.distill.task_weight": 1.0,
        "algorithm.distill.coef": 0.5, "algorithm.distill.max_clamp": 10}
    alone = translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t",
                       f"{D}distillation_loss.use_policy_gradient=true", f"{D}distillation_loss.use_task_rewards=false",
                       f"{D}distillation_loss.distillation_loss_coef=0.5"])
    assert alone.values["algorithm.distill.task_weight"] == 0.0
    assert alone.values["algorithm.distill.coef"] == 1.0  # verl applies the coefficient only with task rewards
    with pytest.raises(ConfigError, match=r"loss_mode=k3 with use_policy_gradient=false \(verl's default\)"):
        translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t"])
    with pytest.raises(ConfigError, match=r"distillation.enabled=true needs the teacher's model directory"):
        translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}distillation_loss.use_policy_gradient=true"])
    # verl 0.9.1 routes every row to a single teacher whatever its key (it sets the key to "default")
    keyed = translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t",
                       f"{D}distillation_loss.use_policy_gradient=true", f"{D}teacher_models.teacher_model.key=openai/gsm8k",
                       f"{D}teacher_key=task"])
    assert keyed.values["algorithm.distill.teacher"] == "t" and "algorithm.distill.teachers" not in keyed.values
    assert _rows(keyed)[f"{D}teacher_models.teacher_model.key"].startswith("no effect here")
    assert _rows(keyed)[f"{D}teacher_key"].startswith("no effect here")
    # forward_kl_topk: the supervised form verl recommends for it is scalerl's top-k loss term, k from topk
    # (verl's yaml: 32); with policy gradient verl would train the sampled token only, which is refused
    with pytest.raises(ConfigError, match=r"forward_kl_topk with use_policy_gradient=true"):
        translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t",
                   f"{D}distillation_loss.use_policy_gradient=true", f"{D}distillation_loss.loss_mode=forward_kl_topk"])
    topk = translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}teacher_models.teacher_model.model_path=t",
                      f"{D}distillation_loss.loss_mode=forward_kl_topk", f"{D}distillation_loss.topk=8"])
    assert topk.values["algorithm.distill.top_k"] == 8 and topk.values["algorithm.distill.teacher"] == "t"
    default_k = translate(["actor_rollout_ref.model.path=m", f"{D}enabled=true",
                           f"{D}teacher_models.teacher_model.model_path=t", f"{D}distillation_loss.loss_mode=forward_kl_topk"])
    assert default_k.values["algorithm.distill.top_k"] == 32
    assert "algorithm.distill.top_k" not in on.values  # k1: the sampled tokens' estimate, top_k stays 0
    off = translate(["actor_rollout_ref.model.path=m", f"{D}teacher_models.teacher_model.model_path=t"])
    assert "algorithm.distill.teacher" not in off.values
    assert _rows(off)[f"{D}teacher_models.teacher_model.model_path"].startswith("no effect here")
    cfg, _ = load_verl_config(["actor_rollout_ref.model.path=m", f"{D}enabled=true",
                               f"{D}teacher_models.teacher_model.model_path=t",
                               f"{D}distillation_loss.use_policy_gradient=true"])
    assert cfg.algorithm.distill.teacher == "t" and cfg.algorithm.distill.estimator == "k3"  # verl's default mode


def test_verls_named_teacher_entries_map_to_a_teacher_per_data_source():
    """verl 0.9.1's several teachers (`+distillation.teacher_models.<entry>.{key, model_path}`, routed by
    `teacher_key=data_source`) are algorithm.distill.teachers; verl's own refusals (an entry without key or
    model_path, two entries with one key) are errors here too, and so is the default entry given beside named ones
    (verl drops it silently) and routing by another field than data_source."""
    D = "distillation."
    base = ["actor_rollout_ref.model.path=m", f"{D}enabled=true", f"{D}distillation_loss.use_policy_gradient=true",
            f"{D}distillation_loss.loss_mode=k1"]
    two = [f"+{D}teacher_models.math.key=openai/gsm8k", f"+{D}teacher_models.math.model_path=/t/math",
           f"+{D}teacher_models.code.key=mbpp", f"+{D}teacher_models.code.model_path=/t/code",
           f"+{D}teacher_models.code.num_replicas=2", f"+{D}teacher_models.code.inference.tensor_model_parallel_size=4"]
    several = translate(base + two)
    assert several.values["algorithm.distill.teachers"] == {"openai/gsm8k": "/t/math", "mbpp": "/t/code"}
    assert "algorithm.distill.teacher" not in several.values
    rows = _rows(several)
    assert rows[f"{D}teacher_models.math.model_path"] == "algorithm.distill.teachers.openai/gsm8k"
    assert rows[f"{D}teacher_models.code.num_replicas"].startswith("no effect here")
    assert rows[f"{D}teacher_models.code.inference.tensor_model_parallel_size"].startswith("no effect here")
    cfg, _ = load_verl_config(base + two)
    assert cfg.algorithm.distill.teachers == {"openai/gsm8k": "/t/math", "mbpp": "/t/code"}
    assert cfg.algorithm.distill.teacher is None and cfg.algorithm.distill.estimator == "k1"
    topk, _ = load_verl_config(["actor_rollout_ref.model.path=m", f"{D}enabled=true", *two,
                                f"{D}distillation_loss.loss_mode=forward_kl_topk", f"{D}distillation_loss.topk=4"])
    assert topk.algorithm.distill.top_k == 4 and len(topk.algorithm.distill.teachers) == 2
    # without distillation.enabled the entries change nothing
    off = translate(["actor_rollout_ref.model.path=m", *two])
    assert "algorithm.distill.teachers" not in off.values
    assert _rows(off)[f"{D}teacher_models.math.key"] == "no effect here: distillation.enabled=false"
    with pytest.raises(ConfigError, match=r"teacher_model.model_path is given beside named teachers \(code, math\)"):
        translate(base + two + [f"{D}teacher_models.teacher_model.model_path=/t/dropped"])
    with pytest.raises(ConfigError, match=r"teacher_models.code has no key: each teacher needs"):
        translate(base + [f"+{D}teacher_models.code.model_path=/t/code"])
    with pytest.raises(ConfigError, match=r"teacher_models.code has no key and model_path"):
        translate(base + [f"+{D}teacher_models.code.num_replicas=1"])
    with pytest.raises(ConfigError, match=r"two teacher entries have key 'mbpp'"):
        translate(base + two + [f"+{D}teacher_models.other.key=mbpp", f"+{D}teacher_models.other.model_path=/t/o"])
    with pytest.raises(ConfigError, match=r"teacher_key=task changes the run .* data_source column"):
        translate(base + two + [f"{D}teacher_key=task"])
    with pytest.raises(ConfigError, match=r"'distillation.teacher_models.code.temperature' is not a field"):
        translate(base + two + [f"+{D}teacher_models.code.temperature=0.5"])


def test_critic_optimiser_keys_must_match_the_actors_shared_optimiser():
    shared = ["actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.05", "critic.optim.lr_warmup_steps_ratio=0.05",
              "trainer.total_training_steps=20"]
    assert _rows(translate(shared))["critic.optim.lr_warmup_steps_ratio"].startswith("no effect here: ")
    with pytest.raises(ConfigError, match=r"critic\.optim\.lr_warmup_steps_ratio=0\.05 changes the run"):
        translate(shared[1:])  # verl would warm up the critic alone


def test_truncation_is_moot_when_verl_filters_long_prompts():
    rows = _rows(translate(["data.filter_overlong_prompts=True", "data.truncation=left"]))
    assert rows["data.truncation"].startswith("no effect here: with filter_overlong_prompts no prompt is truncated")


def test_engine_tuning_is_reported_and_sglang_runs_on_vllm():
    translation = translate(["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.enforce_eager=True",
                             "actor_rollout_ref.rollout.free_cache_engine=False",
                             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"])
    assert translation.values["rollout.engine"] == "vllm"
    rows = _rows(translation)
    assert all(rows[k].startswith("no effect here: ") for k in (
        "actor_rollout_ref.rollout.enforce_eager", "actor_rollout_ref.rollout.free_cache_engine",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size"))
    assert "enforce_eager" in translation.table() and "no effect here: vLLM CUDA graphs" in translation.table()


def test_custom_reward_function_and_hydra_values():
    translation = translate(["custom_reward_function.path=my_reward.py", "+custom_reward_function.name=score",
                             "actor_rollout_ref.actor.optim.lr=3e-6"])
    assert translation.values["data.reward"] == "my_reward.py:score"
    assert translation.values["actor.lr"] == 3e-6  # YAML 1.1 reads 3e-6 as text; verl (OmegaConf) as a number
    assert parse_hydra_value('["console","wandb"]') == ["console", "wandb"] and parse_hydra_value("True") is True
    assert parse_hydra_value("null") is None and parse_hydra_value("error") == "error"


def test_every_table_target_is_a_scalerl_key_or_absent_on_purpose():
    from scalerl.core.config import Config
    from scalerl.core.config.tree import _all_keys

    keys = set(_all_keys(Config))
    # targets not in scalerl yet (use_kl_in_reward, kl_ctrl) are accepted only at their inert value
    missing = {k.target for k in VERL_KEYS if k.target and k.target not in keys}
    assert missing <= {"data.reward_model.path", "algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type",
                       "algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.target_kl"}


def test_config_from_verl_prints_the_table_and_the_config(tmp_path, capsys):
    assert main(["config", "--from-verl", *GRPO_QWEN2_7B, *_data(tmp_path), "--", "trainer.total_steps=7",
                 "data.max_prompt_length=256"]) == 0
    out = capsys.readouterr().out
    table, _, config_yaml = out.partition("\nmodel:\n")
    assert "actor_rollout_ref.rollout.gpu_memory_utilization" in table and "no effect here" in table
    cfg = yaml.safe_load("model:\n" + config_yaml)
    assert cfg["actor"]["ppo_mini_batch_size"] == 1280 and cfg["trainer"]["total_steps"] == 7  # '--' wins
    assert cfg["data"]["max_prompt_length"] == 256 and cfg["model"]["path"] == "Qwen/Qwen2-7B-Instruct"


def test_config_from_verl_error_exits_2_naming_the_key(capsys):
    assert main(["config", "--from-verl", "trainer.critic_warmup=3"]) == 2
    assert "trainer.critic_warmup" in capsys.readouterr().err


def test_train_from_verl_runs_one_step_on_verl_parquet(tmp_path):
    from tests.data.test_formats import verl_gsm8k_dataset

    raw = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(8)]
    verl_gsm8k_dataset(raw).to_parquet(str(tmp_path / "train.parquet"))
    run = tmp_path / "run"
    verl = ["algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
            "data.train_batch_size=4", "data.max_prompt_length=128", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.actor.optim.lr=1e-3",
            "actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "trainer.total_training_steps=1",
            "trainer.logger=[console]", f"trainer.default_local_dir={run}", "trainer.test_freq=-1"]
    # verl has no key for a model size: the built-in model is sized with scalerl keys after '--'
    tiny = ["model.hidden_size=32", "model.intermediate_size=64", "trainer.logger=[jsonl]", "trainer.eval_every=0"]
    assert main(["train", "--from-verl", *verl, "--", *tiny]) == 0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "critic/score/mean" in s]
    assert len(steps) == 1 and steps[0]["reward/num_failures"] == 0  # verl's gsm8k scorer by data_source
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["actor"]["ppo_mini_batch_size"] == 8 and saved["actor"]["weight_decay"] == 0.01


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.actor.optim.lrr=1e-6",  # a typo of a translated key
     "--from-verl: unknown verl key 'actor_rollout_ref.actor.optim.lrr'; did you mean 'actor_rollout_ref.actor.optim.lr'?"),
    ("actor_rollout_ref.rollout.gpu_memory_utilizaton=0.5",  # ... and of engine tuning that changes nothing here
     ("--from-verl: unknown verl key 'actor_rollout_ref.rollout.gpu_memory_utilizaton'; did you mean "
      "'actor_rollout_ref.rollout.gpu_memory_utilization'?")),
    ("model.path=/models/qwen",  # a scalerl key before the '--'
     ("--from-verl: model.path is a scalerl key, not one of verl's: scalerl keys go after a '--' "
      "(--from-verl <verl keys> -- model.path=...)")),
    ("nothing.like.it=1",
     ("--from-verl: 'nothing.like.it' is not a verl key scalerl translates (docs/configuration.md#from-verl "
      "lists them); scalerl keys go after a '--'")),
])
def test_unknown_keys_get_a_suggestion_or_the_way_to_pass_scalerl_keys(override, message, capsys):
    assert main(["config", "--from-verl", "algorithm.adv_estimator=grpo", override]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert "scalerl/core" not in err and ".py" not in err  # written for users: no source paths


def test_the_table_names_the_scalerl_key_a_read_key_feeds():
    rows = _rows(translate([MODEL, "trainer.total_training_steps=3", "custom_reward_function.path=r.py",
                            "custom_reward_function.name=score", "trainer.project_name=p"]))
    assert rows["trainer.total_training_steps"] == "trainer.total_steps (read with trainer.total_epochs)"
    assert rows["custom_reward_function.name"] == "data.reward (read with custom_reward_function.path)"
    assert rows["trainer.project_name"] == "trainer.output_dir (read with trainer.default_local_dir)"
