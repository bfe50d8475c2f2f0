"""The transformers fallback (`model.implementation=transformers`): on a Qwen2 checkpoint it gives scalerl's
decoder's logits, hidden states and engine generations (left padding, KV cache, row compaction); decoders of
other shapes (GPT-2) and sliding windows (Mistral) decode over the engine's cache as their full forward; an
architecture scalerl does not implement (OLMo 2: q/k norms, post-norms) is chosen for it automatically, said
at start, trains at world 1 and under DDP and FSDP2 at world 2 with the single process's losses and weights,
resumes, runs SFT and PPO (its critic on the decoder's hidden states), exports a directory transformers
loads, from the live run and from its checkpoint; a directory missing a tensor is an error naming it; TP, PP
and EP are refused by name."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scalerl.checkpoint.export import export_checkpoint
from scalerl.core.config import ConfigError, ModelSection, ParallelSection, load_config
from scalerl.models.hf_checkpoint import CheckpointFormatError, save_pretrained
from scalerl.models.kv_cache import KVCache
from scalerl.models.load import load_model_and_tokenizer
from scalerl.models.tokenizer import CharTokenizer
from scalerl.models.transformers_model import (
    TransformersCausalLM,
    choose_implementation,
    transformers_layout_problems,
)
from scalerl.models.value_model import ValueModel
from scalerl.rollout.engines.builtin import BuiltinEngine
from scalerl.rollout.engines.engine import SamplingParams
from scalerl.rollout.engines.vllm import hf_weight_names
from scalerl.rollout.text import generate_text
from scalerl.trainer.run_checks import check_run_inputs
from scalerl.verify import (
    TOLERANCE,
    max_metric_diff,
    max_weight_diff,
    run_kind,
    verification_overrides,
)
from tests.spawned_group import run_in_group
from tests.tiny import tiny_model

STEPS = 2
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "critic/score/mean")


def _load(path, implementation):
    section = ModelSection(path=str(path), implementation=implementation)
    return load_model_and_tokenizer(section, None, torch.device("cpu"), seed=0)[0].eval()


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A random Qwen2 directory (random biases and norm weights, so parity exercises them) with the
    built-in tokenizer's files."""
    model = tiny_model(vocab_size=128, max_position_embeddings=128)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # larger weights: logits far from uniform, so greedy decoding varies from token to token
                p.mul_(20.0)
    path = tmp_path_factory.mktemp("qwen2") / "model"
    save_pretrained(model, path, tokenizer=CharTokenizer())
    return path


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory):
    """A random OLMo 2 directory (an architecture scalerl does not implement) saved by transformers, with
    the built-in tokenizer's files; the vocabulary and positions of the built-in model."""
    tokenizer = CharTokenizer()
    config = transformers.Olmo2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("olmo2") / "model"
    transformers.Olmo2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _left_padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_on_qwen2_the_fallback_gives_scalerls_logits_and_hidden_states(qwen2_dir):
    ours, theirs = _load(qwen2_dir, "scalerl"), _load(qwen2_dir, "transformers")
    assert isinstance(theirs, TransformersCausalLM) and not isinstance(ours, TransformersCausalLM)
    # Weight sync to vLLM names both models' tensors as the Hugging Face directory does.
    assert {n for n, _ in hf_weight_names(theirs.named_parameters())} == \
        {n for n, _ in hf_weight_names(ours.named_parameters())} == {n for n, _ in theirs.hf.named_parameters()}
    assert theirs.config.num_hidden_layers == 2 and len(theirs.layers) == 2 and theirs.config.vocab_size == 128
    ids, mask = _left_padded_batch()
    real = mask.bool()
    with torch.no_grad():
        a, b = ours(ids, attention_mask=mask), theirs(ids, attention_mask=mask)
        assert (a - b)[real].abs().max() <= 1e-5  # padding positions' outputs are never read
        assert torch.isfinite(b).all()  # ... but must not be NaN (it would poison gradients)
        a, b = ours(ids, attention_mask=mask, logits_to_keep=3, return_hidden=True), \
            theirs(ids, attention_mask=mask, logits_to_keep=3, return_hidden=True)
        assert b.shape == (3, 3, 32) and (a - b).abs().max() <= 1e-5
        # The critic: the value head reads the same hidden states; its backbone has no head left.
        critic = ValueModel(theirs)
        assert critic.backbone.lm_head is None and theirs.lm_head is not None
        critic.value_head.weight.data.normal_()
        reference = ValueModel(ours)
        reference.value_head.load_state_dict(critic.value_head.state_dict())
        assert (critic(ids, mask, logits_to_keep=3) - reference(ids, mask, logits_to_keep=3)).abs().max() <= 1e-5


