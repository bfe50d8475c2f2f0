"""The agent loop: multi-turn episodes against environments, one coroutine per trajectory, on a
continuous-batching engine, producing token-exact trajectories.

Each trajectory is a coroutine: render the environment's first messages (`ChatContinuity.prompt`), ask the
engine for a turn, hand the decoded assistant message to the environment, append the tokens of its answer
(`ChatContinuity.continuation`: a delta, never a re-render) and go on until the environment is done, or a
limit is hit: ``max_turns``, the trajectory's token budget (``max_total_tokens``, prompt included; a turn
is given at most what is left of it). The engine is driven by one pump (`EnginePump`): requests from every
trajectory go into the continuous engine as they come, and its decode steps run in a worker thread, so while
one trajectory waits for a slow tool the others keep decoding; an environment's plain methods run in
threads too. A request's random draws are its own (seeded by the step, the trajectory's row and the
turn), so a trajectory samples the same whatever the others do and however long their tools take.

One failing episode does not fail the batch: an environment that raises ends its trajectory, with the
class, the method and the turn in ``info["error"]`` (counted as ``agent/env_errors``); the run goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from scalerl.rollout.agent.chat_delta import ChatContinuity
from scalerl.rollout.agent.environment import EnvStep, as_env_step, call_env
from scalerl.rollout.engines.continuous import GenerationRequest, RequestOutput
from scalerl.rollout.engines.engine import PromptTooLongError, SamplingParams
from scalerl.rollout.trajectory import Trajectory, TrajectorySegment


@dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 4
    max_total_tokens: int = 1024  # prompt + every turn + every environment answer
    env_timeout_s: float = 300.0  # one reset or step of the environment (its tools included), at most


@dataclass
class EpisodeRecord:
    """What one episode did besides its tokens: the environment's last reward and info, how it ended."""

    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    end: str = "done"  # done | max_turns | budget | length | env_error
    prefix_breaks: int = 0
    env_s: float = 0.0  # seconds in the environment's step (tools included)


def turn_seed(seed: int | None, turn: int) -> int | None:
    """A turn's sampling seed: the step's for the first turn (a one-turn episode samples what a single-turn
    rollout does), one of its own, fixed by the turn, after."""
    if seed is None or turn == 0:
        return seed
    return (seed * 1_000_003 + turn) % 2**63


def generated_segment(ids: list[int], out: RequestOutput) -> TrajectorySegment:
    """A turn's engine tokens as a trained segment: its log-probs and the policy version that sampled it (per
    token where a weight push landed mid-turn, a streaming worker's partial rollout)."""
    versions = out.weight_versions.tolist()
    return TrajectorySegment(ids, True, out.logprobs.tolist(), int(versions[-1]) if ids else -1,
                             versions if len(set(versions)) > 1 else None)


