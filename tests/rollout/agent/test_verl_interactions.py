"""verl's interactions (BaseInteraction user simulators, verl <= 0.7.1) run as the user of scalerl's tool
environment, from verl's interaction YAML as it is: the row's interaction_kwargs.name picks one, its response is
the next user message (context, untrained), its score the reward, should_terminate ends the episode, and the
instance is finalized whatever ended it; it trains from the config line. Bad configs and rows are refused naming
the class, the name and the fix."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
from scalerl.rollout.agent.tools import tool_from_function
from scalerl.rollout.agent.verl_interactions import (
    InteractionEnvironment,
    VerlInteractionError,
    VerlInteractions,
    interaction_kwargs,
)
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from tests.rollout.agent.conftest import ScriptedTurns, forget_modules
from tests.tiny import tiny_model

TOK = CharTokenizer()
SAMPLING = SamplingParams(max_new_tokens=96, seed=0, stop_token_ids=TOK.stop_token_ids)
LIMITS = AgentLimits(max_turns=4, max_total_tokens=256)

# A user's interactions as verl's docs write them: one shaped as verl's Gsm8kInteraction (the row's ground truth at
# start, the last assistant message checked each turn, a hint when wrong, finalize frees the instance), one that
# keeps every default of verl's BaseInteraction, and a length judge for training. The file imports verl's
# BaseInteraction: verl is not installed here (nor in verl >= 0.8, which dropped it), so scalerl's stands in.
USER_INTERACTIONS = '''
from uuid import uuid4

from verl.interactions.base import BaseInteraction

EVENTS = []


class AnswerCheckInteraction(BaseInteraction):
    def __init__(self, config):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth}
        EVENTS.append(("start", self.name, ground_truth))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        content = next(m["content"] for m in reversed(messages) if m["role"] == "assistant")
        self._instance_dict[instance_id]["response"] = content
        EVENTS.append(("seen", [m["role"] for m in messages]))
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, self.config.get("hint", "Try again."), reward, {"answer": content}

    async def calculate_score(self, instance_id, **kwargs):
        state = self._instance_dict[instance_id]
        return float(state["response"] == state["ground_truth"])

    async def finalize_interaction(self, instance_id, **kwargs):
        EVENTS.append(("finalize", self.name, self._instance_dict.pop(instance_id)["ground_truth"]))


class Polite(BaseInteraction):
    pass


class LengthJudge(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        turns = sum(m["role"] == "assistant" for m in messages)
        answer = messages[-1]["content"]
        return turns >= 2, f"Say more than {len(answer)}.", min(len(answer), 10) / 10, {}
'''
CONFIG = '''
interaction:
  - name: "check"
    class_name: "user_interactions.AnswerCheckInteraction"
    config: {hint: "Wrong, once more."}
  - class_name: "user_interactions.AnswerCheckInteraction"   # no name: verl's default, answercheck
    config: {}
  - class_name: "user_interactions.Polite"
    config: {}
  - name: judge
    class_name: "user_interactions.LengthJudge"
'''


@pytest.fixture
def interaction_files(tmp_path):
    """The user's interaction module beside its YAML (neither on sys.path: the YAML's directory is searched)."""
    forget_modules("verl")
    (tmp_path / "user_interactions.py").write_text(USER_INTERACTIONS)
    (tmp_path / "interaction_config.yaml").write_text(CONFIG)
    yield tmp_path
    forget_modules("verl", "user_interactions")


def _row(prompt: str, **kwargs) -> dict:
    """A verl row as scalerl's verl format reads one: interaction_kwargs under extra_info."""
    extra_info = {"index": 0, "interaction_kwargs": kwargs}
    return {"prompt": [{"role": "user", "content": prompt}], "extra_info": extra_info,
            "columns": {"extra_info": extra_info}}


def _run(make_env, rows, first, then="ok", limits=LIMITS):
    engine = BuiltinEngine(tiny_model(vocab_size=128).eval(), TOK.pad_token_id,
                           logits_processor=ScriptedTurns(len(rows), first, then)).continuous_engine(256, 96, 4)
    return AgentLoop(engine, TOK, make_env, limits).run(rows, SAMPLING)


