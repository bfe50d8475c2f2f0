"""The rollout endpoint: an agent program using the `openai` client library, in a process of its own, drives the
built-in continuous engine through it; the session's calls come back as one trajectory whose trained ids and
log-probs are the ones the engine sampled, with the tool results and user turns as untrained context. Errors
answer in OpenAI's shape, a client that disconnects leaves nothing recorded, and `close` stops every thread."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from scalerl.models.tokenizer import CharTokenizer
from scalerl.rollout.agent.endpoint import RecordedCall, RolloutEndpoint, stitch_calls
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.trajectory import trajectories_to_output
from tests.emulated_network import wait_until
from tests.rollout.agent.chat_templates import QWEN25, chat_tokenizer
from tests.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[3]
TOK = CharTokenizer()
TOOL_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]


class Script:
    """A logits processor that pushes the listed requests (by the pump's request id) to a text, then eos: the
    tiny random model writes the tool calls a trained model would. The push is a bias, not a mask, so the
    log-probs stay the engine's own (negative) values."""

    def __init__(self, plans: dict[int, str], tokenizer=TOK):
        self.plans = {rid: tokenizer.encode(text) + [tokenizer.eos_token_id] for rid, text in plans.items()}

    def __call__(self, logits, request_ids, index):
        logits = logits.clone()
        for row, (rid, i) in enumerate(zip(request_ids.tolist(), index.tolist())):
            plan = self.plans.get(rid)
            if plan is not None and i < len(plan):
                logits[row, plan[i]] += 16.0
        return logits


class Spy:
    """The engine, with what its steps returned and what was aborted kept (and each step slowed, if asked)."""

    def __init__(self, engine, slow_s: float = 0.0):
        self.engine, self.slow_s, self.outputs, self.aborted, self.steps = engine, slow_s, [], [], 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        if self.slow_s:
            time.sleep(self.slow_s)
        out = self.engine.step()
        self.outputs.extend(out)
        self.steps += 1
        return out

    def abort(self, ids):
        self.aborted.extend(ids)
        return self.engine.abort(ids)


def _endpoint(plans=None, slow_s=0.0, tokenizer=TOK, max_prompt_len=300, **kwargs) -> tuple[RolloutEndpoint, Spy]:
    model = tiny_model(vocab_size=128).eval()
    engine = BuiltinEngine(model, tokenizer.pad_token_id, logits_processor=Script(plans or {}, tokenizer)
                           ).continuous_engine(max_prompt_len, 80, max_num_seqs=4)
    spy = Spy(engine, slow_s)
    return RolloutEndpoint(spy, tokenizer, sampling=SamplingParams(seed=5), model_name="tiny", **kwargs).start(), spy


def _request(endpoint, method, path, body=None, token=None, raw=None):
    """(status, JSON) of one HTTP request to the endpoint."""
    connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if token is not False:
        headers["Authorization"] = f"Bearer {token or endpoint.token}"
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    payload = json.loads(response.read() or b"null")
    connection.close()
    return response.status, payload


AGENT = r"""
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0, timeout=120)
tools = json.loads(sys.argv[3])
messages = [{"role": "user", "content": "What is 2+3?"}]
seen = []
for follow_up in ("And 4+4?", None):
    for _ in range(3):  # the tool loop: call tools until the model answers
        r = client.chat.completions.create(model="tiny", messages=messages, tools=tools, max_tokens=70)
        choice = r.choices[0]
        seen.append({"prompt_token_ids": r.prompt_token_ids, "token_ids": choice.token_ids,
                     "logprobs": [c.logprob for c in choice.logprobs.content], "finish_reason": choice.finish_reason,
                     "tool_calls": [[c.function.name, json.loads(c.function.arguments)]
                                    for c in choice.message.tool_calls or []]})
        messages.append(choice.message)  # as agent programs do: the message object itself
        if not choice.message.tool_calls:
            break
        for call in choice.message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(arguments["a"] + arguments["b"])})
    if follow_up:
        messages.append({"role": "user", "content": follow_up})
try:
    client.chat.completions.create(model="tiny", messages=messages, stream=True)
except Exception as error:
    seen.append({"stream_error": [type(error).__name__, str(error)]})
print(json.dumps(seen))
"""


def test_an_openai_client_agent_is_recorded_as_one_token_exact_trajectory():
    pytest.importorskip("openai")
    endpoint, spy = _endpoint(plans={0: TOOL_CALL, 2: TOOL_CALL})
    try:
        row = {"prompt": "What is 2+3?"}
        session = endpoint.open_session(row)
        done = subprocess.run([sys.executable, "-c", AGENT, endpoint.base_url(session), endpoint.token,
                               json.dumps(TOOLS)], capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-3000:]
        *seen, refused = json.loads(done.stdout)
        assert refused["stream_error"][0] == "BadRequestError" and "stream" in refused["stream_error"][1]
        assert len(seen) == 4  # call, answer after the tool result; call, answer after the next user turn
        assert [s["tool_calls"] for s in seen[::2]] == [[["add", {"a": 2, "b": 3}]]] * 2
        assert [s["finish_reason"] for s in seen[::2]] == ["tool_calls"] * 2 and not seen[1]["tool_calls"]
        assert _request(endpoint, "POST", f"/sessions/{session}/reward", {"reward": 1.5})[0] == 200
        trajectories, reward = endpoint.collect(session)
    finally:
        endpoint.close()
    assert reward == 1.5 and len(trajectories) == 1  # every call continued the one before: one trajectory
    t = trajectories[0]
    assert t.reward_inputs["row"] == row and t.reward_inputs["env_reward"] == 1.5
    assert t.reward_inputs["info"]["prefix_breaks"] == 0 and t.reward_inputs["info"]["calls"] == 4
    assert t.prompt_ids == TOK.encode("What is 2+3?") == seen[0]["prompt_token_ids"]
    # The trained ids and log-probs are the engine's, as it returned them, and as the client was told.
    sampled = sorted(spy.outputs, key=lambda o: o.request_id)
    generated = [s for s in t.segments if s.generated]
    assert [s.token_ids for s in generated] == [o.token_ids.tolist() for o in sampled] == [s["token_ids"] for s in seen]
    assert [s.logprobs for s in generated] == [o.logprobs.tolist() for o in sampled] == [s["logprobs"] for s in seen]
    assert generated[0].token_ids == TOK.encode(TOOL_CALL) + [TOK.eos_token_id]
    assert all(lp < 0 for s in generated for lp in s.logprobs)
    # Between them only the new messages' tokens: the tool results and the user turn, never a re-render.
    context = [s.token_ids for s in t.segments if not s.generated]
    assert context == [TOK.encode("5"), TOK.encode("And 4+4?"), TOK.encode("5")]
    assert [s.generated for s in t.segments] == [True, False, True, False, True, False, True]
    at = list(t.prompt_ids)  # each call's prompt is the trajectory so far
    for segment in t.segments:
        if segment.generated:
            assert seen.pop(0)["prompt_token_ids"] == at
        at += segment.token_ids
    out = trajectories_to_output(trajectories, TOK.pad_token_id)
    expected_mask = [int(s.generated) for s in t.segments for _ in s.token_ids]
    assert out.loss_mask[0].tolist() == expected_mask and out.response_ids[0].tolist() == t.response_ids
    assert torch.equal(out.logprobs[0][out.loss_mask[0].bool()],
                       torch.tensor([lp for s in generated for lp in s.logprobs]))


def test_a_qwen_template_conversation_is_continued_by_ids_not_rendered_again():
    """Qwen's template renders an assistant turn's content only and puts a newline after <|im_end|>: a tool
    call echoed back by the client (content None, tool_calls) would render as an empty turn. The next call's
    prompt is the ids sampled plus the glue and the tool response instead: the whole conversation rendered
    with the turn as generated."""
    qwen = chat_tokenizer(QWEN25)
    endpoint, _ = _endpoint(plans={0: TOOL_CALL}, tokenizer=qwen, max_prompt_len=800)  # the tools take ~300
    try:
        session = endpoint.open_session()
        chat = f"/sessions/{session}/v1/chat/completions"
        user = {"role": "user", "content": "What is 2+3?"}
        _, first = _request(endpoint, "POST", chat, {"messages": [user], "tools": TOOLS, "max_tokens": 70})
        message = first["choices"][0]["message"]
        assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "add"
        call_id = message["tool_calls"][0]["id"]
        tool = {"role": "tool", "tool_call_id": call_id, "content": "5"}
        _, second = _request(endpoint, "POST", chat, {"messages": [user, message, tool], "tools": TOOLS,
                                                      "max_tokens": 5})
        trajectories, _ = endpoint.collect(session)
    finally:
        endpoint.close()
    generated = first["choices"][0]["token_ids"]
    assert generated == qwen.encode(TOOL_CALL) + [qwen.eos_token_id]
    as_generated = qwen.apply_chat_template([user, {"role": "assistant", "content": TOOL_CALL}, tool],
                                            add_generation_prompt=True, tools=TOOLS)
    assert second["prompt_token_ids"] == qwen.encode(as_generated)
    delta = qwen.decode(second["prompt_token_ids"][len(first["prompt_token_ids"]) + len(generated):],
                        skip_special_tokens=False)
    assert delta.startswith("\n<|im_start|>user") and "<tool_response>\n5\n</tool_response>" in delta
    assert delta.endswith("<|im_end|>\n<|im_start|>assistant\n")  # the glue, the tool response, the next turn
    assert len(trajectories) == 1 and [s.generated for s in trajectories[0].segments] == [True, False, True]


def test_errors_answer_in_openais_shape_and_record_nothing():
    endpoint, spy = _endpoint()
    try:
        session = endpoint.open_session()
        chat = f"/sessions/{session}/v1/chat/completions"
        ok = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 4}
        assert _request(endpoint, "GET", "/v1/models", token=False)[0] == 401
        status, body = _request(endpoint, "POST", chat, ok, token="wrong")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, body = _request(endpoint, "GET", f"/sessions/{session}/v1/models")
        assert status == 200 and body["data"][0]["id"] == "tiny" and body["data"][0]["max_model_len"] == 380
        status, body = _request(endpoint, "POST", chat, raw=b'{"messages": [')
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"
        status, body = _request(endpoint, "POST", "/sessions/nope/v1/chat/completions", ok)
        assert status == 404 and body["error"]["code"] == "session_not_found"
        status, body = _request(endpoint, "POST", "/v1/chat/completions", ok)
        assert status == 404 and body["error"]["code"] == "session_required"
        status, body = _request(endpoint, "POST", chat, {**ok, "stream": True})
        assert status == 400 and "stream=true is not supported" in body["error"]["message"]
        status, body = _request(endpoint, "POST", chat, {**ok, "n": 2})
        assert status == 400 and body["error"]["param"] == "n"
        status, body = _request(endpoint, "POST", chat, {"messages": [{"role": "user", "content": "9" * 301}]})
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"
        message = body["error"]["message"]
        assert "maximum context length is 380 tokens" in message and "resulted in 301 tokens" in message
        status, body = _request(endpoint, "POST", chat, {"messages": "hi"})
        assert status == 400 and body["error"]["param"] == "messages"
        status, body = _request(endpoint, "POST", f"/sessions/{session}/reward", {"reward": "high"})
        assert status == 400 and body["error"]["param"] == "reward"
        assert _request(endpoint, "GET", chat)[0] == 405
        assert endpoint.session_info(session)["calls"] == 0 and not spy.outputs
        status, body = _request(endpoint, "POST", chat, ok)  # the connection and the session still serve
        assert status == 200 and len(body["choices"][0]["token_ids"]) == body["usage"]["completion_tokens"] <= 4
        assert endpoint.collect(session)[0][0].response_ids == body["choices"][0]["token_ids"]
        with pytest.raises(KeyError):  # collected: gone, nothing is handed out twice
            endpoint.collect(session)
        assert _request(endpoint, "POST", chat, ok)[0] == 404
    finally:
        endpoint.close()