class EnginePump:
    """Feeds one continuous engine from many coroutines: ``await generate(prompt, sampling)`` queues a request;
    the pump submits what is queued between decode steps and runs each ``step()`` in a worker thread."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.queued: list[tuple[GenerationRequest, asyncio.Future]] = []
        self.waiting: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.released: list[int] = []  # kept prefixes to drop at the next step
        # The engine's steps run in a thread of their own, never queued behind environments' blocked calls.
        self.stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scalerl-agent-engine")
        self.wake = asyncio.Event()
        self.closed = False

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, keep_kv: bool = False,
                       reuse_from: int | None = None) -> RequestOutput:
        """The request's output; ``keep_kv`` / ``reuse_from``: prefix reuse across a conversation's turns (the
        engine keeps this request's keys and values / prefills only what follows the named request's tokens)."""
        future = asyncio.get_running_loop().create_future()
        request = GenerationRequest(self.next_id, prompt_ids, sampling, keep_kv=keep_kv, reuse_from=reuse_from)
        self.queued.append((request, future))
        self.next_id += 1
        self.wake.set()
        return await future

    def release(self, request_id: int | None) -> None:
        """A conversation ended: the keys and values its last turn kept go (between two steps)."""
        if request_id is not None:
            self.released.append(request_id)

    async def run(self) -> None:
        try:
            await self._run()
        except BaseException as error:  # the engine failed: every trajectory waiting on it hears so, none hangs
            for future in [*self.waiting.values(), *(f for _, f in self.queued)]:
                if not future.done():
                    future.set_exception(error)
            raise

    async def _run(self) -> None:
        while not self.closed:
            for request, future in self.queued:  # only here, between steps: the engine is not thread-safe
                if future.cancelled():  # its caller gave up before it was submitted
                    continue
                try:
                    self.engine.submit(request)
                    self.waiting[request.request_id] = future
                except Exception as error:  # a prompt too long for the engine ends that trajectory only
                    future.set_exception(error)
            self.queued.clear()
            if self.released and hasattr(self.engine, "release"):
                self.engine.release(self.released)
            self.released = []
            gone = [i for i, future in self.waiting.items() if future.cancelled()]
            if gone:  # callers that gave up (a client that disconnected): their rows are freed
                self.engine.abort(gone)
                for i in gone:
                    del self.waiting[i]
            if not self.engine.has_unfinished():
                self.wake.clear()
                await self.wake.wait()
                continue
            for out in await asyncio.get_running_loop().run_in_executor(self.stepper, self.engine.step):
                future = self.waiting.pop(out.request_id, None)
                if future is not None and not future.done():  # done: cancelled during the step
                    future.set_result(out)

    def close(self) -> None:
        self.closed = True
        self.wake.set()
        self.stepper.shutdown(wait=False)


class AgentLoop:
    """Episodes of ``make_env()`` environments for a batch of rows on ``engine`` (a `ContinuousEngine`),
    rendered through ``tokenizer``'s chat template."""

    def __init__(self, engine: Any, tokenizer: Any, make_env: Callable[[], Any], limits: AgentLimits,
                 template_kwargs: dict[str, Any] | None = None):
        self.engine, self.tokenizer, self.make_env, self.limits = engine, tokenizer, make_env, limits
        self.template_kwargs = template_kwargs or {}

    def run(self, rows: list[dict], sampling: SamplingParams, row_offset: int = 0,
            total_rows: int | None = None) -> tuple[list[Trajectory], list[EpisodeRecord]]:
        """One trajectory per row (``rows`` already holds each prompt ``n`` times); trajectory ``i``'s turn
        ``k`` samples with ``sampling``'s seed at global row ``row_offset + i`` of ``total_rows``, a seed per
        turn."""
        # Not asyncio.run: at exit it waits for every worker thread, and a plain tool past its timeout still
        # holds one (a thread cannot be killed); that thread is abandoned here instead of stalling the step.
        loop = asyncio.new_event_loop()
        # Threads for the environments' plain calls, at least two per trajectory (a step, and a tool of it):
        # the default pool (cpu count + 4) let a few environments blocked in slow steps hold every thread and
        # the others wait for one. (The engine's steps have a thread of their own: `EnginePump`.)
        executor = ThreadPoolExecutor(max_workers=max(2 * len(rows), 32), thread_name_prefix="scalerl-agent")
        loop.set_default_executor(executor)
        try:
            return loop.run_until_complete(self._run(rows, sampling, row_offset, total_rows or len(rows)))
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            loop.close()

    async def _run(self, rows, sampling, row_offset, total_rows):
        pump = EnginePump(self.engine)
        pumping = asyncio.create_task(pump.run())
        try:
            done = await asyncio.gather(*(self._episode(pump, row, i, sampling, row_offset, total_rows)
                                          for i, row in enumerate(rows)))
        finally:
            pump.close()
            await pumping
        return [t for t, _ in done], [r for _, r in done]

    async def _episode(self, pump: EnginePump, row: dict, index: int, sampling: SamplingParams, row_offset: int,
                       total_rows: int) -> tuple[Trajectory, EpisodeRecord]:
        env = self.make_env()
        if drives_generation(env):
            return await self._token_episode(env, pump, row, index, sampling, row_offset, total_rows)
        record, turn = EpisodeRecord(), 0
        previous: int | None = None  # the last turn's request: its kept keys and values prefix the next turn
        segments: list[TrajectorySegment] = []
        finish, prompt = "stop", [self.tokenizer.eos_token_id]  # the prompt stands in if reset fails
        try:
            try:
                reset = await asyncio.wait_for(call_env(env, "reset", row), self.limits.env_timeout_s)
                messages, tools = reset if isinstance(reset, tuple) else (reset, None)
                continuity = ChatContinuity(self.tokenizer, tools, **self.template_kwargs)
                prompt = continuity.prompt(messages)
            except Exception as error:  # the user's environment (or its first messages) failed: this one only
                record.end = "env_error"
                record.info["error"] = f"{type(env).__name__}.reset raised: {type(error).__name__}: {error}"
                return self._finished(prompt, segments, finish, row, record)
            context = list(prompt)
            while True:
                left = self.limits.max_total_tokens - len(context)
                if left <= 0:
                    record.end = "budget"
                    break
                turn_sampling = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, left),
                                        seed=turn_seed(sampling.seed, turn),
                                        row_offset=row_offset + index, total_rows=total_rows)
                try:  # each turn keeps its keys and values; the next prefills only what follows them
                    out = await pump.generate(context, turn_sampling, keep_kv=True, reuse_from=previous)
                except PromptTooLongError:  # the conversation outgrew the engine's window: ended, as a budget
                    record.end = "budget"
                    break
                previous = out.request_id
                ids = out.token_ids.tolist()
                segments.append(generated_segment(ids, out))
                context += ids
                finish, turn = out.finish_reason, turn + 1
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                began = time.perf_counter()
                try:
                    step: EnvStep = as_env_step(await asyncio.wait_for(
                        call_env(env, "step", {"role": "assistant", "content": text}), self.limits.env_timeout_s))
                except Exception as error:
                    record.end, record.info["error"] = "env_error", (
                        f"{type(env).__name__}.step raised at turn {turn}: {type(error).__name__}: {error}")
                    break
                finally:
                    record.env_s += time.perf_counter() - began
                record.reward, record.info = step.reward, {**record.info, **step.info}
                if step.done or not step.messages:
                    record.end = "done"
                    break
                if turn >= self.limits.max_turns:
                    record.end = "max_turns"
                    break
                delta = continuity.continuation(step.messages, ids[-1] if ids else None)
                record.prefix_breaks += int(not delta.bridged)
                if len(context) + len(delta.token_ids) >= self.limits.max_total_tokens:
                    record.end = "budget"  # no room for the answer and a turn after it
                    break
                segments.append(TrajectorySegment(delta.token_ids, False))
                context += delta.token_ids
        finally:
            pump.release(previous)
            if record.end != "env_error" and callable(getattr(env, "episode_reward", None)):
                await self._episode_reward(env, record)
            await self._close(env, record)
        return self._finished(prompt, segments, finish, row, record)

    @staticmethod
    async def _close(env: Any, record: EpisodeRecord) -> None:
        """``env.close()`` where it has one; a raise is recorded in the episode's info, not the run's problem."""
        if getattr(env, "close", None) is None:
            return
        try:
            await call_env(env, "close")
        except Exception as error:
            record.info.setdefault("error", f"{type(env).__name__}.close raised: {error}")

    async def _episode_reward(self, env: Any, record: EpisodeRecord) -> None:
        """The environment's own score of the whole episode, read once it is over whatever ended it (TRL's
        ``get_reward``, verl's ``calc_reward``): a number replaces the last step's reward, None leaves it."""
        try:
            reward = await asyncio.wait_for(call_env(env, "episode_reward"), self.limits.env_timeout_s)
            if reward is not None:
                record.reward = float(reward)
        except Exception as error:  # noqa: BLE001 - the user's scoring failed: this episode's error, not the run's
            record.end, record.info["error"] = "env_error", (
                f"{type(env).__name__}.episode_reward raised: {type(error).__name__}: {error}")

    async def _token_episode(self, env: Any, pump: EnginePump, row: dict, index: int, sampling: SamplingParams,
                             row_offset: int, total_rows: int) -> tuple[Trajectory, EpisodeRecord]:
        """The escape hatch: ``env.run(generate, row)`` drives generation itself at the token level and returns a
        `TokenEpisode`. Its generated segments must be the very segments ``generate`` returned, each sampled on
        exactly the tokens before it in the episode, so the trajectory is what the engine saw and sampled."""
        record, calls = EpisodeRecord(), []  # calls: (prompt ids, the segment generate returned)
        finishes: dict[int, str] = {}  # id(segment) -> the engine's finish reason
        last: list[int | None] = [None]  # the last call's request id

        async def generate(prompt_ids: list[int], max_new_tokens: int | None = None,
                           stop_token_ids: tuple[int, ...] = ()) -> TrajectorySegment:
            """``stop_token_ids``: stops of this turn besides the run's (a verl tool parser's end of a call)."""
            if len(calls) >= self.limits.max_turns:
                raise EpisodeLimit(f"generate called {len(calls) + 1} times; rollout.agent.max_turns is "
                                   f"{self.limits.max_turns}")
            left = self.limits.max_total_tokens - len(prompt_ids)
            if left <= 0:
                raise EpisodeLimit(f"a prompt of {len(prompt_ids)} tokens leaves nothing of "
                                   f"rollout.agent.max_total_tokens={self.limits.max_total_tokens}")
            wanted = min(sampling.max_new_tokens, left, max_new_tokens or sampling.max_new_tokens)
            out = await pump.generate(list(prompt_ids), replace(
                sampling, max_new_tokens=wanted, seed=turn_seed(sampling.seed, len(calls)),
                row_offset=row_offset + index, total_rows=total_rows,
                stop_token_ids=tuple(dict.fromkeys([*sampling.stop_token_ids, *stop_token_ids]))),
                keep_kv=True, reuse_from=last[0])
            last[0] = out.request_id  # a prompt that extends this call's reuses its keys and values
            ids = out.token_ids.tolist()
            segment = generated_segment(ids, out)
            calls.append((list(prompt_ids), segment))
            finishes[id(segment)] = out.finish_reason
            return segment

        prompt: list[int] = [self.tokenizer.eos_token_id]
        segments: list[TrajectorySegment] = []
        finish = "stop"
        try:
            if not inspect.iscoroutinefunction(env.run):
                raise TypeError("run must be an async def: it awaits generate(prompt_ids) for each turn")
            episode = await call_env(env, "run", generate, row)
            if not isinstance(episode, TokenEpisode):
                raise TypeError(f"run returned {type(episode).__name__}; return a TokenEpisode(prompt_ids, segments)")
            prompt, segments = list(episode.prompt_ids), [
                s if isinstance(s, TrajectorySegment) else TrajectorySegment(list(s), False) for s in episode.segments]
            check_token_episode(prompt, segments, calls)
            record.reward, record.info = episode.reward, dict(episode.info)
            generated = [s for s in segments if s.generated]
            finish = finishes[id(generated[-1])] if generated else "stop"
        except EpisodeLimit as error:  # ended at the limit: the calls so far, as long as each extends the last
            record.end, record.info["error"] = "max_turns", str(error)
            if calls:
                prompt, segments = calls_as_trajectory(calls)
        except Exception as error:  # the user's run failed or returned a trajectory the engine did not produce
            record.end, record.info["error"] = "env_error", (
                f"{type(env).__name__}.run raised: {type(error).__name__}: {error}")
            segments = []
        finally:
            pump.release(last[0])
            await self._close(env, record)
        return self._finished(prompt, segments, finish, row, record)

    def _finished(self, prompt: list[int], segments: list[TrajectorySegment], finish: str, row: dict,
                  record: EpisodeRecord) -> tuple[Trajectory, EpisodeRecord]:
        if not segments:  # nothing generated (an environment that failed at reset): an empty turn, untrained
            segments.append(TrajectorySegment([self.tokenizer.eos_token_id], False))
        if record.end in ("budget", "max_turns"):
            finish = "length"
        return Trajectory(list(prompt), segments, finish, {"row": row, "env_reward": record.reward,
                                                           "info": record.info}), record


