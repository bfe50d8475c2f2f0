"""`scalerl demo`: the whole product on a CPU in minutes, with no downloads.

1. A weak teacher writes demonstrations for the built-in arithmetic task: most of its final answers are
   off by one (as distillation data from a weaker model is systematically wrong in places).
2. SFT warm-starts the built-in tiny model on those demonstrations: it learns the format and, faithfully,
   the teacher's mistakes.
3. GRPO then trains on the same kind of prompts with the exact-answer reward, which the teacher never saw,
   and held-out accuracy (greedy, on problems never trained on) rises well above the SFT checkpoint's.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

from scalerl.core.config import Config
from scalerl.data.arithmetic import make_arithmetic_rows
from scalerl.data.tool_arithmetic import (
    OPERATOR_TEXT,
    TOOL_SPEC,
    chat_tool_demonstration_rows,
    direct_demonstration_rows,
    make_tool_arithmetic_rows,
    tool_answer_reward,
    tool_demonstration_rows,
)

# Share of the teacher's demonstrations whose final answer is off by one.
TEACHER_ERROR_RATE = 0.6


def weak_teacher_rows(rows: list[dict], error_rate: float, seed: int) -> list[dict]:
    """Copies of ``rows`` whose SFT ``response`` ends in ``#### answer+1`` with probability ``error_rate``.
    ``ground_truth`` stays correct: rewards are always computed against the truth."""
    rng = random.Random(f"weak-teacher:{seed}")
    out = []
    for row in rows:
        row = {k: row[k] for k in ("prompt", "response", "ground_truth")}
        if rng.random() < error_rate:
            work = row["response"].rsplit("#### ", 1)[0]
            row["response"] = f"{work}#### {int(row['ground_truth']) + 1}"
        out.append(row)
    return out


def write_teacher_demonstrations(cfg: Config, path: Path, seed: int) -> Path:
    """The weak teacher's demonstrations for ``cfg``'s task (``data.num_train`` rows), as JSON lines at ``path``."""
    rows = weak_teacher_rows(make_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), seed),
                             TEACHER_ERROR_RATE, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _say(text: str) -> None:
    print(text, flush=True)


def run_demo(cfg: Config) -> dict[str, Any]:
    from scalerl.trainer.rl_trainer import train
    from scalerl.trainer.run_checks import check_run_inputs
    from scalerl.trainer.sft_trainer import train_sft

    check_run_inputs(cfg)  # before the teacher writes anything; each run checks its own config again
    start = time.perf_counter()
    out = Path(cfg.trainer.output_dir)
    seed = cfg.trainer.seed
    _say(f"scalerl demo -> {out}/")
    _say(f"[1/3] weak teacher: {cfg.data.num_train} arithmetic demonstrations (levels {cfg.data.difficulty}), "
         f"{TEACHER_ERROR_RATE:.0%} with an off-by-one answer")
    teacher_file = write_teacher_demonstrations(cfg, out / "data" / "teacher_demonstrations.jsonl", seed)

    _say(f"[2/3] SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} demonstrations")
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.data.train_files = [str(teacher_file)]
    sft_cfg.sft.output_dir = str(out / "sft")
    sft = train_sft(sft_cfg)
    sft_time = time.perf_counter() - start

    _say(f"[3/3] GRPO: {cfg.trainer.total_steps} steps x {cfg.trainer.batch_size} prompts x {cfg.rollout.n} samples, "
         "reward = exact answer")
    rl_cfg = copy.deepcopy(cfg)
    rl_cfg.trainer.init_from = sft["model_dir"]
    rl_cfg.trainer.output_dir = str(out / "grpo")
    summary = train(rl_cfg)
    before = summary["initial"]["val/accuracy"]
    after = summary["last"]["val/accuracy"]
    total = time.perf_counter() - start
    result = {
        "heldout_accuracy_sft": before,
        "heldout_accuracy_grpo": after,
        "gain_points": 100 * (after - before),
        "sft_seconds": sft_time,
        "total_seconds": total,
        "final_model": summary["final_model"],
        "metrics": str(out / "grpo" / "metrics.jsonl"),
        "plot": summary.get("plot"),
    }
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    _say("")
    _say(f"held-out accuracy after SFT : {before:6.1%}")
    _say(f"held-out accuracy after GRPO: {after:6.1%}   ({result['gain_points']:+.1f} points)")
    _say(f"time: SFT {sft_time:.0f} s, total {total:.0f} s")
    _say(f"metrics: {result['metrics']} | plot: {result['plot']} | model: {result['final_model']}")
    return result


# ---- `scalerl demo --agent`: a task where the tool matters -------------------------------------------------
# The task (`scalerl.data.tool_arithmetic`): ``a @ b = a*b + a + b`` on two-digit operands, an operator the model
# never sees defined; only the calculator tool ``op`` computes it.
# 1. A scripted teacher writes demonstrations of tool use: the call in the Hermes format, the tool's result,
#    the final answer (`tool_demonstration_rows`: one SFT row per assistant turn, so the loss covers the
#    model's turns and never the prompt or the tool's result).
# 2. SFT warm-starts the built-in tiny model on them (``data.chat_template=true``: prompts are laid out as the
#    agent loop lays them out, without a BOS). A model with a chat template of its own (``model.path``) gets the
#    rows rendered through it as the loop lays the episode out (`chat_tool_demonstration_rows`), trained with
#    ``data.chat_template=false`` so they are not templated twice.
# 3. GRPO trains with the tool environment (``rollout.agent.env=tools`` over ``op``), the exact final answer as
#    reward.
# Held-out accuracy is measured in episodes (`evaluate_episodes`: greedy, the tool environment, up to
# ``rollout.agent.max_turns`` turns) after SFT and after GRPO, one evaluator for both models (the SFT run has no
# environment), so the GRPO run's own evaluation (also in episodes) is switched off (``data.num_val=0`` there). ``use_tool=False`` runs the same pipeline
# without the tool (demonstrations answer directly, GRPO is single-turn, evaluation is one turn): the baseline
# ``benchmarks/agent_task.py`` compares against. ``scalerl demo --agent`` runs `run_agent_demo` on
# `AGENT_DEMO_CONFIG` under the command line's overrides.

AGENT_DEMO_CONFIG = Path(__file__).parent / "configs" / "demo_agent.yaml"


class AnswerOnce:
    """The environment of the no-tool baseline: the prompt, one answer, done."""

    def reset(self, row: dict) -> list[dict]:
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, message: dict):
        from scalerl.rollout.agent.environment import EnvStep

        return EnvStep(done=True)


def tool_environment_factory(max_calls_per_turn: int = 4):
    """Fresh tool environments over the task's tool, in the Hermes format (what ``rollout.agent.env=tools
    rollout.agent.tools=scalerl.data.tool_arithmetic:op`` builds)."""
    from scalerl.rollout.agent.environment import ToolEnvironment
    from scalerl.rollout.agent.tools import tools_from_module

    tools = tools_from_module(TOOL_SPEC)
    return lambda: ToolEnvironment(tools, "hermes", None, max_calls_per_turn)


def evaluate_episodes(model: Any, tokenizer: Any, rows: list[dict], *, use_tool: bool, max_new_tokens: int,
                      max_turns: int, max_total_tokens: int, seed: int = 0, max_num_seqs: int = 128) -> dict[str, Any]:
    """Held-out accuracy of ``model`` in episodes: greedy turns on the continuous engine, the tool environment
    (``use_tool``) or one answer; each episode's text scored by `tool_answer_reward`. Also the share of
    episodes that called the tool, and a few episodes' texts."""
    import torch

    from scalerl.rollout.agent.loop import AgentLimits, AgentLoop
    from scalerl.rollout.engines.builtin import BuiltinEngine
    from scalerl.rollout.engines.engine import SamplingParams

    model.eval()
    engine = BuiltinEngine(model, tokenizer.pad_token_id).continuous_engine(
        max_total_tokens, max_new_tokens, max_num_seqs=min(max_num_seqs, max(len(rows), 1)))
    make_env = tool_environment_factory() if use_tool else AnswerOnce
    loop = AgentLoop(engine, tokenizer, make_env, AgentLimits(max_turns=max_turns if use_tool else 1,
                                                              max_total_tokens=max_total_tokens))
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=tokenizer.stop_token_ids,
                              seed=seed)
    with torch.no_grad():
        trajectories, records = loop.run(rows, sampling)
    texts = [tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajectories]
    scores = [tool_answer_reward(text, row["ground_truth"]) for text, row in zip(texts, rows)]
    called = [r.info.get("tool_calls", 0) > 0 for r in records]
    return {"accuracy": sum(scores) / max(len(rows), 1), "tool_call_rate": sum(called) / max(len(rows), 1),
            "examples": [rows[i]["prompt"] + texts[i] for i in range(min(3, len(rows)))]}