def test_a_client_that_disconnects_gets_no_recorded_call_and_frees_its_row():
    endpoint, spy = _endpoint(plans={0: "x" * 100}, slow_s=0.05)  # no eos before the 80th token
    try:
        session = endpoint.open_session()
        body = json.dumps({"messages": [{"role": "user", "content": "count:"}], "max_tokens": 80}).encode()
        client = socket.create_connection(("127.0.0.1", endpoint.port), timeout=10)
        client.sendall(b"POST /sessions/%s/v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (session.encode(), endpoint.token.encode(), len(body), body))
        wait_until(lambda: spy.steps >= 2, 10, "the call to decode")
        client.close()  # 80 tokens at 4 per 0.05 s step: about a second from done
        wait_until(lambda: endpoint.session_info(session)["in_flight"] == 0, 10, "the call to end")
        wait_until(lambda: not spy.engine.has_unfinished(), 10, "the engine to be idle")
        assert spy.aborted == [0] and not spy.outputs  # its row was freed before it finished
        assert endpoint.session_info(session)["calls"] == 0
        assert endpoint.collect(session) == ([], None)
    finally:
        endpoint.close()


def test_prefix_chains_make_trajectories_and_breaks_are_counted():
    stops = "abcXdef"
    endpoint, _ = _endpoint(plans={2: stops})
    try:
        session = endpoint.open_session()
        chat = f"/sessions/{session}/v1/chat/completions"
        _, first = _request(endpoint, "POST", chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        # Another history (not first's messages + its answer): rendered whole, so a new trajectory and a break.
        _, second = _request(endpoint, "POST", chat, {"messages": [{"role": "user", "content": "hello"}],
                                                      "max_tokens": 5})
        assert second["prompt_token_ids"] == TOK.encode("hello")
        # A completion given ids: the first call's prompt + completion + more ids continues its trajectory, and
        # a stop string cuts the sampled ids after the token that completes it (vLLM's text: before it).
        more = first["prompt_token_ids"] + first["choices"][0]["token_ids"] + TOK.encode("ok")
        status, third = _request(endpoint, "POST", f"/sessions/{session}/v1/completions",
                                 {"prompt": more, "max_tokens": 20, "stop": ["X"]})
        assert status == 200 and third["choices"][0]["text"] == "abc"
        assert third["choices"][0]["token_ids"] == TOK.encode("abcX") and third["choices"][0]["finish_reason"] == "stop"
        assert len(third["choices"][0]["logprobs"]["token_logprobs"]) == 4
        assert third["choices"][0]["logprobs"]["tokens"] == list("abcX")
        # The server counts a call in flight until its handler returns, a moment after the client has the answer.
        wait_until(lambda: endpoint.session_info(session)["in_flight"] == 0, 10, "the last call's handler to end")
        assert endpoint.session_info(session) | {"session_id": None} == {
            "session_id": None, "calls": 3, "in_flight": 0, "reward": None, "template_breaks": 0, "prefix_breaks": 1}
        trajectories, _ = endpoint.collect(session)
    finally:
        endpoint.close()
    assert len(trajectories) == 2 and trajectories[0].reward_inputs["info"]["prefix_breaks"] == 1
    one, two = trajectories
    assert [s.token_ids for s in one.segments] == [first["choices"][0]["token_ids"], TOK.encode("ok"),
                                                   TOK.encode("abcX")]
    assert [s.generated for s in one.segments] == [True, False, True] and one.reward_inputs["info"]["calls"] == 2
    assert two.prompt_ids == TOK.encode("hello") and two.response_ids == second["choices"][0]["token_ids"]


def test_stitching_takes_the_longest_chain_a_call_continues():
    def call(prompt, ids):
        return RecordedCall(prompt, ids, [-0.5] * len(ids), 0, "stop", "completion")

    trajectories, counts, breaks = stitch_calls([
        call([1, 2], [3]),  # a
        call([7], [8]),  # b: a break
        call([1, 2, 3, 4], [5]),  # continues a
        call([7, 8], [9]),  # continues b, right after it, no new ids between
        call([1, 2], [6]),  # a retry of a's first call: a new trajectory, a break
    ])
    assert breaks == 2 and counts == [2, 2, 1]
    assert [t.prompt_ids for t in trajectories] == [[1, 2], [7], [1, 2]]
    assert [[(s.token_ids, s.generated) for s in t.segments] for t in trajectories] == [
        [([3], True), ([4], False), ([5], True)], [([8], True), ([9], True)], [([6], True)]]


def test_close_answers_calls_in_flight_and_stops_every_thread_in_time():
    endpoint, _ = _endpoint(plans={0: "x" * 100}, slow_s=0.05)
    session = endpoint.open_session()
    answers = []

    def call():
        answers.append(_request(endpoint, "POST", f"/sessions/{session}/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "go"}], "max_tokens": 80}))

    caller = threading.Thread(target=call)
    caller.start()
    wait_until(lambda: endpoint.session_info(session)["in_flight"] == 1, 10, "the call to start")
    began = time.monotonic()
    endpoint.close(timeout_s=5)
    caller.join(10)
    assert time.monotonic() - began < 5
    assert answers and answers[0][0] == 503 and "stopped" in answers[0][1]["error"]["message"]
    assert not [t for t in threading.enumerate() if t.name.startswith("scalerl-endpoint")]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=2).close()


def test_the_command_line_serves_the_builtin_model_and_records_closed_sessions(tmp_path):
    record = tmp_path / "sessions.jsonl"
    command = [sys.executable, "-m", "scalerl", "serve-rollouts", "--max-prompt-len", "64", "--max-new-tokens", "8",
               "--seed", "3", "--record", str(record)]
    server = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = {}
        while "token" not in lines:
            line = server.stdout.readline()
            assert line, server.stderr.read()[-3000:]
            key, _, value = line.partition(": ")
            lines[key] = value.strip()
        host, port = lines["url"].removeprefix("http://").split(":")

        class Remote:  # what _request needs
            pass

        remote = Remote()
        remote.port, remote.token = int(port), lines["token"]
        status, opened = _request(remote, "POST", "/sessions", {"row": {"id": 7}})
        assert status == 200 and opened["base_url"] == f"{lines['url']}/sessions/{opened['session_id']}/v1"
        path = opened["base_url"].removeprefix(lines["url"])
        status, answer = _request(remote, "POST", path + "/chat/completions",
                                  {"messages": [{"role": "user", "content": "2+2="}]})
        assert status == 200 and 1 <= len(answer["choices"][0]["token_ids"]) <= 8
        assert _request(remote, "POST", f"/sessions/{opened['session_id']}/reward", {"reward": 1})[0] == 200
        status, closed = _request(remote, "POST", f"/sessions/{opened['session_id']}/close")
        assert status == 200 and closed["reward"] == 1 and len(closed["trajectories"]) == 1
        t = closed["trajectories"][0]
        assert t["response_ids"] == answer["choices"][0]["token_ids"] and t["loss_mask"] == [1] * len(t["response_ids"])
        assert t["logprobs"] == [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]]
        assert json.loads(record.read_text()) == closed
        server.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