class EpisodeLimit(Exception):
    """A token-level episode asked past ``max_turns`` or ``max_total_tokens``: it ends there."""


@dataclass
class TokenEpisode:
    """What a token-level environment's ``run(generate, row)`` returns: the prompt's ids and the response's
    segments in order, each a segment ``generate`` returned (trained) or a list of token ids the
    environment added (context: tool results, user turns, template glue); its reward (None: the run's
    reward function scores the decoded trajectory) and anything to log."""

    prompt_ids: list[int]
    segments: list[Any]
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)


def drives_generation(env: Any) -> bool:
    """A token-level environment: ``run(generate, row)`` and no message-level ``step``."""
    return callable(getattr(env, "run", None)) and not callable(getattr(env, "step", None))


def check_token_episode(prompt: list[int], segments: list[TrajectorySegment],
                        calls: list[tuple[list[int], TrajectorySegment]]) -> None:
    """Token exactness of a token-level episode: its generated segments are the segments ``generate`` returned,
    in order, none twice or left out, and each was sampled on exactly the prompt + the segments before it."""
    generated = [s for s in segments if s.generated]
    returned = [segment for _, segment in calls]
    if len(generated) != len(returned) or any(a is not b for a, b in zip(generated, returned)):
        raise ValueError(f"its trajectory holds {len(generated)} generated segment(s) where generate returned "
                         f"{len(returned)}; put each segment generate returned in the trajectory, in order, and "
                         "give other tokens as plain id lists")
    context, k = list(prompt), 0
    for segment in segments:
        if segment.generated:
            sampled_on = calls[k][0]
            if sampled_on != context:
                at = next((i for i, (a, b) in enumerate(zip(sampled_on, context)) if a != b),
                          min(len(sampled_on), len(context)))
                raise ValueError(f"generate call {k + 1} was given a prompt of {len(sampled_on)} tokens that differs "
                                 f"from the trajectory before its segment ({len(context)} tokens) at token {at}: "
                                 "train on what the engine saw, i.e. prompt each turn with the trajectory so far")
            k += 1
        context += segment.token_ids


