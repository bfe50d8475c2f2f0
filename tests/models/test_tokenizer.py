"""Tokenizers: the built-in character tokenizer, the Hugging Face wrapper, and agreement with transformers."""

import json

import pytest
import tokenizers
import torch

from scalerl.models.tokenizer import (
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

transformers = pytest.importorskip("transformers")

# Qwen2's simple ChatML template (the one shipped before tool calling was added).
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = ["Q:12+7\nA: #### 19", "Natalia sold 48 clips in April.", "  spaces\tand\nnewlines ~!"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A tiny byte-level BPE (Qwen-style) trained here, saved the way Hugging Face model repos are."""
    directory = tmp_path_factory.mktemp("bpe")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    # Like Qwen2: config.json names a bos id, but tokenizer_config.json's null bos must win.
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 2}))
    return directory


def test_char_tokenizer_layout_and_round_trip():
    tokenizer = CharTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    assert tokenizer.vocab_size == 99 <= 128
    assert tokenizer.encode(" ") == [3] and tokenizer.encode("~") == [97] and tokenizer.encode("\n") == [98]
    for text in TEXTS[:1] + ["a . b , c !"]:
        ids = tokenizer.encode(text)
        assert len(ids) == len(text)
        assert tokenizer.decode(ids) == text
    ids = tokenizer.encode("12") + [tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert tokenizer.decode(ids) == "12"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "12<eos><pad>"
    assert tokenizer.batch_decode(torch.tensor([ids, ids])) == ["12", "12"]


def test_char_tokenizer_unknown_character_names_it():
    with pytest.raises(ValueError, match="'é'"):
        CharTokenizer().encode("café")


def test_char_tokenizer_chat_template_concatenates():
    messages = [{"role": "system", "content": "S:"}, {"role": "user", "content": "Q:1+2\nA:"}]
    assert CharTokenizer().apply_chat_template(messages) == "S:Q:1+2\nA:"


def test_char_tokenizer_files_load_in_tokenizers_and_transformers(tmp_path):
    tokenizer = CharTokenizer()
    tokenizer.save_pretrained(tmp_path)
    text = "Q:12+7\nA: #### 19 ~{}"
    expected = tokenizer.encode(text)
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == expected
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert fast.encode(text, add_special_tokens=False) == expected
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.eos_token_id == 2 and auto.pad_token_id == 0 and auto.bos_token_id == 1
    assert auto.decode(expected) == text
    messages = [{"role": "user", "content": "Q:3+4\nA:"}]
    assert auto.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(messages)
    reloaded = load_tokenizer(str(tmp_path))
    assert reloaded.encode(text) == expected and reloaded.eos_token_id == 2
    with pytest.raises(ValueError, match="cannot encode"):
        reloaded.encode("é")


def test_hf_tokenizer_matches_transformers(bpe_dir):
    ours = load_tokenizer(str(bpe_dir))
    assert isinstance(ours, HFTokenizer) and isinstance(ours, Tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_id == theirs.eos_token_id == 2
    assert ours.pad_token_id == theirs.pad_token_id == 0
    assert ours.bos_token_id is None and ours.stop_token_ids == [2, 0]
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids)
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}],
    ):
        for add_generation_prompt in (True, False):
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == (
                theirs.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
            )


def test_hf_tokenizer_save_round_trip_and_pad_fallback(bpe_dir, tmp_path):
    config = json.loads((bpe_dir / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "tokenizer.json").write_text((bpe_dir / "tokenizer.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2
    tokenizer.save_pretrained(tmp_path / "saved")
    again = load_tokenizer(tmp_path / "saved")
    assert again.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])
    assert again.apply_chat_template([{"role": "user", "content": "x"}]) == tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )


def test_chat_template_helpers_and_errors(bpe_dir, tmp_path):
    tokenizer = load_tokenizer(bpe_dir)
    tokenizer.chat_template = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}" \
        "{{ messages[0] | tojson }}"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "<é>"}]) == '{"role": "user", "content": "<é>"}'
    with pytest.raises(Exception, match="one message only"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 2)
    with pytest.raises(ValueError, match="'content'"):
        tokenizer.apply_chat_template([{"role": "user"}])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}])


def test_load_tokenizer_errors_name_the_path(tmp_path):
    assert isinstance(load_tokenizer(None), CharTokenizer)
    assert isinstance(load_tokenizer("builtin"), CharTokenizer)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="Qwen/Qwen2.5-0.5B"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")


def test_prompts_through_the_chat_template(bpe_dir):
    from scalerl.data.prompts import encode_prompts

    tokenizer = load_tokenizer(bpe_dir)
    plain = encode_prompts(tokenizer, ["Q:12+7"])[0]
    chat = encode_prompts(tokenizer, ["Q:12+7"], chat_template=True)[0]
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_dir / "tokenizer.json"))
    expected = theirs.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Q:12+7"}], add_generation_prompt=True),
        add_special_tokens=False,
    )
    assert chat == expected and chat != plain
    assert tokenizer.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
