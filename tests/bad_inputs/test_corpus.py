"""The bad-input corpus: each case is a bad config, file, flag or environment given to the CLI in-process.

Every case must end in `error: ...` (no traceback) with its exit code (2 for bad input, 1 for a run that
could not start, such as an unreachable master), printed first unless the case waits and says so meanwhile
(`Case.progress`: the start of each line before it), the message must name the bad thing (key, file, value or
flag), and no file that existed before the run may have changed (sizes, mtimes and sha256 of everything
under the case's workspace and the shared model directory). docs/bad-inputs.md lists the cases.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from scalerl.core.net import free_port
from tests.bad_inputs.conftest import TINY, copy_model, run_cli, snapshot

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RAY_ADDRESS")
SCRIPT = ROOT / "examples" / "grpo_trainer" / "run_qwen2-7b_math_megatron.sh"


@dataclass
class Ctx:
    """What a case builds its input in: the workspace (the current directory during the run)."""

    ws: Path
    model_dir: Path
    monkeypatch: pytest.MonkeyPatch
    expect: list[str] = field(default_factory=list)  # further strings the message must contain
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def out(self) -> str:
        return f"trainer.output_dir={self.ws / 'out'}"

    def write(self, name: str, data: bytes | str) -> Path:
        path = self.ws / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return path

    def model(self) -> Path:
        return copy_model(self.model_dir, self.ws)

    def model_config(self, **changes) -> Path:
        model = self.model()
        config = json.loads((model / "config.json").read_text())
        config.update(changes)
        (model / "config.json").write_text(json.dumps(config))
        return model

    def gsm8k(self, *questions: str) -> Path:
        rows = [{"question": q, "answer": "#### 2"} for q in questions]
        return self.write("rows.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))

    def rank_env(self, rank: int, world: int, port: int) -> None:
        for name, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1,
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}.items():
            self.monkeypatch.setenv(name, str(value))


@dataclass
class Case:
    name: str
    build: Callable[[Ctx], list[str]]  # -> argv for `scalerl`
    names: tuple[str, ...]  # the message must contain each
    code: int = 2
    progress: str = ""  # the start of each line printed before the error, at least one (a wait that reports)


def train(ctx: Ctx, *overrides: str) -> list[str]:
    return ["train", *TINY, ctx.out(), *overrides]


def model_file(name: str, data, command: list[str] | None = None, launch: bool = False) -> Callable[[Ctx], list[str]]:
    """A copy of the model directory with file `name` replaced by `data` (bytes, text, a function of the
    context, or None to delete it), trained on (given to `command` with --model; or to `launch slurm`)."""
    def build(ctx: Ctx) -> list[str]:
        model = ctx.model()
        content = data(ctx) if callable(data) else data
        if content is None:
            (model / name).unlink()
        else:
            (model / name).write_bytes(content.encode() if isinstance(content, str) else content)
        if command is not None:
            return [command[0], "--model", str(model), *command[1:]]
        if launch:
            return ["launch", "slurm", ctx.out(), f"model.path={model}", "--nodes", "2", "--print"]
        return train(ctx, f"model.path={model}")
    return build


def _unreachable_ray(ctx: Ctx) -> list[str]:
    pytest.importorskip("ray")
    address = f"127.0.0.1:{free_port()}"  # a loopback port nobody serves
    ctx.expect.append(address)
    return ["launch", "ray", ctx.out(), "--address", address, "--connect-timeout", "1"]


def _busy_port(ctx: Ctx) -> list[str]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    ctx.cleanup.append(listener.close)
    port = listener.getsockname()[1]
    ctx.rank_env(0, 2, port)
    ctx.expect.append(f"MASTER_PORT={port}")
    return train(ctx)


def _unreachable_master(ctx: Ctx) -> list[str]:
    port = free_port()  # nobody serves it
    ctx.rank_env(1, 2, port)
    ctx.expect += [f"127.0.0.1:{port}", "rank 1 of 2"]
    return train(ctx, "trainer.rendezvous_timeout_s=1.5")


def _hanging_reward(ctx: Ctx) -> list[str]:
    """A reward that never returns: the run stops after its first batch, not after data.max_reward_failures."""
    reward = ctx.write("r.py", "import time\n\n\ndef score(response, truth):\n    time.sleep(60)\n")
    return train(ctx, f"data.reward={reward}:score", "data.reward_timeout_s=0.2")


def _read_only_output(ctx: Ctx) -> list[str]:
    target = ctx.ws / "ro"
    target.mkdir()
    if os.geteuid() == 0:  # root writes anywhere but on a read-only file system
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(target)], capture_output=True)
        if done.returncode:
            pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
        ctx.cleanup.append(lambda: subprocess.run(["umount", str(target)], check=True))
    else:
        target.chmod(0o555)
        ctx.cleanup.append(lambda: target.chmod(0o755))
    return train(ctx, f"trainer.output_dir={target / 'run'}")


def _index_escaping(ctx: Ctx) -> list[str]:
    model = ctx.model()
    escaping = {"weight_map": {"lm_head.weight": "../x.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(escaping))
    return train(ctx, f"model.path={model}")


def _without_chat_template(model: Path) -> Path:
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def _example_script(*flags: str) -> Callable[[Ctx], list[str]]:
    """The seed article's launch script is bash: run it as a subprocess, hand back its result as argv=None."""
    def build(ctx: Ctx) -> list[str]:
        done = subprocess.run(["bash", str(SCRIPT), "--distributed_backend", "slurm", "--print", *flags],
                              capture_output=True, text=True, timeout=60, cwd=ctx.ws,
                              env={**os.environ, "PYTHON": sys.executable})
        return ["__subprocess__", str(done.returncode), done.stderr]
    return build