def _evaluate_dir(cfg: Any, model_dir: str, rows: list[dict], use_tool: bool) -> dict[str, Any]:
    import torch

    from scalerl.models.load import load_model_and_tokenizer
    from scalerl.rollout.agent.source import agent_limits

    torch.manual_seed(cfg.trainer.seed)
    model, tokenizer = load_model_and_tokenizer(cfg.model, model_dir, torch.device("cpu"), cfg.trainer.seed)
    limits = agent_limits(cfg)
    return evaluate_episodes(model, tokenizer, rows, use_tool=use_tool, max_new_tokens=cfg.rollout.max_new_tokens,
                             max_turns=limits.max_turns, max_total_tokens=limits.max_total_tokens,
                             seed=cfg.trainer.seed)


def environment_resets(cfg: Any, rows: list[dict]) -> dict[str, tuple[list[dict], list[dict]]]:
    """What the run's tool environment (``rollout.agent``) opens each row's episode with: its first messages
    (a system prompt included) and the tools' schemas, by prompt; each environment closed after."""
    import asyncio
    import inspect

    from scalerl.rollout.agent.source import environment_factory

    make_env = environment_factory(cfg.rollout.agent)

    async def reset_all() -> dict[str, tuple[list[dict], list[dict]]]:
        opened = {}
        for row in rows:
            env = make_env()
            reset = env.reset(row)
            reset = await reset if inspect.isawaitable(reset) else reset
            opened[row["prompt"]] = reset if isinstance(reset, tuple) else (reset, None)
            closing = env.close() if callable(getattr(env, "close", None)) else None
            if inspect.isawaitable(closing):
                await closing
        return opened

    return asyncio.run(reset_all())


