"""A reward model (`data.reward_model.path`): scalerl's scores of tiny random Qwen2/Llama sequence-classification
checkpoints against transformers' own, combined with rule rewards, in a training run, from verl's keys, and
the checkpoints it refuses."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from scalerl.cli import main
from scalerl.core.config import ConfigError, load_config
from scalerl.core.verl_overrides import translate
from scalerl.data.errors import DataError
from scalerl.data.rewards.computer import MODEL_SCORE_METRIC, RewardComputer
from scalerl.data.rewards.functions import RewardFunctionError
from scalerl.data.rewards.model import RewardModel, score_positions
from scalerl.models.hf_checkpoint import CheckpointFormatError
from scalerl.models.tokenizer import CharTokenizer, TokenizerNotFound
from scalerl.verify import run_kind
from tests.spawned_group import run_in_group
from tests.tiny import tiny_overrides

transformers = pytest.importorskip("transformers")

TOKENIZER = CharTokenizer()  # pad 0, bos 1, eos 2: saved beside each checkpoint as tokenizer.json
PROMPTS = ["1+1=", "12*3=", "what is 7 - 2? ", "9=", "(4+4)*2="]
RESPONSES = [" 2", " 36 and that is all", "5", "", " 16 #### 16"]


def _save_classifier(directory, family="qwen2", seed=0, **changes):
    """A random tiny `<family>ForSequenceClassification` saved with the built-in tokenizer; returns the model."""
    config_cls, model_cls = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
        "llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification),
    }[family]
    settings = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_labels": 1, "max_position_embeddings": 128,
                "pad_token_id": TOKENIZER.pad_token_id, "bos_token_id": TOKENIZER.bos_token_id,
                "eos_token_id": TOKENIZER.eos_token_id, **changes}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    with torch.no_grad():  # every weight random, biases and norms too, so each tensor's use is tested
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def classifier(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"rm_{request.param}")
    return directory, _save_classifier(directory, request.param)


def _transformers_scores(model, sequences, pad_token_id):
    """transformers' scores of right-padded `sequences`, as its sequence-classification head pools them."""
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([list(s) + [pad_token_id] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask).logits[:, 0].tolist()


def test_scores_match_transformers_on_a_batch_of_different_lengths(classifier):
    directory, model = classifier
    reward_model = RewardModel(directory, micro_batch_size=2)  # three forward passes, shortest first
    sequences = [reward_model.encode(p, r) for p, r in zip(PROMPTS, RESPONSES)]
    assert len({len(s) for s in sequences}) == len(sequences)
    assert sequences[0] == [TOKENIZER.bos_token_id] + TOKENIZER.encode("1+1= 2")  # BOS + prompt + response
    ours = reward_model.score(PROMPTS, RESPONSES)
    reference = _transformers_scores(model, sequences, TOKENIZER.pad_token_id)
    assert ours == pytest.approx(reference, abs=1e-5)
    assert max(ours) - min(ours) > 1e-3  # distinct samples get distinct scores: a real comparison
    alone = [reward_model.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)]
    assert alone == pytest.approx(ours, abs=1e-5)  # padding in a batch changes nothing


def test_trailing_pad_tokens_are_passed_over_as_transformers_does(classifier):
    directory, model = classifier
    reward_model = RewardModel(directory)
    pad = TOKENIZER.pad_token_id
    sequences = [[1, 20, 21, pad], [1, 22, 23, 24, 25, pad, pad], [1, 26]]
    assert score_positions(torch.tensor([s + [pad] * (7 - len(s)) for s in sequences]), [4, 7, 2], pad).tolist() \
        == [2, 4, 1]
    assert reward_model.score_ids(sequences) == pytest.approx(_transformers_scores(model, sequences, pad), abs=1e-5)


def test_without_a_pad_token_id_the_last_token_is_scored(tmp_path):
    model = _save_classifier(tmp_path, "llama", pad_token_id=None)
    reward_model = RewardModel(tmp_path)
    sequences = [reward_model.encode(p, r) for p, r in zip(PROMPTS[:3], RESPONSES[:3])]
    with torch.no_grad():  # transformers takes no batch without a pad id: one sequence at a time
        reference = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]
    assert reward_model.score_ids(sequences) == pytest.approx(reference, abs=1e-5)


def test_bfloat16_scores_are_close_to_float32(classifier):
    directory, _ = classifier
    full = RewardModel(directory).score(PROMPTS, RESPONSES)
    half = RewardModel(directory, dtype="bfloat16").score(PROMPTS, RESPONSES)
    assert half == pytest.approx(full, abs=0.05) and half != full