def test_a_verl_interaction_yaml_runs_as_the_user_its_score_the_reward(interaction_files):
    interactions = VerlInteractions(interaction_files / "interaction_config.yaml")
    assert sorted(interactions.interactions) == ["answercheck", "check", "judge", "polite"]  # verl's naming
    assert interactions.interactions["check"].config == {"hint": "Wrong, once more.", "name": "check"}
    assert "verl" not in sys.modules  # the stand-in BaseInteraction was there for the import only
    rows = [_row("6+6=", name="check", ground_truth="12"),  # right at once: one turn, ended by the interaction
            _row("say ok", name="answercheck", ground_truth="ok"),  # wrong, then right after the hint
            _row("7?", name="check", ground_truth="7"),  # never right: the turns run out
            _row("hi", name="polite")]  # BaseInteraction's defaults: an accepting reply scored 0.8, never ending
    trajectories, records = _run(lambda: InteractionEnvironment(interactions, []), rows, "12")
    one, two, never, polite = zip(trajectories, records)
    assert [s.generated for s in one[0].segments] == [True] and one[1].end == "done" and one[1].reward == 1.0
    answer, user, ok = two[0].segments
    assert answer.generated and ok.generated and not user.generated  # the user's turn: context, not trained
    assert "Try again." in TOK.decode(user.token_ids) and TOK.decode(ok.token_ids, skip_special_tokens=True) == "ok"
    assert two[1].reward == 1.0 and two[1].info["turn_scores"] == [0.0, 1.0] and two[1].end == "done"
    assert never[1].end == "max_turns" and never[1].reward == 0.0 and never[1].info["turn_scores"] == [0.0] * 4
    assert all("Wrong, once more." in TOK.decode(s.token_ids) for s in never[0].segments if not s.generated)
    assert polite[1].reward == pytest.approx(0.8) and polite[1].end == "max_turns"
    assert "Your current result seems acceptable." in TOK.decode(polite[0].segments[1].token_ids)
    events = sys.modules["user_interactions"].EVENTS
    started = sorted(e[1:] for e in events if e[0] == "start")
    assert started == [("answercheck", "ok"), ("check", "12"), ("check", "7")]
    assert sorted(e[1:] for e in events if e[0] == "finalize") == started  # finalized, whatever ended it
    assert ("seen", ["user", "assistant"]) in events and ("seen", ["user", "assistant", "user", "assistant"]) in events