def write_demonstrations(cfg: Any, path: Path, use_tool: bool, chat_tokenizer: Any = None) -> Path:
    """The scripted teacher's demonstrations for ``cfg``'s training problems, as JSON lines at ``path``. With
    ``chat_tokenizer`` (a model with a real chat template) the tool-use rows are rendered through its template as
    the agent loop lays the episode out (`chat_tool_demonstration_rows`; SFT them with
    ``data.chat_template=false``)."""
    rows = make_tool_arithmetic_rows("train", cfg.data.num_train, list(cfg.data.difficulty), cfg.trainer.seed)
    if use_tool and chat_tokenizer is not None:
        opened = environment_resets(cfg, rows)
        demos = chat_tool_demonstration_rows(rows, chat_tokenizer, lambda row: opened[row["prompt"]])
    else:
        demos = tool_demonstration_rows(rows) if use_tool else direct_demonstration_rows(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in demos))
    return path


def _check_episode_budget(cfg: Any, tokenizer: Any, teacher_file: Path) -> None:
    """A chat template's system block (the tools' schemas) makes the episodes longer than the built-in
    template's: the teacher's longest episode must fit the agent loop's token budget, or every episode would
    end at the budget before its answer."""
    from scalerl.core.config import ConfigError
    from scalerl.rollout.agent.source import ENV_TOKENS_PER_TURN, agent_limits

    budget = agent_limits(cfg).max_total_tokens
    longest = max(len(tokenizer.encode(r["prompt"])) + len(tokenizer.encode(r["response"])) + 1
                  for r in map(json.loads, teacher_file.read_text().splitlines()))
    if longest > budget:
        raise ConfigError(f"the teacher's longest episode through the chat template of {tokenizer.name_or_path} is "
                          f"{longest} tokens, more than the agent loop's budget of {budget} (rollout.agent."
                          "max_total_tokens, or when 0 data.max_prompt_length + rollout.agent.max_turns x "
                          f"(rollout.max_new_tokens + {ENV_TOKENS_PER_TURN})): raise data.max_prompt_length or "
                          "rollout.agent.max_total_tokens")