CASES = [
    # ------------------------------------------------------------------------------ config files and keys
    Case("config-binary", lambda c: ["train", str(c.write("run.yaml", b"\xff\xfe\x00\x01binary"))],
         ("run.yaml", "UTF-8")),
    Case("config-nul-bytes", lambda c: ["config", str(c.write("run.yaml", "actor:\n  lr: 1\x00\n"))],
         ("run.yaml", "binary")),
    Case("config-not-a-mapping", lambda c: ["config", str(c.write("run.yaml", "- 1\n- 2\n"))],
         ("run.yaml", "mapping")),
    Case("config-bad-yaml", lambda c: ["config", str(c.write("run.yaml", "actor: [1,\n"))],
         ("run.yaml", "not valid YAML")),
    Case("config-missing-file", lambda c: ["config", str(c.ws / "absent.yaml")], ("absent.yaml",)),
    Case("config-section-not-mapping", lambda c: ["config", str(c.write("run.yaml", "actor: 3\n"))], ("actor",)),
    Case("key-typo", lambda c: ["config", "actor.lrr=1e-6"], ("'actor.lrr'", "actor.lr")),
    Case("string-for-number", lambda c: ["config", "actor.lr=fast"], ("actor.lr", "fast")),
    Case("lr-inf", lambda c: ["config", "actor.lr=inf"], ("actor.lr", "finite")),
    Case("lr-nan-in-yaml", lambda c: ["config", str(c.write("run.yaml", "actor:\n  lr: .nan\n"))],
         ("actor.lr", "finite")),
    Case("entropy-coeff-nan", lambda c: ["config", "actor.entropy_coeff=nan"], ("actor.entropy_coeff", "finite")),
    Case("beta-out-of-range", lambda c: ["config", "actor.betas=[0.9,1.0]"], ("actor.betas[1]", "[0, 1)")),
    Case("top-p-zero", lambda c: ["config", "rollout.top_p=0"], ("rollout.top_p",)),
    Case("sft-lr-negative", lambda c: ["sft", "sft.lr=-1"], ("sft.lr", "> 0")),
    Case("grpo-greedy", lambda c: ["config", "rollout.temperature=0"], ("rollout.temperature", "adv_estimator=grpo")),
    Case("temperature-underflows", lambda c: ["config", "rollout.temperature=1e-45"],
         ("rollout.temperature=1e-45", "rollout.temperature=0")),
    Case("output-dir-empty", lambda c: ["train", "trainer.output_dir="], ("trainer.output_dir",)),
    Case("tp-does-not-divide-heads", lambda c: ["config", "parallel.tp=3"], ("parallel.tp=3", "num_attention_heads")),
    Case("pp-does-not-divide-layers", lambda c: ["config", "parallel.pp=3"], ("parallel.pp=3", "num_hidden_layers")),
    Case("template-ignored-by-task", lambda c: ["config", "data.prompt_template=Q {question}"],
         ("data.prompt_template", "arithmetic")),
    Case("prompt-exceeds-builtin-positions", lambda c: ["config", "data.max_prompt_length=600"],
         ("data.max_prompt_length", "512")),
    Case("reward-timeout-zero", lambda c: ["config", "data.reward_timeout_s=0"], ("data.reward_timeout_s",)),
    Case("reward-weights-count", lambda c: ["config", "data.reward=gsm8k,math", "data.reward_weights=[1]"],
         ("data.reward_weights", "2 functions")),
    Case("max-reward-failures-negative", lambda c: ["config", "data.max_reward_failures=-1"],
         ("data.max_reward_failures",)),
    Case("dist-timeout-negative", lambda c: ["config", "trainer.dist_timeout_s=-5"], ("trainer.dist_timeout_s",)),
    Case("max-skipped-negative", lambda c: ["config", "trainer.max_skipped_steps=-1"], ("trainer.max_skipped_steps",)),
    Case("override-without-equals", lambda c: ["config", "actor.lr"], ("actor.lr", "key=value")),
    # ------------------------------------------------------------------------------ model directories
    Case("model-config-not-object", model_file("config.json", "[1, 2]"), ("config.json", "JSON object")),
    Case("model-config-non-utf8", model_file("config.json", b'{"a": "\xff"}'), ("config.json", "UTF-8")),
    Case("model-config-bad-json", model_file("config.json", "{oops"), ("config.json", "not valid JSON")),
    Case("model-config-string-number", lambda c: train(c, f"model.path={c.model_config(hidden_size='32')}"),
         ("config.json", "hidden_size='32'")),
    Case("safetensors-truncated", model_file("model.safetensors", lambda c: (
        c.model_dir / "model.safetensors").read_bytes()[:100]), ("model.safetensors", "truncated")),
    Case("safetensors-empty", model_file("model.safetensors", b""), ("model.safetensors", "0 bytes")),
    Case("index-not-json", model_file("model.safetensors.index.json", "{not json"),
         ("model.safetensors.index.json", "not valid JSON")),
    Case("index-shard-outside-directory", _index_escaping, ("../x.safetensors", "not a file name")),
    Case("no-tokenizer-json", model_file("tokenizer.json", None), ("tokenizer.json", "model.tokenizer")),
    Case("tokenizer-config-bad-json", model_file("tokenizer_config.json", "[1"), ("tokenizer_config.json",)),
    Case("tp-does-not-divide-model-dir", lambda c: ["config", f"model.path={c.model()}", "parallel.tp=3"],
         ("parallel.tp=3", "num_attention_heads=4")),
    Case("prompt-exceeds-model-dir-positions", lambda c: ["config", f"model.path={c.model()}",
                                                          "data.max_prompt_length=600"],
         ("max_position_embeddings=512",)),
    # ------------------------------------------------------------------------------ data
    Case("data-not-utf8", lambda c: train(c, "data.task=gsm8k", "data.train_files=[" + str(c.write(
        "rows.jsonl", b'{"question": "1+1", "answer": "#### 2"}\n{"question": "caf\xe9", "answer": "#### 2"}\n'))
        + "]"), ("rows.jsonl", "row 2", "UTF-8")),
    Case("character-not-in-tokenizer", lambda c: train(c, "data.task=gsm8k", "trainer.batch_size=2",
                                                       "actor.ppo_mini_batch_size=8",
                                                       f"data.train_files=[{c.gsm8k('1+1', 'café 1+1')}]"),
         ("training row 2", "'é'")),
    Case("prompt-longer-than-limit", lambda c: train(c, "data.task=gsm8k", "data.max_prompt_length=16",
                                                     f"data.train_files=[{c.gsm8k('1+' * 30 + '1')}]"),
         ("data.max_prompt_length=16",)),
    Case("template-ignored-by-rows", lambda c: train(c, "data.prompt_template=Q {question}",
                                                     "data.train_files=[" + str(c.write(
                                                         "rows.jsonl", '{"prompt": "Q:1+1", "ground_truth": "2"}\n'))
                                                     + "]"), ("rows.jsonl", "data.prompt_template")),
    Case("data-file-missing", lambda c: train(c, "data.task=gsm8k", f"data.train_files=[{c.ws / 'nope.jsonl'}]"),
         ("nope.jsonl", "does not exist")),
    Case("data-file-empty", lambda c: train(c, f"data.train_files=[{c.write('rows.jsonl', '')}]"),
         ("training set is empty", "rows.jsonl", "data.train_files")),
    Case("data-not-json-lines", lambda c: train(c, "data.task=gsm8k",
                                                f"data.train_files=[{c.write('rows.jsonl', 'not json')}]"),
         ("rows.jsonl", "JSON lines")),
    Case("data-row-missing-field", lambda c: train(c, "data.task=gsm8k", "data.train_files=[" + str(c.write(
        "rows.jsonl", '{"question": "1+1"}\n')) + "]"), ("rows.jsonl", "row 1", "'answer'")),
    # verl's, TRL's and Hugging Face formats (docs/configuration.md#data-formats)
    Case("verl-row-missing-ground-truth", lambda c: train(c, "data.train_files=[" + str(c.write("verl.jsonl", json.dumps(
        {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"style": "rule"}}) + "\n")) + "]"),
         ("verl.jsonl", "row 1", "'reward_model.ground_truth'")),
    Case("chat-message-unknown-role", lambda c: train(c, "data.train_files=[" + str(c.write("verl.jsonl", json.dumps(
        {"prompt": [{"role": "robot", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}) + "\n")) + "]"),
         ("verl.jsonl", "row 1", "'prompt[0].role'", "'robot'")),
    Case("chat-prompt-tokenizer-without-template", lambda c: train(
        c, f"model.path={_without_chat_template(c.model())}", "data.train_files=[" + str(c.write("trl.jsonl", json.dumps(
            {"prompt": [{"role": "user", "content": "1+1?"}], "ground_truth": "2"}) + "\n")) + "]",
        "trainer.batch_size=1", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=4"),
         ("training row 1", "chat template")),
    Case("hub-dataset-name", lambda c: train(c, "data.train_files=[openai/gsm8k]"),
         ("'openai/gsm8k' does not exist", "huggingface-cli download openai/gsm8k", "save_to_disk")),
    Case("saved-dataset-unknown-split", lambda c: train(c, "data.split=validation", "data.train_files=[" + str(
        c.write("dataset_dict.json", '{"splits": ["train", "test"]}').parent) + "]"),
         ("splits ['train', 'test']", "'validation'", "data.split")),
    Case("sft-batch-exceeds-rows", lambda c: ["sft", *TINY, c.out(), "data.num_train=4", "sft.batch_size=8"],
         ("sft.batch_size=8",)),
    Case("reward-module-missing", lambda c: train(c, "data.reward=no_such_module_xyz:score"),
         ("no_such_module_xyz",)),
    Case("reward-signature-unknown", lambda c: train(c, "data.reward=" + str(c.write("r.py", "def score(x):\n    return 1"))
                                                        + ":score"), ("r.py:score", "compute_score(data_source")),
    Case("reward-hangs", _hanging_reward, ("r.py:score", "timed out on all", "data.reward_timeout_s=0.2 s"), code=1),
    # streaming, reward workers and servers, reward models (this round's input paths)
    Case("streaming-without-files", lambda c: train(c, "data.streaming=true"), ("data.streaming", "data.train_files")),
    Case("shuffle-buffer-zero", lambda c: ["config", "data.shuffle_buffer=0"], ("data.shuffle_buffer",)),
    Case("streaming-json-lines", lambda c: train(c, "data.streaming=true", "data.task=gsm8k",
                                                 f"data.train_files=[{c.gsm8k('1+1')}]"), ("rows.jsonl", "Parquet")),
    Case("reward-server-scheme", lambda c: ["config", "data.reward=ftp://127.0.0.1:9/score"],
         ("data.reward", "http://")),
    Case("reward-workers-negative", lambda c: ["config", "data.reward_workers=-1"], ("data.reward_workers",)),
    Case("reward-batch-size-zero", lambda c: ["config", "data.reward_batch_size=0"], ("data.reward_batch_size",)),
    Case("reward-none-without-model", lambda c: ["config", "data.reward=none"], ("data.reward=none",
                                                                                "data.reward_model.path")),
    Case("reward-model-is-a-causal-lm", lambda c: train(c, f"data.reward_model.path={c.model()}"),
         ("ForSequenceClassification",)),
    # models: architectures, the transformers fallback, expert parallelism, exports
    Case("model-type-unknown", lambda c: train(c, f"model.path={c.model_config(model_type='no_such_arch', architectures=['NoSuchForCausalLM'])}"),
         ("no_such_arch",)),
    Case("model-implementation-unknown", lambda c: ["config", "model.implementation=jax"], ("model.implementation",)),
    Case("capacity-factor-on-dense-model", lambda c: train(c, "model.moe_capacity_factor=1.0"),
         ("model.moe_capacity_factor",)),
    Case("ep-on-dense-model", lambda c: ["config", "parallel.ep=2"], ("parallel.ep",)),
    Case("sp-does-not-divide-heads", lambda c: ["config", "parallel.sp=3"], ("parallel.sp=3", "num_attention_heads=4")),
    Case("sp-does-not-divide-model-dir-heads", lambda c: ["config", f"model.path={c.model()}", "parallel.sp=8"],
         ("parallel.sp=8", "num_attention_heads=4")),
    Case("sp-with-tp", lambda c: ["config", "parallel.sp=2", "parallel.tp=2"], ("parallel.sp=2", "parallel.tp=2")),
    Case("sp-world-size-mismatch", lambda c: train(c, "parallel.sp=2"), ("parallel.sp=2", "world size 1")),
    Case("export-dtype-unknown", lambda c: ["config", "trainer.export_dtype=int8"], ("trainer.export_dtype",)),
    Case("export-shard-size-not-a-size", lambda c: ["config", "trainer.export_max_shard_size=huge"],
         ("trainer.export_max_shard_size",)),
    # ------------------------------------------------------------------------------ environment and flags
    Case("device-cuda-without-gpu", lambda c: train(c, "trainer.device=cuda") if not torch.cuda.is_available()
         else pytest.skip("a GPU is visible"), ("trainer.device=cuda",)),
    Case("output-dir-is-a-file", lambda c: train(c, f"trainer.output_dir={c.write('taken', 'x')}"),
         ("trainer.output_dir", "is a file")),
    Case("output-dir-under-a-file", lambda c: train(c, f"trainer.output_dir={c.write('taken', 'x') / 'run'}"),
         ("trainer.output_dir", "is a file")),
    Case("output-dir-read-only", _read_only_output, ("trainer.output_dir", "not writable")),
    Case("master-port-busy", _busy_port, ("MASTER_PORT",)),
    Case("master-unreachable", _unreachable_master, ("rendezvous", "trainer.rendezvous_timeout_s"), code=1,
         progress="rendezvous: rank 1 of 2 "),
    Case("rank-outside-world", lambda c: (c.rank_env(3, 2, free_port()), train(c))[1], ("RANK=3", "WORLD_SIZE=2")),
    Case("world-size-without-rank", lambda c: (c.monkeypatch.setenv("WORLD_SIZE", "2"), train(c))[1],
         ("WORLD_SIZE=2", "RANK")),
    Case("generate-temperature-nan", lambda c: ["generate", "--model", "builtin", "--prompt", "hi",
                                                "--temperature", "nan"], ("--temperature",)),
    Case("generate-prompt-too-long", lambda c: ["generate", "--model", "builtin", "--prompt", "a" * 600],
         ("max_position_embeddings", "601")),
    Case("generate-model-missing", lambda c: ["generate", "--model", str(c.ws / "nope"), "--prompt", "x"],
         ("--model",)),
    Case("generate-model-truncated", model_file("model.safetensors", b"\x10", ["generate", "--prompt", "x"]),
         ("model.safetensors",)),
    Case("launch-slurm-bad-key", lambda c: ["launch", "slurm", "actor.lr=inf", "--nodes", "1", "--print"],
         ("actor.lr",)),
    Case("launch-slurm-model-without-tokenizer", model_file("tokenizer.json", None, None, launch=True),
         ("tokenizer.json", "model.tokenizer")),
    Case("launch-ray-bad-address", lambda c: ["launch", "ray", c.out(), "--address", "nowhere"],
         ("--address", "HOST:PORT")),
    Case("launch-ray-unreachable-address", _unreachable_ray, ("--connect-timeout 1 s",)),
    Case("verify-unknown-layout", lambda c: ["verify", "distributed-vs-single", "--world", "2", "--layout", "fdsp"],
         ("--layout fdsp", "fsdp")),
    Case("verify-output-dir-is-a-file", lambda c: ["verify", "distributed-vs-single", "--output-dir",
                                                   str(c.write("taken", "x"))], ("--output-dir", "is a file")),
    Case("example-script-not-a-number", _example_script("--num_nodes", "two"), ("--num_nodes", "'two'")),
    Case("example-script-accumulation-zero", _example_script("--gradient_accumulation_steps", "0"),
         ("--gradient_accumulation_steps",)),
]



@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_an_error_naming_it(case, model_dir, tmp_path, monkeypatch, capsys):
    ctx = Ctx(tmp_path / "ws", model_dir, monkeypatch)
    ctx.ws.mkdir()
    monkeypatch.chdir(ctx.ws)
    for name in LAUNCHER_VARIABLES:  # a single process unless a case says otherwise, even inside a job
        monkeypatch.delenv(name, raising=False)
    try:
        argv = case.build(ctx)
        before = snapshot(ctx.ws, model_dir)
        if argv[0] == "__subprocess__":
            code, err = int(argv[1]), argv[2]
        else:
            code, err = run_cli(argv, capsys)
        after = snapshot(ctx.ws, model_dir)
    finally:
        for undo in reversed(ctx.cleanup):
            undo()
    assert code == case.code, err
    message = err
    while case.progress and message.startswith(case.progress):
        message = message.partition("\n")[2]
    assert message != err or not case.progress, f"no line starting {case.progress!r} before the error: {err!r}"
    assert message.startswith("error: ") and "Traceback" not in err, err
    for name in (*case.names, *ctx.expect):
        assert name in message, f"{name!r} not in {message!r}"
    changed = [path for path, seen in before.items() if after.get(path) != seen]
    assert not changed, f"existing files changed: {changed}"


def test_corpus_is_large_enough():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