def test_chat_messages_are_the_conversation_through_the_chat_template(classifier):
    directory, _ = classifier
    reward_model = RewardModel(directory)
    messages = [{"role": "system", "content": "Add. "}, {"role": "user", "content": "1+1="}]
    # The built-in tokenizer's template joins the contents; the response is the assistant's turn.
    assert reward_model.encode(messages, " 2") == TOKENIZER.encode("Add. 1+1= 2")
    assert RewardModel(directory, chat_template=True).encode("1+1=", " 2") == TOKENIZER.encode("1+1= 2")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    no_template = directory.parent / f"{directory.name}_no_template"
    no_template.mkdir(exist_ok=True)
    (no_template / "tokenizer.json").write_text((directory / "tokenizer.json").read_text())
    (no_template / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items()
                                                                   if k != "chat_template"}))
    with pytest.raises(DataError, match="no chat template"):
        RewardModel(directory, tokenizer=no_template).score([messages], [" 2"])


def test_reward_computer_adds_the_weighted_model_score_to_the_rule_reward(classifier):
    directory, _ = classifier
    reward_model = RewardModel(directory)
    rows = [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "2+2=", "ground_truth": "4"},
            {"prompt": "3+3=", "ground_truth": "6"}]
    responses = ["#### 2", "#### 5", "#### 6"]
    model_scores = reward_model.score([r["prompt"] for r in rows], responses)
    computer = RewardComputer("gsm8k", model=reward_model, model_weight=0.5)
    rewards, failures = computer.compute(responses, rows)
    assert failures == 0
    assert rewards == pytest.approx([1 + 0.5 * model_scores[0], 0.5 * model_scores[1], 1 + 0.5 * model_scores[2]])
    assert computer.last_metrics[MODEL_SCORE_METRIC] == pytest.approx(sum(model_scores) / 3)
    only_model = RewardComputer("none", model=reward_model)
    assert only_model.compute(responses, rows) == (pytest.approx(model_scores), 0)
    assert only_model.last_metrics == {MODEL_SCORE_METRIC: pytest.approx(sum(model_scores) / 3)}
    with pytest.raises(RewardFunctionError, match="data.reward_model.path"):
        RewardComputer("none")


def test_a_sample_longer_than_max_length_is_an_error_naming_its_length_and_the_option(classifier):
    directory, _ = classifier
    reward_model = RewardModel(directory, max_length=10)
    with pytest.raises(DataError, match=r"input 1 \(prompt \+ response\) has 25 tokens, more than "
                                        r"data.reward_model.max_length=10"):
        reward_model.score(PROMPTS[:2], RESPONSES[:2])
    with pytest.raises(CheckpointFormatError, match="max_length=4096 exceeds the 128 positions"):
        RewardModel(directory, max_length=4096)


def _copy(directory, target, config_change=None, tensors_change=None):
    """`directory` (a saved classifier) copied to `target`, its config.json or tensors changed."""
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_text((directory / name).read_text())
    config = json.loads((directory / "config.json").read_text())
    (target / "config.json").write_text(json.dumps(config_change(config) if config_change else config))
    tensors = load_file(str(directory / "model.safetensors"))
    save_file(tensors_change(tensors) if tensors_change else tensors, str(target / "model.safetensors"))
    return target


def test_bad_checkpoints_are_errors_naming_the_tensor_or_field(tmp_path):
    good = tmp_path / "good"
    _save_classifier(good, "qwen2")
    missing_head = _copy(good, tmp_path / "no_head", tensors_change=lambda t: {k: v for k, v in t.items()
                                                                              if k != "score.weight"})
    with pytest.raises(CheckpointFormatError, match=r"tensor score.weight \(the reward head"):
        RewardModel(missing_head)
    wide_head = _copy(good, tmp_path / "wide_head", tensors_change=lambda t: {**t, "score.weight": torch.zeros(2, 32)})
    with pytest.raises(CheckpointFormatError, match=r"tensor score.weight .* has shape \(2, 32\).* \(1, 32\)"):
        RewardModel(wide_head)
    missing_layer = _copy(good, tmp_path / "no_norm", tensors_change=lambda t: {k: v for k, v in t.items()
                                                                               if k != "model.norm.weight"})
    with pytest.raises(CheckpointFormatError, match="model.norm.weight"):
        RewardModel(missing_layer)
    two_labels = _copy(good, tmp_path / "two_labels", config_change=lambda c: {
        **c, "id2label": {"0": "bad", "1": "good"}, "label2id": {"bad": 0, "good": 1}})
    with pytest.raises(CheckpointFormatError, match="num_labels=2"):
        RewardModel(two_labels)
    causal = _copy(good, tmp_path / "causal", config_change=lambda c: {**c, "architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(CheckpointFormatError, match=r"architectures=\['Qwen2ForCausalLM'\].*"
                                                    "Qwen2ForSequenceClassification"):
        RewardModel(causal)
    other = _copy(good, tmp_path / "other", config_change=lambda c: {**c, "model_type": "gpt2",
                                                                      "architectures": ["GPT2ForSequenceClassification"]})
    with pytest.raises(CheckpointFormatError, match="model_type='gpt2'"):
        RewardModel(other)
    (tmp_path / "no_tokenizer").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "no_tokenizer" / name).write_bytes((good / name).read_bytes())
    with pytest.raises(TokenizerNotFound, match="data.reward_model.tokenizer"):
        RewardModel(tmp_path / "no_tokenizer")
    assert RewardModel(tmp_path / "no_tokenizer", tokenizer=good).score(["1="], [" 1"])  # its tokenizer elsewhere