def run_agent_demo(cfg: Any, use_tool: bool = True) -> dict[str, Any]:
    """SFT on the scripted teacher's demonstrations, then GRPO, on the tool task; held-out accuracy in
    episodes after each (`evaluate_episodes`, ``data.num_val`` unseen problems). ``use_tool=False``: the same
    without the tool (the baseline)."""
    from scalerl.models.load import tokenizer_source
    from scalerl.models.tokenizer import CharTokenizer, load_tokenizer
    from scalerl.trainer.rl_trainer import train
    from scalerl.trainer.run_checks import check_run_inputs
    from scalerl.trainer.sft_trainer import train_sft

    cfg = copy.deepcopy(cfg)
    if cfg.data.task != "tool_arithmetic":
        cfg.data.task = "tool_arithmetic"
    if use_tool and not cfg.rollout.agent.env:
        cfg.rollout.agent.env, cfg.rollout.agent.tools = "tools", TOOL_SPEC
    if not use_tool:
        cfg.rollout.agent.env = cfg.rollout.agent.tools = None
    cfg.data.chat_template = True  # the agent loop renders prompts through the template: no BOS, as in SFT here
    check_run_inputs(cfg)
    # A model with a chat template of its own (model.path, e.g. a Qwen2.5-style instruct model): the tool-use
    # rows are rendered through it as the agent loop lays the episode out, so SFT must not template them again.
    tokenizer = load_tokenizer(tokenizer_source(cfg.model, cfg.trainer.init_from or cfg.model.path,
                                                "trainer.init_from" if cfg.trainer.init_from else "model.path"))
    rendered = use_tool and not isinstance(tokenizer, CharTokenizer)
    start = time.perf_counter()
    out, seed = Path(cfg.trainer.output_dir), cfg.trainer.seed
    arm = "with the tool" if use_tool else "without the tool (baseline)"
    _say(f"scalerl demo --agent -> {out}/  ({OPERATOR_TEXT}, levels {list(cfg.data.difficulty)}, {arm})")
    _say(f"[1/3] scripted teacher: {cfg.data.num_train} problems, "
         + ("each a call to the tool op, its result and the answer" if use_tool else "each answered directly"))
    teacher_file = write_demonstrations(cfg, out / "data" / "teacher_demonstrations.jsonl", use_tool,
                                        tokenizer if rendered else None)
    if rendered:
        _say(f"      rendered through the chat template of {tokenizer.name_or_path} as the agent loop lays them out")
        _check_episode_budget(cfg, tokenizer, teacher_file)
    held_out = make_tool_arithmetic_rows("test", cfg.data.num_val, list(cfg.data.difficulty), seed)

    _say(f"[2/3] SFT warm start: {cfg.sft.steps} steps of {cfg.sft.batch_size} demonstration turns")
    sft_cfg = copy.deepcopy(cfg)
    sft_cfg.data.train_files, sft_cfg.data.val_fraction = [str(teacher_file)], 0.0
    sft_cfg.data.chat_template = not rendered  # rendered rows hold their template's tokens already
    sft_cfg.sft.output_dir = str(out / "sft")
    sft = train_sft(sft_cfg)
    sft_time = time.perf_counter() - start
    before = _evaluate_dir(cfg, sft["model_dir"], held_out, use_tool)
    _say(f"held-out accuracy after SFT: {before['accuracy']:.1%} (tool called in {before['tool_call_rate']:.0%})")

    _say(f"[3/3] GRPO: {cfg.trainer.total_steps} steps x {cfg.trainer.batch_size} prompts x {cfg.rollout.n} "
         + ("episodes with the tool" if use_tool else "samples") + ", reward = exact final answer")
    rl_cfg = copy.deepcopy(cfg)
    rl_cfg.trainer.init_from = sft["model_dir"]
    rl_cfg.trainer.output_dir = str(out / "grpo")
    rl_cfg.data.num_val = 0  # held-out accuracy is measured here, by the evaluator the SFT model had
    summary = train(rl_cfg)
    after = _evaluate_dir(cfg, summary["final_model"], held_out, use_tool)
    total = time.perf_counter() - start
    result = {
        "use_tool": use_tool, "seed": seed,
        "heldout_accuracy_sft": before["accuracy"], "heldout_accuracy_grpo": after["accuracy"],
        "tool_call_rate_sft": before["tool_call_rate"], "tool_call_rate_grpo": after["tool_call_rate"],
        "gain_points": 100 * (after["accuracy"] - before["accuracy"]),
        "examples_grpo": after["examples"], "sft_seconds": sft_time, "total_seconds": total,
        "final_model": summary["final_model"], "metrics": str(out / "grpo" / "metrics.jsonl"),
    }
    (out / "demo_result.json").write_text(json.dumps(result, indent=2))
    _say("")
    _say(f"held-out accuracy after SFT : {before['accuracy']:6.1%}   ({len(held_out)} unseen problems, greedy, "
         + ("in episodes with the tool)" if use_tool else "one answer, no tool)"))
    _say(f"held-out accuracy after GRPO: {after['accuracy']:6.1%}   ({result['gain_points']:+.1f} points)")
    _say(f"an episode: {after['examples'][0]!r}" if after["examples"] else "")
    _say(f"time: SFT {sft_time:.0f} s, total {total:.0f} s")
    _say(f"metrics: {result['metrics']} | model: {result['final_model']}")
    return result
