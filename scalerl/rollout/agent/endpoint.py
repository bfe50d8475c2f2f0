"""A rollout endpoint: any agent program that speaks the OpenAI chat API drives scalerl's continuous engine
through it, and every call's exact token ids are recorded and stitched into trajectories to train on.

The agent program changes two things: ``base_url`` (one per episode, the *session*:
``http://127.0.0.1:PORT/sessions/<id>/v1``) and ``api_key`` (the endpoint's bearer token). It calls
``POST /v1/chat/completions`` or ``POST /v1/completions`` (non-streaming) and ``GET /v1/models`` under that
base URL as it would OpenAI's or vLLM's. Each answer is OpenAI's JSON plus what vLLM returns with
``return_token_ids``: the prompt's ids (``prompt_token_ids``, at the root and on the choice), the sampled
ids (``choices[0].token_ids``) and their log-probs (``choices[0].logprobs``, OpenAI's shape). Token-level
clients (verifiers' train client) use vLLM's token-in route, ``POST /inference/v1/generate`` beside ``/v1``.
Inside a training run the endpoint is a rollout source: `endpoint_source` (``rollout.agent.env=program`` /
``verifiers``).

Token continuity: a chat call whose messages are an earlier call's messages, then the assistant message that
call returned (content and tool calls as returned), then new messages (tool results, a user turn) is not
rendered again: its prompt is that call's prompt + the ids it sampled + the new messages' tokens
(`ChatContinuity.continuation`), as the agent loop builds its turns. Any other call is rendered whole
through the chat template. A session's calls are stitched by ids: a call whose prompt starts with an
earlier call's prompt + completion (the longest such) continues that call's trajectory (the ids between are
one untrained segment, the sampled ids a trained one with their log-probs); a call that continues none
begins a new trajectory, and the break is counted (``info["prefix_breaks"]``).

Sessions: the trainer opens one per episode (`RolloutEndpoint.open_session`, or ``POST /sessions``), the
agent runs against its base URL, a reward is posted (``POST /sessions/<id>/reward {"reward": x}`` or
`set_reward`) and the session is collected (`collect`, or ``POST /sessions/<id>/close``, which answers the
trajectories as JSON); a collected session is gone, so nothing is recorded twice. A call whose client
disconnected before its answer was written is not recorded (its engine row is freed at once).

Generation runs on one `ContinuousEngine` fed by the agent loop's `EnginePump` in an event-loop thread;
requests come in on a `ThreadingHTTPServer` (one thread per connection). ``serve_rollouts_main`` is the
command line (``scalerl serve-rollouts``). See docs/agent-endpoint.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import math
import re
import secrets
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from scalerl.rollout.agent.chat_delta import ChatContinuity
from scalerl.rollout.agent.loop import EnginePump
from scalerl.rollout.agent.tool_calls import get_parser
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import Trajectory, TrajectorySegment

SESSION_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_SESSION_PATH = re.compile(r"^/sessions/([^/]+)(/.*)?$")
MAX_BODY_BYTES = 32 * 2**20


class EndpointError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def payload(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _ClientGone(Exception):
    """The client closed its connection before the answer: nothing is written and nothing recorded."""


@dataclass
class RecordedCall:
    """One call of a session as the engine ran it: the prompt's ids, the sampled ids with their log-probs and
    the weight version that sampled them, how it finished, and which endpoint took it."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: str
    kind: str  # "chat" | "completion" | "generate" (the token-in route)


@dataclass
class _ChatState:
    """A recorded chat call as the next call may continue it: its messages and the assistant message it
    returned (comparison keys), the settings it was rendered with, the ids so far."""

    keys: list[str]
    settings: str
    context: list[int]
    ended_with: int | None
    call: RecordedCall


@dataclass
class _Session:
    id: str
    index: int
    row: Any
    calls: list[RecordedCall] = field(default_factory=list)
    chat_states: list[_ChatState] = field(default_factory=list)
    reward: float | None = None
    in_flight: int = 0
    requests: int = 0  # calls begun, the per-call seed's counter
    template_breaks: int = 0  # continuations where the template rewrote the stand-in (chat_delta)


def stitch_calls(calls: list[RecordedCall]) -> tuple[list[Trajectory], list[int], int]:
    """A session's calls as trajectories: each call continues the trajectory whose ids so far (prompt +
    every segment) its prompt starts with, the longest such, with the ids between as an untrained segment;
    a call that continues none begins a trajectory. Returns (trajectories, calls per trajectory, breaks:
    calls after the first that began one)."""
    contexts: list[list[int]] = []
    trajectories: list[Trajectory] = []
    counts: list[int] = []
    breaks = 0
    for call in calls:
        prompt, best = call.prompt_ids, None
        for i, context in enumerate(contexts):
            if len(context) <= len(prompt) and prompt[: len(context)] == context and (
                    best is None or len(context) > len(contexts[best])):
                best = i
        if best is None:
            breaks += int(bool(trajectories))
            trajectories.append(Trajectory(list(prompt), []))
            contexts.append(list(prompt))
            counts.append(0)
            best = len(trajectories) - 1
        elif len(prompt) > len(contexts[best]):
            trajectories[best].segments.append(TrajectorySegment(list(prompt[len(contexts[best]):]), False))
        trajectories[best].segments.append(
            TrajectorySegment(list(call.token_ids), True, list(call.logprobs), call.weight_version))
        trajectories[best].finish_reason = call.finish_reason
        contexts[best] = list(prompt) + list(call.token_ids)
        counts[best] += 1
    return trajectories, counts, breaks