def _stop_rows_early(logits, rows, step):
    """Row r emits the stop token at step r + 1: rows finish at different steps, so the engine compacts."""
    forced = logits.clone()
    stopping = rows + 1 == step
    forced[stopping] = -1e9
    forced[stopping, 2] = 0.0
    return forced


def test_on_qwen2_the_engine_generates_the_same_through_the_fallback(qwen2_dir):
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [20, 21, 22]]
    outputs = {}
    for implementation in ("scalerl", "transformers"):
        model = _load(qwen2_dir, implementation)
        greedy = BuiltinEngine(model, pad_token_id=0).generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
        compacting = BuiltinEngine(model, pad_token_id=0, finish_check_every=1, logits_processor=_stop_rows_early)
        sampled = compacting.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=7,
                                                              stop_token_ids=[2]))
        outputs[implementation] = (greedy, sampled)
    for ours, theirs in zip(outputs["scalerl"], outputs["transformers"]):
        assert torch.equal(ours.response_ids, theirs.response_ids)
        assert torch.equal(ours.response_mask, theirs.response_mask)
        assert (ours.logprobs - theirs.logprobs).abs().max() <= 1e-5
    greedy, sampled = outputs["transformers"]
    assert len(set(greedy.response_ids[0].tolist())) > 1  # not one token repeated
    assert sampled.response_mask.sum(-1).tolist() == [2, 3, 4, 5]  # each row stopped at its own step


