"""Multi-turn rollouts as a rollout source: the trainer asks it for a step's rows as it asks any source, and gets
trajectories laid out with their loss mask; it never learns that an agent produced them.

Colocated, each DP rank runs its share's episodes (every prompt ``rollout.n`` times) through `AgentLoop` on a
continuous-batching engine over the policy's weights (the built-in engine's own, so the weight sync is free as
for single-turn colocated rollouts; with rollout.engine=vllm vLLM's scheduler, its prefix cache reusing each
conversation's earlier turns), and reports ``agent/*`` metrics with the step's. Standalone
(rollout.placement=standalone), the rollout workers build the same loop (`agent_loop`) on their own engines and
the trainer gets the trajectories through `scalerl.rollout.sources.StandaloneRollouts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scalerl.core.errors import UserError
from scalerl.rollout.agent.environment import (
    ChatEnvironment,
    ToolEnvironment,
    environment_class,
    is_trl_environment,
)
from scalerl.rollout.agent.loop import AgentLimits, AgentLoop, agent_metrics
from scalerl.rollout.engines.engine import GenerationOutput, SamplingParams
from scalerl.rollout.sources import ColocatedRollouts, StepPrompts, dp_rows
from scalerl.rollout.trajectory import trajectories_to_output

# Room per turn for the environment's answer, in the default token budget (rollout.agent.max_total_tokens=0).
ENV_TOKENS_PER_TURN = 64


def agent_limits(cfg: Any) -> AgentLimits:
    a = cfg.rollout.agent
    budget = a.max_total_tokens or cfg.data.max_prompt_length + a.max_turns * (cfg.rollout.max_new_tokens
                                                                              + ENV_TOKENS_PER_TURN)
    return AgentLimits(max_turns=a.max_turns, max_total_tokens=budget, env_timeout_s=a.env_timeout_s)


def environment_factory(agent_cfg: Any) -> Callable[[], Any]:
    """A maker of one fresh environment per episode, from ``rollout.agent``."""
    if agent_cfg.env == "chat":
        return ChatEnvironment
    if agent_cfg.env == "tools":
        from scalerl.rollout.agent.sandbox import python_tool, sandbox_from_spec
        from scalerl.rollout.agent.tools import tools_from_module

        tools = tools_from_module(agent_cfg.tools) if agent_cfg.tools else []
        if agent_cfg.tools and not tools:
            raise UserError(f"rollout.agent.tools={agent_cfg.tools!r} names no function")
        if agent_cfg.tool_config:  # verl's tool YAML: its BaseTool classes, an instance per trajectory
            from scalerl.rollout.agent.adapters import tools_from_verl_config

            tools += tools_from_verl_config(agent_cfg.tool_config)
        if agent_cfg.function_tool_path:  # verl's @function_tool file: its functions, stateless
            from scalerl.rollout.agent.adapters import check_tool_names, function_tools_as_tools

            function_tools = function_tools_as_tools(agent_cfg.function_tool_path)
            check_tool_names({"rollout.agent.tools / tool_config": tools,
                              f"rollout.agent.function_tool_path={agent_cfg.function_tool_path}": function_tools})
            tools += function_tools
        if agent_cfg.sandbox:
            sandbox = sandbox_from_spec(agent_cfg.sandbox)
            print(f"rollout.agent.sandbox={agent_cfg.sandbox}: {getattr(sandbox, 'network_note', 'a sandbox of yours')}",
                  flush=True)
            tools.append(python_tool(sandbox))
        if agent_cfg.interaction_config:  # verl's interactions answer the turns without a tool call, as the user
            from scalerl.rollout.agent.verl_interactions import interaction_environment_factory

            return interaction_environment_factory(agent_cfg, tools)
        return lambda: ToolEnvironment(tools, agent_cfg.tool_parser, agent_cfg.system, agent_cfg.max_tool_calls_per_turn)
    cls = environment_class(agent_cfg.env)
    if is_trl_environment(cls):  # TRL's environment_factory class, as it is: its methods are the tools
        from scalerl.rollout.agent.adapters import trl_environment_factory
        from scalerl.rollout.agent.tools import tools_from_module

        return trl_environment_factory(cls, tools_from_module(agent_cfg.tools) if agent_cfg.tools else [],
                                       agent_cfg.tool_parser, agent_cfg.system, agent_cfg.max_tool_calls_per_turn)
    return cls


def agent_loop(cfg: Any, tokenizer: Any, engine: Any) -> Any:
    """The run's episode runner on ``engine`` (a continuous engine), its environments and limits from
    ``rollout.agent``: what `AgentRollouts`, a standalone rollout worker (`scalerl.rollout.worker.worker`) and
    a standalone run's evaluation (`EvaluationEpisodes`) run."""
    r = cfg.rollout
    limits = agent_limits(cfg)
    if r.agent.env == "verl":  # verl AgentLoopBase subclasses, as token-level environments
        from scalerl.rollout.agent.verl_loop import verl_loop_factory

        return AgentLoop(engine, tokenizer, verl_loop_factory(cfg, tokenizer, limits), limits)
    return AgentLoop(engine, tokenizer, environment_factory(r.agent), limits)