def calls_as_trajectory(calls: list[tuple[list[int], TrajectorySegment]]) -> tuple[list[int], list[TrajectorySegment]]:
    """The trajectory a token-level episode's ``generate`` calls make, where each call's prompt extends the
    previous call's prompt and completion (what came between is context); it stops at the first that does not."""
    prompt, segments = calls[0][0], [calls[0][1]]
    context = prompt + calls[0][1].token_ids
    for sampled_on, segment in calls[1:]:
        if sampled_on[: len(context)] != context:
            break
        if len(sampled_on) > len(context):
            segments.append(TrajectorySegment(sampled_on[len(context):], False))
        segments.append(segment)
        context = sampled_on + segment.token_ids
    return prompt, segments


def agent_metrics(records: list[EpisodeRecord], trajectories: list[Trajectory], step_s: float) -> dict[str, float]:
    """``agent/*`` metrics of one batch of episodes (per rank; reduced over ranks by the trainer)."""
    turns = torch.tensor([float(t.num_turns) for t in trajectories])
    generated = sum(len(s.token_ids) for t in trajectories for s in t.segments if s.generated)
    other = sum(len(s.token_ids) for t in trajectories for s in t.segments if not s.generated)
    info = [r.info for r in records]
    per_tool: dict[str, list[float]] = {}  # name -> [seconds, calls] over the batch's episodes
    for i in info:
        for name, (seconds, calls) in i.get("tool_s_by_name", {}).items():
            total = per_tool.setdefault(name, [0.0, 0])
            total[0], total[1] = total[0] + seconds, total[1] + calls
    return {
        **{f"agent/tool_s/{name}": seconds / max(calls, 1) for name, (seconds, calls) in sorted(per_tool.items())},
        "agent/turns/mean": float(turns.mean()), "agent/turns/max": float(turns.max()),
        "agent/tool_calls": float(sum(i.get("tool_calls", 0) for i in info)),
        "agent/tool_errors": float(sum(i.get("tool_errors", 0) for i in info)),
        "agent/tool_timeouts": float(sum(i.get("tool_timeouts", 0) for i in info)),
        "agent/env_errors": float(sum(r.end == "env_error" for r in records)),
        "agent/truncated": float(sum(r.end in ("budget", "max_turns") for r in records)),
        "agent/prefix_breaks": float(sum(r.prefix_breaks for r in records)),
        "agent/generated_tokens": float(generated), "agent/environment_tokens": float(other),
        "agent/env_time_share": sum(r.env_s for r in records) / max(step_s * len(records), 1e-9),
    }
