"""Episodes the user's own agent code runs against the rollout endpoint inside a training run: an agent program
in a process of its own (``rollout.agent.env=program``) or a `verifiers` environment's rollout
(``rollout.agent.env=verifiers``, `verifiers_env`), each talking to scalerl's engine through the
OpenAI-compatible `RolloutEndpoint` as it would to any server.

For each step's rows `EndpointEpisodes.run` starts an endpoint on 127.0.0.1 (a fresh token, a free port) over
the continuous engine of the policy's own weights, opens one session per row, lets the runner play every
session (at most ``rollout.agent.max_concurrent_episodes`` at once, each within
``rollout.agent.episode_timeout_s``), and collects each session's recorded calls stitched into a trajectory
(`endpoint.stitch_calls`: the ids the engine sampled, trained, everything between them context) with the
reward posted for it. It answers what `AgentLoop.run` answers, so `AgentRollouts` trains on it unchanged.

What can go wrong is an error that stops the step and names the program or the environment, the row and the
cause: a program that exits non-zero (its stderr's tail), one that outlives the timeout (its process group is
killed), an episode that never called the model. A session whose calls do not chain (the agent rewrote its
history) gives several trajectories; the one holding the session's last call is trained, the others are
counted (``info["dropped_trajectories"]``, and the break in ``agent/prefix_breaks``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from scalerl.core.errors import UserError
from scalerl.rollout.agent.endpoint import RolloutEndpoint
from scalerl.rollout.agent.loop import EpisodeRecord
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import Trajectory

STDERR_TAIL_CHARS = 2000  # of a failed program's stderr, in the error
REAP_LIMIT_S = 10.0  # waiting for a killed program to exit


class EndpointEpisodes:
    """One step's episodes through an in-run `RolloutEndpoint` on ``engine`` (a `ContinuousEngine`): ``runner``
    (`ProgramRunner`, `verifiers_env.VerifiersRunner`) plays the sessions. The shape of `AgentLoop`
    (``run``, ``engine``, ``tokenizer``), so `AgentRollouts` uses either."""

    def __init__(self, engine: Any, tokenizer: Any, runner: Any, *, tool_parser: str = "hermes",
                 timeout_s: float = 600.0, concurrency: int = 0, model_name: str = "scalerl"):
        self.engine, self.tokenizer, self.runner = engine, tokenizer, runner
        self.tool_parser, self.timeout_s, self.concurrency, self.model_name = (tool_parser, timeout_s, concurrency,
                                                                              model_name)

    def run(self, rows: list[dict], sampling: SamplingParams, row_offset: int = 0,
            total_rows: int | None = None) -> tuple[list[Trajectory], list[EpisodeRecord]]:
        """One trajectory per row. Every call samples with ``sampling``'s temperature / top_p / top_k whatever
        the agent asks (the trainer's log-probs assume them); a call without a seed gets one from ``sampling``'s
        seed, the global row and the call's number."""
        seed = None if sampling.seed is None else (sampling.seed * 1_000_003 + row_offset) % 2**63
        endpoint = RolloutEndpoint(
            self.engine, self.tokenizer, sampling=replace(sampling, seed=seed, row_offset=0, total_rows=None),
            fixed_sampling=True, tool_parser=self.tool_parser, model_name=self.model_name,
            request_timeout_s=self.timeout_s).start()
        try:
            sessions = [endpoint.open_session(row, f"row-{row_offset + i}") for i, row in enumerate(rows)]
            loop = asyncio.new_event_loop()
            try:
                loop.run_until_complete(self._play(endpoint, sessions, rows))
            finally:
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.close()
            done = [self._collect(endpoint, session, row) for session, row in zip(sessions, rows)]
        finally:
            endpoint.close()
        return [t for t, _ in done], [r for _, r in done]

    async def _play(self, endpoint: RolloutEndpoint, sessions: list[str], rows: list[dict]) -> None:
        """Every session's episode, ``concurrency`` at a time; the first failure cancels the others."""
        gate = asyncio.Semaphore(self.concurrency or len(sessions) or 1)
        episodes: list[asyncio.Future] = []
        stopping: set[asyncio.Future] = set()  # cancelled once already: a second cancel would cut their cleanup

        async def one(session: str, row: dict) -> None:
            async with gate:
                episode = asyncio.ensure_future(self.runner.episode(endpoint, session, row))
                episodes.append(episode)
                done, _ = await asyncio.wait({episode}, timeout=self.timeout_s)
                if not done:
                    episode.cancel()  # a program's process group is killed before the cancel completes
                    stopping.add(episode)
                    await asyncio.wait({episode})  # not gather: cancelled itself, it would cancel the cleanup
                    raise UserError(f"{self.runner.describe()} did not finish session {session} (row {row_text(row)}) "
                                    f"within rollout.agent.episode_timeout_s={self.timeout_s:g} s: it was stopped; "
                                    "make the episode end sooner or raise the timeout")
                episode.result()

        tasks = [asyncio.ensure_future(one(s, r)) for s, r in zip(sessions, rows)]
        try:
            await asyncio.gather(*tasks)
        finally:  # the first failure ends the step: every other episode is stopped and waited for
            for task in [*tasks, *episodes]:
                if task not in stopping:
                    task.cancel()
            await asyncio.gather(*tasks, *episodes, return_exceptions=True)

    def _collect(self, endpoint: RolloutEndpoint, session: str, row: dict) -> tuple[Trajectory, EpisodeRecord]:
        trajectories, reward = endpoint.collect(session, wait_s=0.0)
        if not trajectories:
            raise UserError(f"{self.runner.describe()} made no model call in session {session} (row {row_text(row)}): "
                            "an episode calls POST <base_url>/chat/completions (or /completions) at least once")
        kept = next((t for t in trajectories if t.reward_inputs["info"].get("holds_last_call")), trajectories[-1])
        info = dict(kept.reward_inputs["info"])
        info["dropped_trajectories"] = len(trajectories) - 1
        record = EpisodeRecord(reward=reward, info=info, end="length" if kept.finish_reason == "length" else "done",
                               prefix_breaks=int(info.get("prefix_breaks", 0)))
        return kept, record


def row_text(row: Any, limit: int = 120) -> str:
    """A row, short, for an error message."""
    text = json.dumps(row, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def program_command(spec: str) -> list[str]:
    """``rollout.agent.program`` as an argument list (shell words, no shell); a first word ending in ``.py``
    runs with this interpreter."""
    try:
        words = shlex.split(spec)
    except ValueError as error:
        raise UserError(f"rollout.agent.program={spec!r} is not a command line: {error}") from None
    if not words:
        raise UserError("rollout.agent.program is empty: give the agent program's command line")
    if words[0].endswith(".py"):
        if not Path(words[0]).is_file():
            raise UserError(f"rollout.agent.program={spec!r}: file {words[0]} not found")
        words = [sys.executable, *words]
    return words


class ProgramRunner:
    """Runs the agent program once per episode, in a process group of its own, stdin closed. It finds its
    session in the variables the ``openai`` client reads itself (``OPENAI_BASE_URL``, ``OPENAI_API_KEY``),
    the row in ``SCALERL_ROW`` (JSON; ``SCALERL_SESSION_ID``, ``SCALERL_MODEL`` beside it) and posts its
    reward to ``SCALERL_REWARD_URL`` (``{"reward": x}``, the token as bearer); without one the run's reward
    function scores the trajectory."""

    def __init__(self, spec: str):
        self.spec, self.command = spec, program_command(spec)

    def describe(self) -> str:
        return f"rollout.agent.program {self.spec!r}"

    async def episode(self, endpoint: RolloutEndpoint, session: str, row: dict) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": endpoint.base_url(session), "OPENAI_API_KEY": endpoint.token,
               "SCALERL_SESSION_ID": session, "SCALERL_MODEL": endpoint.model_name,
               "SCALERL_ROW": json.dumps(row, ensure_ascii=False, default=str),
               "SCALERL_REWARD_URL": f"{endpoint.url}/sessions/{session}/reward"}
        try:
            process = await asyncio.create_subprocess_exec(
                *self.command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=True)
        except OSError as error:  # not found, not executable
            raise UserError(f"{self.describe()} could not be started ({self.command[0]}): {error}") from None
        try:
            _, stderr = await process.communicate()
        finally:
            if process.returncode is None:  # cancelled (a timeout, another episode's failure): the whole group goes
                kill_group(process.pid)
                close_transport(process)  # before any await, so that a second cancel cannot skip it
                try:  # SIGKILL ends it at once; only a process stuck in the kernel outlives the limit
                    await asyncio.wait_for(process.wait(), REAP_LIMIT_S)
                except asyncio.TimeoutError:
                    pass  # reaped by asyncio's child watcher whenever it does end
            close_transport(process)
        if process.returncode != 0:
            tail = stderr.decode("utf-8", "replace")[-STDERR_TAIL_CHARS:].strip()
            raise UserError(f"{self.describe()} exited with status {process.returncode} in session {session} (row "
                            f"{row_text(row)}); its stderr ends:\n{tail or '(empty)'}")


def close_transport(process: asyncio.subprocess.Process) -> None:
    """Close the process's transport on the loop that owns it: left to its exit callbacks, which the step's loop
    may end before running, it would be closed at garbage collection, into a closed loop."""
    transport = getattr(process, "_transport", None)
    if transport is not None:
        transport.close()


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (the program and anything it started)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def endpoint_episodes(engine: Any, tokenizer: Any, agent_cfg: Any) -> EndpointEpisodes:
    """The episodes ``rollout.agent`` asks for: ``env=program`` or ``env=verifiers``."""
    if agent_cfg.env == "program":
        runner: Any = ProgramRunner(agent_cfg.program)
    else:
        from scalerl.rollout.agent.verifiers_env import VerifiersRunner

        runner = VerifiersRunner(agent_cfg.verifiers_env, agent_cfg.verifiers_env_args)
    return EndpointEpisodes(engine, tokenizer, runner, tool_parser=agent_cfg.tool_parser,
                            timeout_s=agent_cfg.episode_timeout_s, concurrency=agent_cfg.max_concurrent_episodes)


__all__ = ["EndpointEpisodes", "ProgramRunner", "endpoint_episodes", "program_command"]
