"""Chat templates of the Qwen2.5, Qwen3 and Llama 3 families, written here in their published shape (not
downloaded), on a character-level tokenizer whose special tokens are the families' own, so the tests see
the template text those models see: Qwen's newline after ``<|im_end|>``, tool results grouped into one user
turn by Qwen, ``<think>`` blocks stripped from earlier turns by Qwen3, Llama 3's ``<|eot_id|>`` with no glue."""

from __future__ import annotations

import tokenizers as hf_tokenizers

from scalerl.models.tokenizer import CharTokenizer, HFTokenizer

QWEN25 = (
    "{%- if tools %}<|im_start|>system\nYou may call tools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3: an assistant turn's <think>...</think> is dropped from turns before the last user query.
QWEN3 = QWEN25.replace(
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}",
    "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n"
    "{{ message.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}")
LLAMA3 = (
    "<|begin_of_text|>{%- for message in messages %}<|start_header_id|>{{ 'ipython' if message.role == 'tool' "
    "else message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = {"qwen": ["<|im_start|>", "<|im_end|>"],
            "llama": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]}


def chat_tokenizer(template: str) -> HFTokenizer:
    """Characters (the built-in set) plus the family's special tokens; its end-of-turn token is the eos."""
    family = "llama" if template is LLAMA3 else "qwen"
    specials = ["<pad>", "<bos>", *SPECIALS[family]]
    vocab = {t: i for i, t in enumerate(specials + list(CharTokenizer.CHARACTERS))}
    backend = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = hf_tokenizers.pre_tokenizers.Split(hf_tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = hf_tokenizers.decoders.Fuse()
    backend.add_special_tokens(specials)
    eot = vocab["<|eot_id|>" if family == "llama" else "<|im_end|>"]
    return HFTokenizer(backend, eos_token_id=eot, pad_token_id=0, bos_token_id=None, chat_template=template,
                       name_or_path=f"test-{family}")