def test_a_decoder_of_another_shape_runs_too(tmp_path):
    """GPT-2: blocks under ``h``, ``n_head``-style config names, learned positions, dropout 0.1 by default."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                                     eos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    CharTokenizer().save_pretrained(tmp_path / "gpt2")
    model = _load(tmp_path / "gpt2", "auto")
    assert len(model.layers) == 2 and model.layers is model.hf.transformer.h
    assert (model.config.num_attention_heads, model.config.max_position_embeddings) == (4, 64)
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        assert torch.equal(model.train()(ids, attention_mask=mask), model.eval()(ids, attention_mask=mask))  # no dropout
    _assert_decoding_equals_the_full_forward(model.eval())


def test_sliding_windows_hold_over_the_engines_cache(tmp_path):
    """Mistral with a 4-token window over 12-token prompts: a decode step over the cache must see only the
    window, as the full forward does (a cache ignoring it would see every key)."""
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path / "mistral")
    CharTokenizer().save_pretrained(tmp_path / "mistral")
    model = _load(tmp_path / "mistral", "transformers")
    _assert_decoding_equals_the_full_forward(model)
    ids, mask = _left_padded_batch()
    with torch.no_grad():  # ... and the window does change the logits (else the check above proves nothing)
        windowed = model(ids, attention_mask=mask)
        model.hf.config.sliding_window = None
        assert (model(ids, attention_mask=mask) - windowed).abs().max() > 1e-3


def _assert_decoding_equals_the_full_forward(model):
    """Prefill over the engine's cache, then two one-token steps: the full forward's logits each time."""
    ids, mask = _left_padded_batch()
    cache = KVCache.for_model(model, 3, 16)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, kv_cache=cache, cache_start=0, logits_to_keep=1)[:, -1]
        for step in range(2):
            token = logits.argmax(-1, keepdim=True)
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            logits = model(token, attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1, kv_cache=cache,
                           cache_start=ids.shape[1] - 1)[:, -1]
            assert (logits - model(ids, attention_mask=mask)[:, -1]).abs().max() <= 1e-5, step


def test_auto_takes_scalerls_decoder_where_it_implements_the_architecture():
    assert choose_implementation("auto", "qwen2")[0] == "scalerl"
    implementation, why = choose_implementation("auto", "olmo2")
    assert implementation == "transformers" and "olmo2" in why and "qwen2" in why
    # Known to nobody: scalerl's loader is left to name the field (an error, not transformers' guess).
    assert choose_implementation("auto", "no_such_model")[0] == "scalerl"
    assert choose_implementation("transformers", "qwen2")[0] == "transformers"
    assert choose_implementation("scalerl", "olmo2")[0] == "scalerl"
    with pytest.raises(ConfigError, match="model.implementation"):
        load_config(None, ["model.implementation=hf"])
    with pytest.raises(ConfigError, match="model.implementation=transformers loads a Hugging Face directory"):
        load_model_and_tokenizer(ModelSection(implementation="transformers"), None, torch.device("cpu"), seed=0)


def test_a_fallback_directory_missing_a_tensor_is_an_error_naming_it(olmo2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(olmo2_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    # transformers alone would fill the tensor with random values and only warn.
    with pytest.raises(CheckpointFormatError, match=r"missing keys .*model\.layers\.1\.self_attn\.q_norm\.weight"):
        _load(broken, "auto")


def test_layouts_that_need_scalerls_modules_are_refused_by_name(olmo2_dir, tmp_path):
    problems = transformers_layout_problems(SimpleNamespace(tp=2, pp=2, ep=4), "olmo2")
    assert [p.split(" ")[0] for p in problems] == ["parallel.tp=2", "parallel.pp=2", "parallel.ep=4"]
    assert "tensor parallelism" in problems[0] and "pipeline" in problems[1] and "expert" in problems[2]
    assert "olmo2" in problems[0] and transformers_layout_problems(SimpleNamespace(tp=1, pp=1), "olmo2") == []
    for layout, named in (("parallel.tp=2", "tensor parallelism"), ("parallel.pp=2", "pipeline parallelism")):
        cfg = load_config(None, [f"model.path={olmo2_dir}", layout, f"trainer.output_dir={tmp_path / 'run'}"])
        with pytest.raises(ConfigError, match=rf"{layout} \({named}\) needs scalerl's own decoder modules"):
            check_run_inputs(cfg, import_reward=False)


@pytest.fixture(scope="module")
def single_run(olmo2_dir, tmp_path_factory):
    """Two GRPO steps on the OLMo 2 directory at world 1 (verify's comparable settings): (output dir,
    exported model dir, what it printed at start)."""
    out = tmp_path_factory.mktemp("single")
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        final = run_kind("grpo", [*verification_overrides(STEPS), f"model.path={olmo2_dir}"], out)
    return out, final, printed.getvalue()


def test_an_unimplemented_architecture_falls_back_says_so_and_trains(single_run, olmo2_dir, tmp_path):
    out, final, printed = single_run
    assert f"[scalerl.models] decoder for {olmo2_dir}: transformers (model_type='olmo2' is not one scalerl " \
           "implements" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["actor/grad_norm"] > 0 for r in rows if r["step"] > 0)
    # The export is transformers' own directory, trained away from the start, and loads as OLMo 2.
    start = transformers.AutoModelForCausalLM.from_pretrained(olmo2_dir)
    trained = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert type(trained).__name__ == "Olmo2ForCausalLM"
    start_state, trained_state = start.state_dict(), trained.state_dict()
    assert start_state.keys() == trained_state.keys()
    assert any(not torch.equal(start_state[k], trained_state[k]) for k in start_state)
    # ... and from the checkpoint (`scalerl export`), the same weights; meta.json records the HF config.
    meta = json.loads(next((out / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["model_config"]["model_type"] == "olmo2"
    again = export_checkpoint(out, tmp_path / "exported")
    assert max_weight_diff(final, again) == 0.0
    # The fallback loads its own export again and gives transformers' logits.
    ids, mask = _left_padded_batch()
    wrapper = _load(final, "auto")
    with torch.no_grad():
        expected = trained(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        assert (wrapper(ids, attention_mask=mask) - expected)[mask.bool()].abs().max() <= 1e-5
    # `scalerl generate` runs the exported directory through the fallback too.
    assert len(generate_text(str(final), ["12+3=", "7*8="], max_new_tokens=4, temperature=0.0)) == 2


def test_a_fallback_run_resumes_to_the_weights_of_an_uninterrupted_one(single_run, olmo2_dir, tmp_path):
    from scalerl.trainer.rl_trainer import train

    _, final, _ = single_run
    overrides = [*verification_overrides(STEPS), f"model.path={olmo2_dir}", f"trainer.output_dir={tmp_path}"]
    first = train(load_config(None, [*overrides, "trainer.total_steps=1"]))["final_model"]
    assert max_weight_diff(final, Path(first)) > 10 * TOLERANCE  # one step is far from two
    resumed = train(load_config(None, [*overrides, "trainer.resume=auto"]))
    assert "initial" not in resumed  # it started at step 1, from the checkpoint
    assert max_weight_diff(final, Path(resumed["final_model"])) <= TOLERANCE


def test_sft_and_ppo_with_its_critic_train_through_the_fallback(olmo2_dir, tmp_path):
    overrides = [*verification_overrides(STEPS), f"model.path={olmo2_dir}"]
    sft = run_kind("sft", overrides, tmp_path / "sft")
    assert type(transformers.AutoModelForCausalLM.from_pretrained(sft)).__name__ == "Olmo2ForCausalLM"
    run_kind("ppo", overrides, tmp_path / "ppo")
    rows = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["critic/grad_norm"] > 0 and r["critic/vf_loss"] > 0 for r in rows if r["step"] > 0)


def _distributed_runs(rank, olmo2_dir, out):
    """On each rank of a world-2 group: the same two steps under DDP and under FSDP2 (with activation
    checkpointing), then TP and PP laid out directly, which must refuse with the layouts named."""
    from scalerl.parallel.distributed import init_distributed
    from scalerl.parallel.mesh import LayoutError
    from scalerl.parallel.parallelize import parallelize

    base = [*verification_overrides(STEPS), f"model.path={olmo2_dir}"]
    ddp = run_kind("grpo", [*base, "parallel.dp_replicate=2"], Path(out) / "ddp")
    fsdp = run_kind("grpo", [*base, "parallel.dp_replicate=1", "parallel.dp_shard=2",
                             "model.activation_checkpointing=true"], Path(out) / "fsdp")
    refusals = {}
    for dim in ("tp", "pp"):
        ctx = init_distributed(ParallelSection(dp_replicate=1, **{dim: 2}), torch.device("cpu"))
        try:
            parallelize(_load(olmo2_dir, "auto"), ctx)
        except LayoutError as err:
            refusals[dim] = str(err)
    return str(ddp), str(fsdp), refusals


def test_the_fallback_trains_under_ddp_and_fsdp_like_one_process(single_run, olmo2_dir, tmp_path):
    out, final, _ = single_run
    ranks = run_in_group(_distributed_runs, 2, olmo2_dir, tmp_path, timeout_s=900)
    ddp, fsdp, refusals = ranks[0]
    reference = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["step"] > 0]
    for layout, exported in (("ddp", ddp), ("fsdp", fsdp)):
        metrics = [r for r in map(json.loads, (tmp_path / layout / "metrics.jsonl").read_text().splitlines())
                   if r["step"] > 0]
        assert max_metric_diff(reference, metrics, COMPARED) <= TOLERANCE, layout
        assert max_weight_diff(final, Path(exported)) <= TOLERANCE, layout
        assert type(transformers.AutoModelForCausalLM.from_pretrained(exported)).__name__ == "Olmo2ForCausalLM"
    for rank_refusals in (refusals, ranks[1][2]):
        assert rank_refusals.keys() == {"tp", "pp"}
        assert rank_refusals["tp"].startswith("parallel.tp=2 (tensor parallelism) needs scalerl's own decoder")
        assert rank_refusals["pp"].startswith("parallel.pp=2 (pipeline parallelism) needs scalerl's own decoder")


def test_the_one_save_dispatches_to_the_fallbacks_own_and_refuses_other_modules(olmo2_dir, tmp_path):
    """`scalerl.models.save_pretrained` given a transformers-fallback model writes transformers' own directory
    (it loads with the same logits), and refuses a module it cannot write by type instead of writing a
    directory that loads as another model."""
    model = _load(olmo2_dir, "auto")
    assert isinstance(model, TransformersCausalLM)
    save_pretrained(model, tmp_path / "again", tokenizer=CharTokenizer())
    again = _load(tmp_path / "again", "auto")
    ids, mask = _left_padded_batch()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask), again(ids, attention_mask=mask))
    with pytest.raises(TypeError, match="not a Linear"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    assert not (tmp_path / "linear").exists()