def test_config_keys_and_their_verl_names():
    cfg = load_config(None, ["data.reward=none", "data.reward_model.path=/rm", "data.reward_model.weight=0.5",
                             "data.reward_model.micro_batch_size=4"])
    assert (cfg.data.reward_model.path, cfg.data.reward_model.weight, cfg.data.reward_model.micro_batch_size) == \
        ("/rm", 0.5, 4)
    for overrides, message in ((["data.reward=none"], "data.reward=none needs data.reward_model.path"),
                               (["data.reward=gsm8k,none", "data.reward_model.path=/rm"], "cannot be combined"),
                               (["data.reward_model.dtype=int8"], "data.reward_model.dtype"),
                               (["data.reward_model.micro_batch_size=0"], "data.reward_model.micro_batch_size")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    values = translate(["reward_model.enable=true", "reward_model.model.path=/rm",
                        "reward_model.micro_batch_size_per_gpu=4", "reward_model.max_length=512"]).values
    assert {k: v for k, v in values.items() if k.startswith("data.reward") and k != "data.reward_fn_key"} == {
        "data.reward": "none", "data.reward_model.path": "/rm", "data.reward_model.micro_batch_size": 4,
        "data.reward_model.max_length": 512}  # verl's reward is then the model's score alone
    both = translate(["reward_model.enable=true", "reward_model.model.path=/rm", "custom_reward_function.path=r.py"])
    assert both.values["data.reward"] == "r.py:compute_score" and both.values["data.reward_model.path"] == "/rm"
    assert "data.reward_model.path" not in translate(["reward_model.model.path=/rm"]).values  # enable=false
    with pytest.raises(ConfigError, match="reward_model.model.path"):
        translate(["reward_model.enable=true"])


def test_a_training_run_scores_with_the_reward_model_and_the_rule(tmp_path):
    _save_classifier(tmp_path / "rm", "llama")
    run = tmp_path / "run"
    assert main(["train", *tiny_overrides("trainer.total_steps=1"), f"trainer.output_dir={run}",
                 f"data.reward_model.path={tmp_path / 'rm'}", "data.reward_model.weight=2.0",
                 "data.reward_model.micro_batch_size=5"]) == 0
    (step,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
               if "critic/score/mean" in line]
    model_mean = step[MODEL_SCORE_METRIC]
    assert model_mean != 0 and step["reward/num_failures"] == 0
    # The arithmetic rule scores 0 or 1, so the mean reward is the rule's mean + 2 x the model's mean.
    rule_mean = step["critic/score/mean"] - 2.0 * model_mean
    assert 0 <= rule_mean + 1e-6 and rule_mean <= 1 + 1e-6


def _scores_of_run(run_dir):
    (step,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if "critic/score/mean" in line]
    return step["critic/score/mean"], step[MODEL_SCORE_METRIC]


def _data_parallel_rank(rank, overrides, run_dir):
    run_kind("grpo", [*overrides, "parallel.dp_replicate=2"], run_dir)


def test_data_parallel_ranks_score_their_shares_to_the_single_process_means(tmp_path):
    _save_classifier(tmp_path / "rm", "qwen2")
    overrides = [*tiny_overrides("trainer.total_steps=1"), f"data.reward_model.path={tmp_path / 'rm'}",
                 "data.reward=none"]
    run_kind("grpo", overrides, tmp_path / "single")
    run_in_group(_data_parallel_rank, 2, overrides, tmp_path / "dp2")
    single, dp2 = _scores_of_run(tmp_path / "single"), _scores_of_run(tmp_path / "dp2")
    assert single[0] == pytest.approx(single[1], abs=1e-6)  # data.reward=none: the score is the model's
    assert dp2 == pytest.approx(single, abs=1e-5)