class AgentRollouts(ColocatedRollouts):
    """Each DP rank's rows of a step as episodes (`AgentLoop`), on a continuous engine over the policy."""

    def __init__(self, engine: Any, policy: Any, ctx: Any, cfg: Any, tokenizer: Any):
        super().__init__(engine, policy, ctx)
        r = cfg.rollout
        limits = agent_limits(cfg)
        rows = cfg.trainer.batch_size * r.n // max(ctx.dp_size, 1)
        continuous = engine.continuous_engine(limits.max_total_tokens, r.max_new_tokens, r.max_num_seqs or rows)
        if r.agent.env in ("program", "verifiers"):  # the user's own agent code, on the in-run OpenAI endpoint
            from scalerl.rollout.agent.endpoint_source import endpoint_episodes

            self.loop = endpoint_episodes(continuous, tokenizer, r.agent)
        else:
            self.loop = agent_loop(cfg, tokenizer, continuous)
        self.n, self.pad_token_id = r.n, engine.pad_token_id
        self.metrics: dict[str, float] = {}

    @property
    def logprobs_match_training_forward(self) -> bool:
        return self.loop.engine.logprobs_match_training_forward

    def generate(self, batch: StepPrompts) -> GenerationOutput:
        start, stop = dp_rows(len(batch.prompts), self.ctx)
        rows = [batch.rows[i // self.n] for i in range(start, stop)]
        began = time.perf_counter()
        trajectories, records = self.loop.run(rows, batch.sampling, row_offset=start, total_rows=len(batch.prompts))
        self.metrics = agent_metrics(records, trajectories, time.perf_counter() - began)
        getattr(self.engine, "sleep", lambda: None)()  # vLLM on a GPU gives its memory to the update
        return trajectories_to_output(trajectories, self.pad_token_id)

    def episodes(self, rows: list[dict], sampling: SamplingParams) -> tuple[list[str], list[int], list[float | None]]:
        """Evaluation's answers (`scalerl.trainer.evaluation.answers`): one episode per row in the environment the
        run trains in (`evaluation_episodes`)."""
        return evaluation_episodes(self.loop, rows, sampling)

    def step_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


class EvaluationEpisodes:
    """A standalone run's evaluation as episodes: the workers generate the training episodes, the trainer
    evaluates on an engine of its own (refreshed to the current weights by the caller), so it runs its own
    loop over a continuous engine of that engine, with the run's environments and limits (`agent_loop`)."""

    def __init__(self, cfg: Any, tokenizer: Any, engine: Any):
        self.cfg, self.tokenizer, self.engine = cfg, tokenizer, engine

    def episodes(self, rows: list[dict], sampling: SamplingParams) -> tuple[list[str], list[int], list[float | None]]:
        r = self.cfg.rollout
        continuous = self.engine.continuous_engine(agent_limits(self.cfg).max_total_tokens, r.max_new_tokens,
                                                   r.max_num_seqs or len(rows))
        return evaluation_episodes(agent_loop(self.cfg, self.tokenizer, continuous), rows, sampling)


def evaluation_episodes(loop: Any, rows: list[dict],
                        sampling: SamplingParams) -> tuple[list[str], list[int], list[float | None]]:
    """One episode per row with ``sampling`` (greedy by default): each trajectory's response text (tool results
    and user turns included, as training scores it), its length in tokens, and the environment's reward."""
    trajectories, _ = loop.run(rows, sampling, row_offset=sampling.row_offset,
                               total_rows=sampling.total_rows or len(rows))
    texts = loop.tokenizer.batch_decode([t.response_ids for t in trajectories])
    given = [t.reward_inputs.get("env_reward") for t in trajectories]
    return texts, [len(t.response_ids) for t in trajectories], given