def test_tool_calls_go_to_the_tools_and_plain_answers_to_the_interaction(interaction_files):
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: the first
            b: the second
        """
        return a + b

    interactions = VerlInteractions(interaction_files / "interaction_config.yaml")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    trajectories, records = _run(lambda: InteractionEnvironment(interactions, [tool_from_function(add)]),
                                 [_row("2+3=", name="check", ground_truth="ok")], call)
    tool_call, result, answer = trajectories[0].segments
    assert tool_call.generated and result.token_ids == TOK.encode("5") and answer.generated
    assert records[0].reward == 1.0 and records[0].info["turn_scores"] == [1.0] and records[0].info["tool_calls"] == 1
    seen = [e for e in sys.modules["user_interactions"].EVENTS if e[0] == "seen"]
    assert seen == [("seen", ["user", "assistant", "tool", "assistant"])]  # verl's messages: the tool turn too


def test_bad_interaction_configs_and_rows_are_errors_naming_them(interaction_files):
    def config(body: str):
        path = interaction_files / "bad.yaml"
        path.write_text(textwrap.dedent(body))
        return path

    cases = [
        (CONFIG.replace("Polite", "NoSuchInteraction"),
         r"interaction\[2\]: class_name 'user_interactions.NoSuchInteraction': module user_interactions has no class"),
        ("interaction: []\n", "has no `interaction:` list; verl's shape is"),
        ("tools: []\n", "has no `interaction:` list"),
        ("interaction:\n  - class_name: user_interactions.Polite\n  - class_name: user_interactions.Polite\n",
         r"interaction\[1\]: a second interaction named 'polite'"),
        ("interaction:\n  - class_name: builtins.dict\n", "dict has no start_interaction or generate_response"),
        ("interaction:\n  - class_name: user_interactions.Polite\n    config: [1]\n", "config must be a mapping"),
    ]
    for body, message in cases:
        with pytest.raises(VerlInteractionError, match=message):
            VerlInteractions(config(body))
    with pytest.raises(VerlInteractionError, match="no such file"):
        VerlInteractions(interaction_files / "nope.yaml")
    interactions = VerlInteractions(interaction_files / "interaction_config.yaml")
    _, records = _run(lambda: InteractionEnvironment(interactions, []),
                      [_row("x", name="judges"), _row("x", ground_truth="1")], "12")
    assert [r.end for r in records] == ["env_error", "env_error"]  # that episode only; the batch goes on
    assert ("interaction_kwargs.name 'judges' is not in" in records[0].info["error"]
            and "(interactions: answercheck, check, judge, polite)" in records[0].info["error"])
    assert "extra_info.interaction_kwargs has no 'name'" in records[1].info["error"]
    assert interaction_kwargs({"interaction_kwargs": {"name": "a"}}) == {"name": "a"}  # top-level rows too


def test_the_config_keys_build_the_interaction_environment(interaction_files):
    from scalerl.core.config import ConfigError, load_config
    from scalerl.rollout.agent.source import environment_factory

    path = interaction_files / "interaction_config.yaml"
    cfg = load_config(None, ["rollout.agent.env=tools", f"rollout.agent.interaction_config={path}"])
    assert isinstance(environment_factory(cfg.rollout.agent)(), InteractionEnvironment)  # no tools needed
    with pytest.raises(ConfigError, match="rollout.agent.interaction_config=.* is read with rollout.agent.env=tools"):
        load_config(None, ["rollout.agent.env=chat", f"rollout.agent.interaction_config={path}"])
    bad = interaction_files / "bad.yaml"
    bad.write_text("interaction:\n  - class_name: user_interactions.Nope\n")
    cfg = load_config(None, ["rollout.agent.env=tools", f"rollout.agent.interaction_config={bad}"])
    with pytest.raises(VerlInteractionError, match="module user_interactions has no class Nope"):
        environment_factory(cfg.rollout.agent)  # at start-up, not in the first episode


def test_a_verl_interaction_trains_from_the_config_line(tiny_config, length_reward, tmp_path, interaction_files):
    """A few steps on verl-format rows whose interaction_kwargs name the length judge: every row is the model's
    turns with the judge's reply between them (untrained), scored by the judge's last score."""
    from scalerl.trainer.rl_trainer import RLTrainer

    data = tmp_path / "verl_rows.jsonl"
    data.write_text("".join(json.dumps({
        "data_source": "test", "prompt": [{"role": "user", "content": f"{a}+{a}="}], "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * a)},
        "extra_info": {"index": a, "interaction_kwargs": {"name": "judge"}}}) + "\n" for a in range(1, 21)))
    trainer = RLTrainer.from_config(tiny_config(
        "trainer.total_steps=3", "rollout.agent.env=tools", "rollout.agent.max_turns=2",
        f"rollout.agent.interaction_config={interaction_files}/interaction_config.yaml", "data.format=verl",
        f"data.train_files=[{data}]", f"data.val_files=[{data}]", length_reward, f"trainer.output_dir={tmp_path}/i"))
    batches = []
    trainer.on_batch = batches.append
    trainer.fit()
    assert len(batches) == 3
    for batch in batches:
        for i in range(len(batch)):
            length = int(batch.response_attention[i].sum())
            trained = batch.response_mask[i, :length].tolist()
            ids = batch.response_ids[i, :length].tolist()
            runs, start = [], None  # the model's turns: the runs of trained tokens
            for j, m in enumerate([*trained, 0]):
                if m and start is None:
                    start = j
                elif not m and start is not None:
                    runs.append((start, j))
                    start = None
            last = TOK.decode(ids[runs[-1][0]:runs[-1][1]], skip_special_tokens=True)
            assert batch.scores[i].item() == pytest.approx(min(len(last), 10) / 10)  # the judge's, not length's
            if len(runs) == 2:  # the judge's reply sits between the turns, untrained
                assert TOK.decode(ids[runs[0][1]:runs[1][0]]).count("Say more than") == 1
    rows = [json.loads(x) for x in (trainer.output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "agent/turns/max" in r]
    assert len(steps) == 3 and all(r["agent/env_errors"] == 0 for r in steps)
    assert max(r["agent/turns/max"] for r in steps) == 2


def test_the_interaction_example_runs_as_its_docs_say():
    from pathlib import Path

    from scalerl.core.config import load_config
    from scalerl.rollout.agent.source import environment_factory

    examples = Path(__file__).resolve().parents[3] / "examples" / "agents"
    forget_modules("verl")
    cfg = load_config(None, ["rollout.agent.env=tools",
                             f"rollout.agent.interaction_config={examples}/verl_interaction_config.yml"])
    try:
        make_env = environment_factory(cfg.rollout.agent)
        rows = [_row("6+6=", name="answer_check", ground_truth="12"), _row("1+1=", name="answer_check",
                                                                         ground_truth="2")]
        trajectories, records = _run(make_env, rows, "12", then="2")
    finally:
        forget_modules("verl", "verl_interaction")
    assert [r.reward for r in records] == [1.0, 1.0] and [t.num_turns for t in trajectories] == [1, 2]
    assert "Not yet: check your arithmetic" in TOK.decode(trajectories[1].segments[1].token_ids)