def trajectory_json(trajectory: Trajectory) -> dict:
    """A trajectory as JSON: its segments, and the response laid out with its loss mask (1 on sampled ids)."""
    return {
        "prompt_ids": trajectory.prompt_ids,
        "response_ids": trajectory.response_ids,
        "loss_mask": [int(s.generated) for s in trajectory.segments for _ in s.token_ids],
        "logprobs": [lp for s in trajectory.segments
                     for lp in (s.logprobs if s.generated else [0.0] * len(s.token_ids))],
        "segments": [{"token_ids": s.token_ids, "generated": s.generated, "logprobs": s.logprobs,
                      "weight_version": s.weight_version} for s in trajectory.segments],
        "finish_reason": trajectory.finish_reason,
        "info": {k: v for k, v in trajectory.reward_inputs.get("info", {}).items()},
    }


# ---------------------------------------------------------------------------------------------- messages
def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, None (""), or OpenAI's list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise EndpointError(400, f"{where}.content: only text parts are supported, got {str(part)[:80]}",
                                    param="messages")
        return "".join(parts)
    raise EndpointError(400, f"{where}.content must be a string or a list of text parts", param="messages")


def _tool_call(call: Any, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise EndpointError(400, f"{where}: a tool call needs function.name", param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's JSON string; templates read a mapping, as vLLM gives them
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as written
    return {"id": call.get("id"), "type": "function", "function": {"name": function["name"], "arguments": arguments}}


def _message(message: Any, index: int) -> dict:
    """A request message as the chat template reads it: role, content as text, tool calls with their
    arguments decoded, a tool message's ``tool_call_id`` / ``name``."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EndpointError(400, f"{where} must be an object with a string 'role'", param="messages")
    out = {"role": message["role"], "content": _text(message.get("content"), where)}
    if message.get("tool_calls"):
        if not isinstance(message["tool_calls"], list):
            raise EndpointError(400, f"{where}.tool_calls must be a list", param="messages")
        out["tool_calls"] = [_tool_call(c, where) for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


def _key(message: dict) -> str:
    """What identifies a message for continuing a conversation: role, content (an assistant's stripped),
    tool calls by name and arguments (not their ids), a tool message's call id and name."""
    content = message["content"].strip() if message["role"] == "assistant" else message["content"]
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls", [])]
    return json.dumps([message["role"], content, calls, message.get("tool_call_id"), message.get("name")],
                      sort_keys=True, ensure_ascii=False)


# ---------------------------------------------------------------------------------------------- HTTP
class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "scalerl-rollouts"
    timeout = 120  # an idle keep-alive connection is closed after this many seconds
    in_flight: _Session | None = None  # the session whose call this connection is running

    def setup(self) -> None:
        super().setup()
        self.server.endpoint._track(self, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.endpoint._track(self, False)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: an agent run makes many calls
        pass

    def do_GET(self) -> None:
        self.server.endpoint._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.endpoint._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server.endpoint._handle(self, "PUT")

    do_DELETE = do_PATCH = do_PUT

    def client_gone(self) -> bool:
        """Whether the client closed the connection (read end at EOF) while its request was running."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # `RolloutEndpoint.close` joins the connection threads, with a deadline
    allow_reuse_address = True


class RolloutEndpoint:
    """An OpenAI-compatible endpoint on ``engine`` (a `ContinuousEngine`, the endpoint's alone while it runs)
    rendering chats through ``tokenizer``'s template and recording token ids per session.

    ``sampling``: the defaults of what a request does not say (``max_new_tokens`` is ignored: a call gets at
    most the engine's ``max_new_tokens``, and what fits the model's positions); with ``fixed_sampling`` the
    request's temperature / top_p / top_k are ignored (the trainer's decide the log-probs). A request without
    a seed, on an endpoint whose ``sampling.seed`` is set, gets one of its own from that seed, the session and
    the call. ``auto_sessions``: a call to a session id not yet open opens it (the command line's default).
    ``on_close``: called with the JSON ``POST /sessions/<id>/close`` answers."""

    def __init__(self, engine: Any, tokenizer: Any, *, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, model_name: str = "scalerl", sampling: SamplingParams | None = None,
                 fixed_sampling: bool = False, tool_parser: str = "hermes",
                 template_kwargs: dict[str, Any] | None = None, auto_sessions: bool = False,
                 request_timeout_s: float = 600.0, max_body_bytes: int = MAX_BODY_BYTES,
                 on_close: Callable[[dict], None] | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.host, self.port = host, port
        self.token = token or secrets.token_urlsafe(24)
        self.model_name = model_name
        self.sampling = sampling or SamplingParams()
        self.fixed_sampling, self.auto_sessions = fixed_sampling, auto_sessions
        self.parser = get_parser(tool_parser)
        self.template_kwargs = dict(template_kwargs or {})
        self.request_timeout_s, self.max_body_bytes, self.on_close = request_timeout_s, max_body_bytes, on_close
        self.max_prompt_len = int(engine.max_prompt_len)
        self.max_new_tokens = int(engine.max_new_tokens)
        config = getattr(getattr(engine, "model", None), "config", None)
        self.max_positions = int(getattr(config, "max_position_embeddings", self.max_prompt_len + self.max_new_tokens))
        self.max_model_len = min(self.max_positions, self.max_prompt_len + self.max_new_tokens)
        self._lock = threading.Condition()
        self._sessions: dict[str, _Session] = {}
        self._opened = 0
        self._connections: dict[_Handler, threading.Thread] = {}
        self._closing = False
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump: EnginePump | None = None
        self._pump_error: BaseException | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> RolloutEndpoint:
        """Bind (port 0: a free one), start the engine's pump and the server; returns self."""
        if self._server is not None:
            raise RuntimeError("the endpoint is started already")
        self._server = _Server((self.host, self.port), _Handler)
        self._server.endpoint = self
        self.port = self._server.server_address[1]
        self._loop = asyncio.new_event_loop()
        self._pump = EnginePump(self.engine)
        self._threads = [threading.Thread(target=self._run_pump, name="scalerl-endpoint-pump", daemon=True),
                         threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                          name="scalerl-endpoint-http", daemon=True)]
        for thread in self._threads:
            thread.start()
        return self

    @property
    def url(self) -> str:
        """``http://HOST:PORT``; a session's OpenAI base URL is `base_url(session_id)`."""
        return f"http://{self.host}:{self.port}"

    def base_url(self, session_id: str) -> str:
        return f"{self.url}/sessions/{session_id}/v1"

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop serving: calls in flight are answered 503 and not recorded; the pump stops after its current
        engine step; every thread is joined for at most ``timeout_s`` in all (they are daemons past it)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()  # serve_forever polls every 0.1 s
        if self._loop is not None and self._pump is not None:
            try:
                self._loop.call_soon_threadsafe(self._pump.close)
            except RuntimeError:  # the loop has ended already (the engine failed)
                pass
        with self._lock:
            connections = dict(self._connections)
        for handler in connections:  # idle keep-alive readers wake up at EOF
            if handler.in_flight is not None:  # its EOF would read as the client gone: it is answered 503 instead
                continue
            try:
                handler.connection.shutdown(socket.SHUT_RD)
            except OSError:
                pass
        for thread in [*self._threads, *connections.values()]:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
        if self._server is not None:
            self._server.server_close()

    def __enter__(self) -> RolloutEndpoint:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run_pump(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        executor = ThreadPoolExecutor(1, thread_name_prefix="scalerl-endpoint-engine")
        loop.set_default_executor(executor)
        try:
            loop.run_until_complete(self._pump_main())
        except BaseException as error:  # the engine failed: calls in flight heard it from their futures
            self._pump_error = error
        finally:  # the pump has ended, so no engine step is running: its thread exits at once
            executor.shutdown(wait=True, cancel_futures=True)
            loop.close()

    async def _pump_main(self) -> None:
        try:
            await self._pump.run()
        finally:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

    def _track(self, handler: _Handler, add: bool) -> None:
        with self._lock:
            if add:
                self._connections[handler] = threading.current_thread()
            else:
                self._connections.pop(handler, None)

    # ------------------------------------------------------------------------------------------ sessions
    def open_session(self, row: Any = None, session_id: str | None = None) -> str:
        """A new session for one episode of ``row`` (handed back in each trajectory's reward inputs)."""
        session_id = session_id or secrets.token_hex(8)
        if not SESSION_ID.fullmatch(session_id):
            raise ValueError(f"session id {session_id!r}: use 1-128 letters, digits, '_', '.', '-'")
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is open already")
            self._sessions[session_id] = _Session(session_id, self._opened, row)
            self._opened += 1
        return session_id

    def set_reward(self, session_id: str, reward: float) -> None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"a reward is a finite number, got {reward!r}")
        with self._lock:
            self._session(session_id).reward = float(reward)

    def session_info(self, session_id: str) -> dict:
        """Calls recorded, calls in flight, the reward so far, breaks of the chain (prefix and template)."""
        with self._lock:
            s = self._session(session_id)
            calls = list(s.calls)
            info = {"session_id": s.id, "calls": len(calls), "in_flight": s.in_flight, "reward": s.reward,
                    "template_breaks": s.template_breaks}
        info["prefix_breaks"] = stitch_calls(calls)[2]
        return info

    def collect(self, session_id: str, wait_s: float = 30.0) -> tuple[list[Trajectory], float | None]:
        """Close the session and return its trajectories and reward. Calls in flight are waited for at most
        ``wait_s`` seconds; one that ends after is not recorded. A collected session is gone (KeyError)."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            session = self._session(session_id)
            while session.in_flight and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            del self._sessions[session_id]
        trajectories, counts, breaks = stitch_calls(session.calls)
        last = session.calls[-1] if session.calls else None
        for i, (t, n) in enumerate(zip(trajectories, counts)):
            ends_with_last = last is not None and t.prompt_ids + t.response_ids == last.prompt_ids + last.token_ids
            t.reward_inputs = {"row": session.row, "env_reward": session.reward, "info": {
                "session_id": session.id, "trajectory": i, "trajectories": len(trajectories), "calls": n,
                "prefix_breaks": breaks, "template_breaks": session.template_breaks,
                "holds_last_call": ends_with_last}}
        return trajectories, session.reward

    def _session(self, session_id: str, create: bool = False) -> _Session:
        """(under the lock) The open session, or (``create`` with ``auto_sessions``) one opened now; KeyError else."""
        session = self._sessions.get(session_id)
        if session is None:
            if not (create and self.auto_sessions and not self._closing and SESSION_ID.fullmatch(session_id)):
                raise KeyError(session_id)
            session = self._sessions[session_id] = _Session(session_id, self._opened, None)
            self._opened += 1
        return session

    # ------------------------------------------------------------------------------------------ requests
    def _handle(self, h: _Handler, method: str) -> None:
        status, payload, undo = 200, None, None
        h.in_flight = None
        try:
            try:
                self._authorize(h)
                path = h.path.split("?", 1)[0].rstrip("/") or "/"
                status, payload, undo = self._route(h, method, path)
            except EndpointError as error:
                status, payload = error.status, error.payload()
            except _ClientGone:
                h.close_connection = True
                return
            except Exception as error:  # a bug or an engine failure: the client hears it, the server goes on
                status, payload = 500, EndpointError(500, f"{type(error).__name__}: {error}",
                                                     "server_error").payload()
            if not self._send(h, status, payload) and undo is not None:
                undo()  # the answer did not reach the client: the call is not recorded
        finally:
            if h.in_flight is not None:
                with self._lock:
                    h.in_flight.in_flight -= 1
                    self._lock.notify_all()

    def _authorize(self, h: _Handler) -> None:
        given = h.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.token.encode()):
            h.close_connection = True  # the body is left unread
            raise EndpointError(401, "missing or wrong API key: send 'Authorization: Bearer <token>' with the "
                                "endpoint's token (printed at start; RolloutEndpoint.token)", code="invalid_api_key")

    def _body(self, h: _Handler) -> Any:
        try:
            length = int(h.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > self.max_body_bytes:
            h.close_connection = True
            raise EndpointError(413 if length > 0 else 400, f"request body of {length} bytes: at most "
                                f"{self.max_body_bytes} bytes, with a Content-Length")
        raw = h.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise EndpointError(400, f"the request body is not valid JSON: {error}") from None

    def _route(self, h: _Handler, method: str, path: str) -> tuple[int, dict, Callable[[], None] | None]:
        body = self._body(h) if method == "POST" else None
        if body is not None and not isinstance(body, dict):
            raise EndpointError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        if path == "/v1/models" or path == "/models":
            return self._only(method, "GET"), self._models(), None
        if path == "/sessions":
            self._only(method, "POST")
            try:
                session_id = self.open_session(body.get("row"), body.get("session_id"))
            except ValueError as error:
                raise EndpointError(400, str(error), param="session_id") from None
            return 200, {"session_id": session_id, "base_url": self.base_url(session_id)}, None
        if path.startswith("/v1/"):
            raise EndpointError(404, f"{path} needs a session: use base_url={self.url}/sessions/<id>/v1 (the trainer "
                                "opens sessions; POST /sessions opens one)", code="session_required")
        match = _SESSION_PATH.match(path)
        if not match:
            raise EndpointError(404, f"no route {method} {path}", "not_found_error")
        session_id, rest = match.group(1), match.group(2) or ""
        with self._lock:
            self._session_or_404(session_id)
        try:
            if rest == "":
                return self._only(method, "GET"), self.session_info(session_id), None
            if rest == "/reward":
                self._only(method, "POST")
                try:
                    self.set_reward(session_id, body.get("reward"))
                except ValueError as error:
                    raise EndpointError(400, str(error), param="reward") from None
                return 200, {"session_id": session_id, "reward": float(body["reward"])}, None
            if rest == "/close":
                self._only(method, "POST")
                trajectories, reward = self.collect(session_id)
                breaks = trajectories[0].reward_inputs["info"]["prefix_breaks"] if trajectories else 0
                payload = {"session_id": session_id, "reward": reward, "prefix_breaks": breaks,
                           "trajectories": [trajectory_json(t) for t in trajectories]}
                if self.on_close is not None:
                    self.on_close(payload)
                return 200, payload, None
        except KeyError:  # collected meanwhile
            raise EndpointError(404, f"unknown session {session_id!r} (never opened, or collected already)",
                                "not_found_error", code="session_not_found") from None
        if rest in ("/v1/models", "/models"):
            return self._only(method, "GET"), self._models(), None
        if rest in ("/v1/chat/completions", "/chat/completions"):
            self._only(method, "POST")
            return self._chat(h, session_id, body)
        if rest in ("/v1/completions", "/completions"):
            self._only(method, "POST")
            return self._completion(h, session_id, body)
        if rest == "/inference/v1/generate":
            self._only(method, "POST")
            return self._token_generate(h, session_id, body)
        raise EndpointError(404, f"no route {method} {path}", "not_found_error")

    @staticmethod
    def _only(method: str, allowed: str) -> int:
        if method != allowed:
            raise EndpointError(405, f"method {method} not allowed here (use {allowed})")
        return 200

    def _session_or_404(self, session_id: str) -> _Session:
        """(under the lock) The session, or the 404 a client sees for an unknown or collected one."""
        try:
            return self._session(session_id, create=True)
        except KeyError:
            raise EndpointError(404, f"unknown session {session_id!r} (never opened, or collected already)",
                                "not_found_error", code="session_not_found") from None

    def _models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "scalerl", "max_model_len": self.max_model_len}]}

    def _send(self, h: _Handler, status: int, payload: dict) -> bool:
        data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
        try:
            h.send_response(status)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(data)))
            if h.close_connection or self._closing:
                h.send_header("Connection", "close")
                h.close_connection = True
            h.end_headers()
            h.wfile.write(data)
            h.wfile.flush()
            return True
        except OSError:
            h.close_connection = True
            return False

    # ------------------------------------------------------------------------------------------ generation
    def _refuse_unsupported(self, body: dict) -> None:
        if body.get("stream"):
            raise EndpointError(400, "stream=true is not supported: this endpoint answers whole responses "
                                "(with their token ids); send stream=false", param="stream")
        n = body.get("n", 1)
        if n not in (None, 1):
            raise EndpointError(400, f"n={n}: one choice per call (make n calls; each is recorded)", param="n")
        if body.get("echo"):
            raise EndpointError(400, "echo=true is not supported (prompt_token_ids holds the prompt)", param="echo")
        response_format = body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
            raise EndpointError(400, f"response_format {response_format.get('type')!r} is not supported (no "
                                "constrained decoding); ask for the format in the prompt", param="response_format")

    def _sampling(self, body: dict, prompt_len: int, session: _Session, param: str) -> tuple[SamplingParams, list[str]]:
        if prompt_len > self.max_prompt_len or prompt_len >= self.max_positions:
            what = "messages" if param == "messages" else "prompt"
            raise EndpointError(400, f"This model's maximum context length is {self.max_model_len} tokens, and a "
                                f"prompt at most {min(self.max_prompt_len, self.max_positions - 1)}. However, your "
                                f"{what} resulted in {prompt_len} tokens. Please reduce the length of the {what}.",
                                param=param, code="context_length_exceeded")

        def number(name: str, default: Any, kind: type = float) -> Any:
            value = body.get(name)
            if value is None:
                return default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise EndpointError(400, f"{name} must be a{'n integer' if kind is int else ' number'}, got {value!r}",
                                    param=name)
            return kind(value)

        asked = number("max_completion_tokens", None, int)
        asked = number("max_tokens", None, int) if asked is None else asked
        if asked is not None and asked < 1:
            raise EndpointError(400, f"max_tokens must be >= 1, got {asked}", param="max_tokens")
        room = min(self.max_new_tokens, self.max_positions - prompt_len)
        default = self.sampling
        temperature, top_p, top_k = default.temperature, default.top_p, default.top_k
        if not self.fixed_sampling:
            temperature, top_p = number("temperature", temperature), number("top_p", top_p)
            top_k = number("top_k", top_k, int)
            top_k = 0 if top_k == -1 else top_k  # vLLM's "disabled"
        seed = number("seed", None, int)
        with self._lock:
            call_number, session.requests = session.requests, session.requests + 1
        if seed is None and default.seed is not None:
            seed = (default.seed * 1_000_003 + session.index * 65_537 + call_number) % 2**63
        extra = body.get("stop_token_ids") or []
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(extra, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in extra):
            raise EndpointError(400, "stop_token_ids must be a list of integers", param="stop_token_ids")
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise EndpointError(400, "stop must be a string or a list of non-empty strings", param="stop")
        try:
            sampling = SamplingParams(max_new_tokens=room if asked is None else min(asked, room),
                                      temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                      stop_token_ids=tuple(dict.fromkeys([*self.tokenizer.stop_token_ids, *extra])))
        except ValueError as error:
            raise EndpointError(400, str(error)) from None
        return sampling, stop

    def _generate(self, h: _Handler, session: _Session, prompt: list[int], sampling: SamplingParams,
                  param: str) -> Any:
        """Run one request on the engine through the pump; waits while watching the client and the endpoint."""
        if self._pump_error is not None or self._closing or self._loop is None:
            raise EndpointError(503, "the endpoint is not serving (stopped, or its engine failed: "
                                f"{self._pump_error!r})", "server_error")
        future = asyncio.run_coroutine_threadsafe(self._pump.generate(list(prompt), sampling), self._loop)
        deadline = time.monotonic() + self.request_timeout_s
        while True:
            try:
                return future.result(timeout=0.05)
            except FutureTimeout:
                pass
            except ValueError as error:  # the engine refused it (prompt / max_new_tokens past its limits)
                raise EndpointError(400, str(error), param=param, code="context_length_exceeded") from None
            except CancelledError:  # the pump stopped (the endpoint closing)
                raise EndpointError(503, "the endpoint stopped while this call was generating",
                                    "server_error") from None
            if self._closing or self._pump_error is not None:  # before the client: closing may end its reads
                future.cancel()
                raise EndpointError(503, "the endpoint stopped while this call was generating", "server_error")
            if h.client_gone():
                future.cancel()  # the pump aborts its row
                raise _ClientGone()
            if time.monotonic() > deadline:
                future.cancel()
                raise EndpointError(504, f"no answer from the engine within {self.request_timeout_s} s", "server_error")

    def _run_call(self, h: _Handler, session_id: str, body: dict, prompt: list[int], param: str,
                  kind: str) -> tuple[RecordedCall, list[str], str]:
        """Generate for ``prompt`` in the session: the recorded call (not yet committed), the stop strings,
        and the text (cut before a stop string, as vLLM answers it)."""
        with self._lock:
            session = self._session_or_404(session_id)
        sampling, stops = self._sampling(body, len(prompt), session, param)
        with self._lock:  # in flight until its answer is written (`_handle`): `collect` waits for it
            session.in_flight += 1
            h.in_flight = session
        out = self._generate(h, session, prompt, sampling, param)
        ids, logprobs, versions = out.token_ids.tolist(), out.logprobs.tolist(), out.weight_versions.tolist()
        finish, text = out.finish_reason, self.tokenizer.decode(ids, skip_special_tokens=True)
        if stops and any(s in text for s in stops):
            cut = self._stop_cut(ids, stops)
            ids, logprobs, versions, finish = ids[:cut], logprobs[:cut], versions[:cut], "stop"
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            text = text[: min(text.index(s) for s in stops if s in text)]
        call = RecordedCall(list(prompt), ids, logprobs, int(versions[-1]) if versions else -1, finish, kind)
        return call, stops, text

    def _stop_cut(self, ids: list[int], stops: list[str]) -> int:
        """The fewest leading ids whose text holds a stop string (decoded prefixes only grow)."""
        low, high = 1, len(ids)
        while low < high:
            mid = (low + high) // 2
            text = self.tokenizer.decode(ids[:mid], skip_special_tokens=True)
            if any(s in text for s in stops):
                high = mid
            else:
                low = mid + 1
        return high

    def _commit(self, h: _Handler, session_id: str, call: RecordedCall, state: _ChatState | None) -> Callable[[], None]:
        """Record the call unless its client left or the session was collected meanwhile; returns the undo
        for an answer that cannot be written."""
        if h.client_gone():
            raise _ClientGone()
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise EndpointError(404, f"session {session_id!r} was collected while this call was generating; "
                                    "the call is not recorded", "not_found_error", code="session_not_found")
            session.calls.append(call)
            if state is not None:
                session.chat_states.append(state)

        def undo() -> None:
            with self._lock:
                session.calls[:] = [c for c in session.calls if c is not call]
                session.chat_states[:] = [s for s in session.chat_states if s.call is not call]
        return undo

    def _logprob_tokens(self, ids: list[int], as_ids: bool) -> list[str]:
        if as_ids:
            return [f"token_id:{i}" for i in ids]
        return self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False) if ids else []

    def _chat(self, h: _Handler, session_id: str, body: dict) -> tuple[int, dict, Callable[[], None]]:
        self._refuse_unsupported(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "messages must be a non-empty list", param="messages")
        tools = body.get("tools") or None
        if tools is not None and not isinstance(tools, list):
            raise EndpointError(400, "tools must be a list", param="tools")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise EndpointError(400, f"tool_choice {tool_choice!r} is not supported (only 'auto' and 'none': no "
                                "constrained decoding)", param="tool_choice")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise EndpointError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
        normalized = [_message(m, i) for i, m in enumerate(messages)]
        keys = [_key(m) for m in normalized]
        settings = json.dumps([tools, kwargs], sort_keys=True, ensure_ascii=False)
        try:
            continuity = ChatContinuity(self.tokenizer, tools, **{**self.template_kwargs, **kwargs})
            with self._lock:
                states = list(self._session_or_404(session_id).chat_states)
            prompt = None
            for state in reversed(states):  # the latest call these messages continue, if any
                k = len(state.keys)
                if state.settings == settings and len(keys) > k and keys[:k] == state.keys:
                    delta = continuity.continuation(normalized[k:], state.ended_with)
                    prompt = state.context + delta.token_ids
                    if not delta.bridged:
                        with self._lock:
                            self._session_or_404(session_id).template_breaks += 1
                    break
            if prompt is None:
                prompt = continuity.prompt(normalized)
        except EndpointError:
            raise
        except Exception as error:  # the template or the tokenizer refused these messages
            raise EndpointError(400, f"the chat template could not render these messages: {type(error).__name__}: "
                                f"{error}", param="messages") from None
        call, _, text = self._run_call(h, session_id, body, prompt, "messages", "chat")
        calls = []
        content: str | None = text
        if tools and tool_choice != "none":
            parsed = self.parser.parse(text)
            if parsed.calls and not parsed.errors:
                calls = [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                          "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                         for c in parsed.calls]
                content = parsed.content or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        returned = _message(message, len(normalized))
        state = _ChatState(keys + [_key(returned)], settings, call.prompt_ids + call.token_ids,
                           call.token_ids[-1] if call.token_ids else None, call)
        undo = self._commit(h, session_id, call, state)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        tokens = self._logprob_tokens(call.token_ids, as_ids)
        choice = {
            "index": 0, "message": message,
            "finish_reason": "tool_calls" if calls else call.finish_reason,
            "logprobs": {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                                     for t, lp in zip(tokens, call.logprobs)]},
            "prompt_token_ids": call.prompt_ids, "token_ids": call.token_ids,
        }
        return 200, {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                     "created": int(time.time()), "model": body.get("model") or self.model_name, "choices": [choice],
                     "prompt_token_ids": call.prompt_ids, "weight_version": call.weight_version,
                     "usage": self._usage(call)}, undo

    def _completion(self, h: _Handler, session_id: str, body: dict) -> tuple[int, dict, Callable[[], None]]:
        self._refuse_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in OpenAI's list form
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except Exception as error:
                raise EndpointError(400, f"the prompt cannot be tokenized: {error}", param="prompt") from None
        elif isinstance(prompt, list) and prompt and all(
                isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            ids = list(prompt)
            vocab = getattr(self.tokenizer, "vocab_size", None)
            bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
            if bad:
                raise EndpointError(400, f"prompt token ids outside the vocabulary (size {vocab}): {bad[:5]}",
                                    param="prompt")
        else:
            raise EndpointError(400, "prompt must be a string or a list of token ids (one prompt per call)",
                                param="prompt")
        if not ids:
            raise EndpointError(400, "the prompt is empty", param="prompt")
        call, _, text = self._run_call(h, session_id, body, ids, "prompt", "completion")
        undo = self._commit(h, session_id, call, None)
        tokens = self._logprob_tokens(call.token_ids, bool(body.get("return_tokens_as_token_ids")))
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        choice = {"index": 0, "text": text, "finish_reason": call.finish_reason,
                  "logprobs": {"tokens": tokens, "token_logprobs": call.logprobs, "top_logprobs": None,
                               "text_offset": offsets},
                  "prompt_token_ids": call.prompt_ids, "token_ids": call.token_ids}
        return 200, {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion", "created": int(time.time()),
                     "model": body.get("model") or self.model_name, "choices": [choice],
                     "weight_version": call.weight_version, "usage": self._usage(call)}, undo

    def _token_generate(self, h: _Handler, session_id: str, body: dict) -> tuple[int, dict, Callable[[], None]]:
        """vLLM's token-in route, ``POST /inference/v1/generate`` (what verifiers' train client calls through
        ``renderers.client.generate``: it renders the chat itself and sends ``token_ids`` with
        ``sampling_params``); answered as vLLM does: ``prompt_token_ids``, and a choice with ``token_ids`` and
        ``logprobs.content[i] = {"token": "token_id:<id>", "logprob"}``."""
        ids = body.get("token_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
            raise EndpointError(400, "token_ids must be a non-empty list of token ids", param="token_ids")
        vocab = getattr(self.tokenizer, "vocab_size", None)
        bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
        if bad:
            raise EndpointError(400, f"token ids outside the vocabulary (size {vocab}): {bad[:5]}", param="token_ids")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise EndpointError(400, "sampling_params must be an object", param="sampling_params")
        self._refuse_unsupported(params)
        call, _, text = self._run_call(h, session_id, params, list(ids), "token_ids", "generate")
        undo = self._commit(h, session_id, call, None)
        choice = {"index": 0, "text": text, "token_ids": call.token_ids, "finish_reason": call.finish_reason,
                  "logprobs": {"content": [{"token": f"token_id:{i}", "logprob": lp}
                                           for i, lp in zip(call.token_ids, call.logprobs)]}}
        return 200, {"request_id": f"gen-{secrets.token_hex(12)}", "model": body.get("model") or self.model_name,
                     "prompt_token_ids": call.prompt_ids, "choices": [choice], "weight_version": call.weight_version,
                     "usage": self._usage(call)}, undo

    @staticmethod
    def _usage(call: RecordedCall) -> dict:
        return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.token_ids),
                "total_tokens": len(call.prompt_ids) + len(call.token_ids)}


# ---------------------------------------------------------------------------------------------- command line
def serve_rollouts_main(argv: list[str] | None = None) -> int:
    """``scalerl serve-rollouts``: serve a model directory (or the built-in tiny model) as a rollout endpoint
    until Ctrl-C / SIGTERM; prints the URL and the token."""
    parser = argparse.ArgumentParser(
        prog="scalerl serve-rollouts",
        description="Serve a model as an OpenAI-compatible rollout endpoint that records token ids per session.")
    parser.add_argument("--model", default=None, help="Hugging Face model directory (default: the built-in tiny "
                        "model, randomly initialised: for trying the endpoint out)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    parser.add_argument("--token", default=None, help="the bearer token clients send as api_key (default: generated)")
    parser.add_argument("--model-name", default=None, help="the model id /v1/models lists (default: the directory "
                        "name, or 'scalerl-builtin')")
    parser.add_argument("--max-prompt-len", type=int, default=2048, help="longest prompt, in tokens (a multi-turn "
                        "call's prompt holds the whole conversation so far)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="most tokens one call generates")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="calls decoding at once")
    parser.add_argument("--temperature", type=float, default=1.0, help="default temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="default top_p")
    parser.add_argument("--top-k", type=int, default=0, help="default top_k (0: off)")
    parser.add_argument("--fixed-sampling", action="store_true", help="ignore the requests' temperature/top_p/top_k")
    parser.add_argument("--seed", type=int, default=None, help="seed: calls without one get their own from it")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", help="model dtype: float32 | bfloat16 | float16")
    parser.add_argument("--tool-parser", default="hermes", help="tool-call format of the model's output")
    parser.add_argument("--strict-sessions", action="store_true", help="refuse session ids not opened first with "
                        "POST /sessions (default: a new id opens a session)")
    parser.add_argument("--record", default=None, help="append each closed session (POST /sessions/<id>/close) to "
                        "this JSONL file")
    args = parser.parse_args(argv)

    import torch

    from scalerl.core.config import load_config
    from scalerl.models.load import load_model_and_tokenizer
    from scalerl.rollout.engines.builtin import BuiltinEngine

    overrides = [f"model.dtype={args.dtype}"]
    if args.model:
        overrides.append(f"model.path={args.model}")
    if args.tokenizer:
        overrides.append(f"model.tokenizer={args.tokenizer}")
    cfg = load_config(None, overrides)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    model, tokenizer = load_model_and_tokenizer(cfg.model, None, device, seed=args.seed or 0)
    model.eval()
    positions = model.config.max_position_embeddings
    max_new = max(1, min(args.max_new_tokens, positions - 1))
    max_prompt = max(1, min(args.max_prompt_len, positions - 1))
    engine = BuiltinEngine(model, tokenizer.pad_token_id).continuous_engine(max_prompt, max_new,
                                                                            max_num_seqs=args.max_num_seqs)
    name = args.model_name or (args.model.rstrip("/").rsplit("/", 1)[-1] if args.model else "scalerl-builtin")
    record_lock = threading.Lock()

    def record(payload: dict) -> None:
        with record_lock, open(args.record, "a", encoding="utf-8") as f:
            f.write(json.dumps(payload, ensure_ascii=False) + "\n")

    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    endpoint = RolloutEndpoint(engine, tokenizer, host=args.host, port=args.port, token=args.token, model_name=name,
                               sampling=sampling, fixed_sampling=args.fixed_sampling, tool_parser=args.tool_parser,
                               auto_sessions=not args.strict_sessions, on_close=record if args.record else None)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(signum, lambda *_: stop.set())
        except ValueError:  # not the main thread: Ctrl-C is not ours to take
            pass
    endpoint.start()
    try:
        print(f"scalerl rollout endpoint: model {name} on {device}, prompts up to {max_prompt} tokens, "
              f"{max_new} new tokens per call", flush=True)
        print(f"url: {endpoint.url}", flush=True)
        print(f"token: {endpoint.token}", flush=True)
        print(f"an episode: POST {endpoint.url}/sessions (or pick an id), then OpenAI(base_url="
              f"'{endpoint.url}/sessions/<id>/v1', api_key=<token>); POST /sessions/<id>/reward {{\"reward\": x}}; "
              "POST /sessions/<id>/close returns its trajectories. Ctrl-C stops.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        endpoint.close()
    return 0


__all__ = ["EndpointError", "RecordedCall", "RolloutEndpoint", "serve_rollouts_main", "stitch_calls",
           "trajectory_json"]
