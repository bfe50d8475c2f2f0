"""Tokenizers: one small interface, a built-in character tokenizer, and a wrapper for Hugging Face files.

Everything outside this module talks to a tokenizer through the `Tokenizer` protocol:
`vocab_size`, `pad_token_id`, `eos_token_id`, `bos_token_id`, `stop_token_ids`, `encode`, `decode`,
`batch_decode`, `apply_chat_template`, `save_pretrained`.

- `CharTokenizer` is the built-in character-level tokenizer for the built-in arithmetic task (no files,
  no downloads). Its `save_pretrained` writes a standard `tokenizer.json` + `tokenizer_config.json`, so
  a checkpoint trained with it loads in `tokenizers`, in `transformers` and back through `load_tokenizer`
  with the same ids.
- `HFTokenizer` reads a Hugging Face tokenizer directory (`tokenizer.json`, `tokenizer_config.json`,
  and the ids in `generation_config.json` / `config.json` when present) with the `tokenizers` library
  only; chat templates are rendered with jinja2 in a sandbox, the way `transformers` renders them.
- `load_tokenizer(path_or_name)` picks one of the two.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import tokenizers as hf_tokenizers

from scalerl.core.errors import UserError

BUILTIN_TOKENIZER_NAME = "builtin"

# Plain concatenation of the message contents: the built-in task has no roles to mark, and a template
# that adds nothing keeps the character-level prompts as short as possible.
CHAR_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


class TokenizerError(UserError, ValueError):
    """A tokenizer that cannot be loaded, or text it cannot encode; the message names the file or the text."""


class TokenizerNotFound(TokenizerError, FileNotFoundError):
    """No tokenizer.json where one was expected."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the trainer, the rollout engines and the data code need from a tokenizer."""

    vocab_size: int
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None
    stop_token_ids: list[int]  # every id that ends a generation (eos plus e.g. Qwen's <|endoftext|>)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def batch_decode(self, list_of_ids: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str: ...

    def save_pretrained(self, directory: str | Path) -> None: ...


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat template that `transformers` keeps beside it.

    Build one with `HFTokenizer.from_pretrained(directory)`; the constructor takes the parts directly.
    """

    def __init__(
        self,
        backend: hf_tokenizers.Tokenizer,
        *,
        eos_token_id: int,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        stop_token_ids: Sequence[int] = (),
        tokenizer_config: dict[str, Any] | None = None,
        name_or_path: str = "",
    ):
        self.backend = backend
        self.name_or_path = name_or_path
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = eos_token_id
        # Many base models ship without a pad token; padding positions are masked out anyway, so eos is safe.
        self.pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
        self.bos_token_id = bos_token_id
        self.stop_token_ids = list(dict.fromkeys([eos_token_id, *stop_token_ids]))
        self.chat_template = chat_template
        self._tokenizer_config = dict(tokenizer_config or {})
        for name, token_id in [("eos", eos_token_id), ("pad", self.pad_token_id), ("bos", bos_token_id)]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise TokenizerError(
                    f"{name}_token_id={token_id} is outside the vocabulary (size {self.vocab_size}) of "
                    f"tokenizer {name_or_path!r}; fix the id in its tokenizer_config.json/generation_config.json"
                )

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "HFTokenizer":
        """Read `tokenizer.json`, `tokenizer_config.json` and, when present, `generation_config.json`/`config.json`."""
        directory = Path(directory)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerNotFound(_missing_tokenizer_message(str(directory)))
        try:
            backend = hf_tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # e.g. a file written by a newer `tokenizers` than the installed one
            raise TokenizerError(
                f"{tokenizer_file} cannot be loaded by tokenizers {hf_tokenizers.__version__}: {error}"
            ) from error
        tokenizer_config = _read_json(directory / "tokenizer_config.json")
        generation_config = _read_json(directory / "generation_config.json")
        model_config = _read_json(directory / "config.json")

        def token_id(field: str) -> int | None:
            """The id of a special token named in tokenizer_config.json, else the id in the other configs.

            A field that tokenizer_config.json sets to null stays None (Qwen2 has `"bos_token": null`
            although its config.json names a bos id that the model never sees at the start).
            """
            if field in tokenizer_config and tokenizer_config[field] is None:
                return None
            token = _token_content(tokenizer_config.get(field))
            if token is not None:
                found = backend.token_to_id(token)
                if found is None:
                    raise TokenizerError(
                        f"{directory / 'tokenizer_config.json'}: {field}={token!r} is not in {tokenizer_file}; "
                        f"fix the token or remove the field"
                    )
                return found
            id_field = field.replace("_token", "_token_id")
            for config in (generation_config, model_config):
                value = config.get(id_field)
                if isinstance(value, list):  # generation_config may list several eos ids
                    value = value[0] if value else None
                if value is not None:
                    return int(value)
            return None

        eos_token_id = token_id("eos_token")
        if eos_token_id is None:
            raise TokenizerError(
                f"no eos token found for tokenizer {directory}: set eos_token in tokenizer_config.json "
                f"or eos_token_id in generation_config.json"
            )
        stop_ids = [*_as_id_list(generation_config.get("eos_token_id")), *_as_id_list(model_config.get("eos_token_id"))]
        return cls(
            backend,
            eos_token_id=eos_token_id,
            pad_token_id=token_id("pad_token"),
            bos_token_id=token_id("bos_token"),
            chat_template=_read_chat_template(directory, tokenizer_config),
            stop_token_ids=stop_ids,
            tokenizer_config=tokenizer_config,
            name_or_path=str(directory),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added (special-token strings in `text` do map)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=False).ids
        except Exception as error:  # the Rust side only says e.g. "Missing [UNK] token"; name the text too
            raise TokenizerError(f"tokenizer {self.name_or_path!r} cannot encode {text[:80]!r}: {error}") from error

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (a list, or anything with `.tolist()` such as a tensor)."""
        return self.backend.decode(_as_int_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, list_of_ids: Iterable[Iterable[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` for each sequence, in one call into the Rust library."""
        if hasattr(list_of_ids, "tolist"):
            list_of_ids = list_of_ids.tolist()
        batch = [_as_int_list(ids) for ids in list_of_ids]
        return self.backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def token_string(self, token_id: int | None) -> str | None:
        """The string of a special token id, as chat templates expect (`eos_token`, `bos_token`, ...)."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the tokenizer's chat template.

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3), as in
        `transformers`' `apply_chat_template(..., tokenize=False)`.
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"tokenizer {self.name_or_path!r} has no chat template: add `chat_template` to its "
                f"tokenizer_config.json (or a chat_template.jinja file), or use plain prompts"
            )
        _check_messages(messages)
        variables = {
            "bos_token": self.token_string(self.bos_token_id),
            "eos_token": self.token_string(self.eos_token_id),
            "pad_token": self.token_string(self.pad_token_id),
            "unk_token": _token_content(self._tokenizer_config.get("unk_token")),
            **kwargs,
        }
        return render_chat_template(self.chat_template, messages, add_generation_prompt, variables)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (loadable by `transformers` and `load_tokenizer`)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = dict(self._tokenizer_config)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["eos_token"] = self.token_string(self.eos_token_id)
        config["pad_token"] = self.token_string(self.pad_token_id)
        config["bos_token"] = self.token_string(self.bos_token_id)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name_or_path!r}, vocab_size={self.vocab_size})"


class CharTokenizer(HFTokenizer):
    """Built-in character tokenizer: `<pad>`=0, `<bos>`=1, `<eos>`=2, then ASCII space..`~`, then `\\n` (99 ids).

    One character is one token, so ids are easy to read in tests and the vocabulary stays under 128.
    Characters outside that set raise a `ValueError` naming the character. The chat template is plain
    concatenation of the message contents (roles are dropped). Internally it is an ordinary
    `tokenizers` WordLevel model whose pre-tokenizer isolates every character, which is exactly what
    `save_pretrained` writes, so the saved files give the same ids everywhere.
    """

    SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
    CHARACTERS = tuple(chr(code) for code in range(ord(" "), ord("~") + 1)) + ("\n",)

    def __init__(self) -> None:
        vocab = {token: index for index, token in enumerate(self.SPECIAL_TOKENS + self.CHARACTERS)}
        # unk_token is deliberately absent from the vocab: unknown text must fail, never become a silent <unk>.
        backend = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = hf_tokenizers.pre_tokenizers.Split(
            hf_tokenizers.Regex(r"[\s\S]"), behavior="isolated"
        )
        backend.decoder = hf_tokenizers.decoders.Fuse()  # join characters without the default spaces
        backend.add_special_tokens(list(self.SPECIAL_TOKENS))
        self._known_characters = frozenset(self.CHARACTERS)
        super().__init__(
            backend,
            eos_token_id=vocab["<eos>"],
            pad_token_id=vocab["<pad>"],
            bos_token_id=vocab["<bos>"],
            chat_template=CHAR_CHAT_TEMPLATE,
            # transformers would otherwise "clean up" spaces before punctuation when decoding.
            tokenizer_config={"clean_up_tokenization_spaces": False, "model_max_length": 1_000_000},
            name_or_path=BUILTIN_TOKENIZER_NAME,
        )

    def encode(self, text: str) -> list[int]:
        """One id per character; raises `ValueError` naming the first character outside the vocabulary."""
        if isinstance(text, str):
            for position, character in enumerate(text):
                if character not in self._known_characters:
                    raise TokenizerError(
                        f"the built-in character tokenizer has no token for {character!r} (U+{ord(character):04X}) "
                        f"at position {position} of {text[:80]!r}; it knows printable ASCII and '\\n' only - "
                        f"clean the text or use a Hugging Face tokenizer (model.tokenizer=<directory>)"
                    )
        return super().encode(text)


def load_tokenizer(path_or_name: str | Path | None) -> HFTokenizer:
    """`None` or `"builtin"` -> `CharTokenizer`; a directory holding `tokenizer.json` -> `HFTokenizer`.

    A path to a `tokenizer.json` file is accepted too. Anything else raises `FileNotFoundError` naming
    the path and the missing file (hub names are not downloaded: fetch them first, e.g. with
    `huggingface-cli download <name> --local-dir <dir>`).
    """
    if path_or_name is None or str(path_or_name) == BUILTIN_TOKENIZER_NAME:
        return CharTokenizer()
    path = Path(path_or_name)
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    return HFTokenizer.from_pretrained(path)


def render_chat_template(
    template: str, messages: list[dict], add_generation_prompt: bool, variables: dict[str, Any]
) -> str:
    """Render a Hugging Face chat template the way `transformers` does.

    Same jinja2 setup: an immutable sandbox (templates come from downloaded files, so they must not
    reach Python internals), `trim_blocks`/`lstrip_blocks`, loop controls, and the `raise_exception`,
    `strftime_now` and `tojson` helpers. The `{% generation %}` tag (assistant-mask tracking) is not
    supported.
    """
    return _compile_chat_template(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **variables
    )


@lru_cache(maxsize=16)
def _compile_chat_template(template: str) -> Any:
    # Imported here so only code that renders templates pays for loading jinja2.
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which would change the prompt text.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)


def _missing_tokenizer_message(path: str) -> str:
    location = Path(path)
    if not location.exists():
        return (
            f"tokenizer {path!r} is neither 'builtin' nor an existing directory: expected a directory with "
            f"tokenizer.json (download a hub model first, e.g. `huggingface-cli download {path} --local-dir DIR`)"
        )
    hint = ""
    if (location / "tokenizer.model").is_file():
        hint = (
            "; it has a sentencepiece tokenizer.model - convert it once with "
            "`transformers.AutoTokenizer.from_pretrained(dir).save_pretrained(dir)`"
        )
    return f"tokenizer directory {path!r} has no tokenizer.json{hint}"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        content = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as error:
        raise TokenizerError(f"{path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(content, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(content).__name__}")
    return content


def _read_chat_template(directory: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """The chat template: `chat_template.jinja` (newer transformers) or `tokenizer_config.json`'s field."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template


def _token_content(value: Any) -> str | None:
    """A special token as written in tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(item) for item in value] if isinstance(value, list) else [int(value)]


def _as_int_list(ids: Iterable[int]) -> list[int]:
    if hasattr(ids, "tolist"):  # torch tensors and numpy arrays
        ids = ids.tolist()
    return [int(token_id) for token_id in ids]


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(isinstance(message, dict) for message in messages):
        raise TypeError(
            f"messages must be a list of dicts like {{'role': 'user', 'content': '...'}}, got {messages!r:.120}"
        )
    for index, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ValueError(f"messages[{index}] = {message!r:.120} needs both 'role' and 'content'")


__all__ = [
    "BUILTIN_TOKENIZER_NAME",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "TokenizerError",
    "TokenizerNotFound",
    "load_tokenizer",
]
