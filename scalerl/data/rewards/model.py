"""A reward model: a Hugging Face sequence-classification checkpoint scoring prompt + response, in batches on
the trainer's ranks (`data.reward_model.*`, docs/configuration.md#reward-model).

The checkpoint is a Qwen2/Llama `*ForSequenceClassification` directory with one label, as
`AutoModelForSequenceClassification.save_pretrained` writes it: the decoder's `model.*` tensors and the head
`score.weight` [1, hidden], no `lm_head`. It runs in scalerl's own decoder (`CausalLM(..., return_hidden=True)`
gives the final normed hidden states) with the head on top, in eval mode and without gradients, on the
device given (the trainer's). Each data-parallel rank holds a whole copy and scores its own samples.

The score is the head's output at the position transformers' `GenericForSequenceClassification` reads: the
rightmost token that is not the checkpoint's `pad_token_id` (config.json's, not the tokenizer's), so a pad
token at the end of the text itself is passed over as there; with no `pad_token_id`, the last token.

What the model reads, in its own tokenizer (`data.reward_model.tokenizer`, default the checkpoint's directory):
a text prompt is its BOS (when it has one) + the prompt and the decoded response as one text; chat messages
(and text prompts under `data.chat_template=true`) are the conversation with the response as the assistant's
turn, rendered by its chat template without a generation prompt, as reward models are trained and served.

A sample longer than `data.reward_model.max_length` (default: the checkpoint's positions) is an error naming
its length and the option, not truncated: a cut input would get a score the model was never trained to give.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from scalerl.data.errors import DataError
from scalerl.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from scalerl.models.decoder import CausalLM
from scalerl.models.hf_checkpoint import (
    CONFIG_FILE,
    CheckpointFormatError,
    checkpoint_weight_files,
    model_config_from_hf,
    read_json_file,
)
from scalerl.models.tokenizer import TokenizerNotFound, load_tokenizer

# Qwen2ForSequenceClassification, LlamaForSequenceClassification, ... : one per decoder scalerl loads.
SEQUENCE_CLASSIFICATION_ARCHITECTURES = {
    model_type: name.replace("ForCausalLM", "ForSequenceClassification")
    for model_type, name in SUPPORTED_ARCHITECTURES.items()
}
SCORE_TENSOR = "score.weight"
_IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never loaded (as hf_checkpoint does)


def reward_model_config(path: str | Path) -> ModelConfig:
    """The decoder's settings of a sequence-classification checkpoint; a causal LM, another architecture or
    other than one label is a CheckpointFormatError naming the field."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointFormatError(f"{config_path} not found: data.reward_model.path needs a model directory "
                                    f"with {CONFIG_FILE}")
    raw = read_json_file(config_path, "model config")
    if not isinstance(raw, dict):
        raise CheckpointFormatError(f"{config_path} must hold a JSON object of model settings")
    model_type, architectures = raw.get("model_type"), raw.get("architectures")
    expected = SEQUENCE_CLASSIFICATION_ARCHITECTURES.get(model_type)
    if expected is None or architectures != [expected]:
        raise CheckpointFormatError(
            f"{config_path}: architectures={architectures} (model_type={model_type!r}) is not a reward model "
            f"scalerl loads: data.reward_model.path needs one of {sorted(SEQUENCE_CLASSIFICATION_ARCHITECTURES.values())}"
            " with one label, as AutoModelForSequenceClassification.save_pretrained writes it")
    id2label = raw.get("id2label")
    labels = len(id2label) if isinstance(id2label, dict) else raw.get("num_labels", 2)  # transformers' default: 2
    if labels != 1:
        raise CheckpointFormatError(f"{config_path}: num_labels={labels} (id2label={id2label}); a reward model gives "
                                    "one score per sequence: save it with num_labels=1")
    return model_config_from_hf({**raw, "architectures": [SUPPORTED_ARCHITECTURES[model_type]]}, str(config_path))


def load_reward_weights(path: str | Path, cfg: ModelConfig, dtype: torch.dtype,
                        device: torch.device | str) -> tuple[CausalLM, nn.Linear]:
    """The decoder (without its `lm_head`) and the score head of checkpoint `path`, in `dtype` on `device`;
    a missing, unexpected or misshapen tensor is a CheckpointFormatError naming it."""
    path = Path(path)
    cfg.torch_dtype = str(dtype).removeprefix("torch.")
    with torch.device("meta"):
        decoder = CausalLM(cfg)
        head = nn.Linear(cfg.hidden_size, 1, bias=False)
    decoder.lm_head = None  # the hidden states are all a reward model needs
    expected = {f"model.{name}": tensor for name, tensor in decoder.state_dict().items()}
    expected[SCORE_TENSOR] = head.weight
    loaded: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for file in checkpoint_weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in expected:
                        if not name.endswith(_IGNORED_TENSOR_SUFFIXES):
                            unexpected.append(f"{name} (in {file.name})")
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        what = " (the score head: [num_labels=1, hidden_size])" if name == SCORE_TENSOR else ""
                        raise CheckpointFormatError(f"tensor {name}{what} in {file.name} has shape "
                                                    f"{tuple(tensor.shape)}, but config.json implies "
                                                    f"{tuple(expected[name].shape)}")
                    loaded[name] = tensor.to(dtype)
        except (SafetensorError, OSError) as err:
            raise CheckpointFormatError(f"{file} is not a readable safetensors file: {err}; it is probably "
                                        "truncated or empty - copy or save the reward model again") from None
    if SCORE_TENSOR not in loaded:
        raise CheckpointFormatError(f"tensor {SCORE_TENSOR} (the reward head, [1, hidden_size]) is missing from "
                                    f"{path}: data.reward_model.path needs a sequence-classification checkpoint, "
                                    "not a causal LM's or a bare decoder's")
    if unexpected:
        raise CheckpointFormatError(f"unexpected tensors in reward model {path}: {unexpected[:10]}")
    missing = [name for name in expected if name not in loaded]
    if missing:
        raise CheckpointFormatError(f"tensors missing from reward model {path}: {missing[:10]}"
                                    + (" ..." if len(missing) > 10 else ""))
    decoder, head = decoder.to_empty(device=device), head.to_empty(device=device)
    decoder.load_state_dict({name[len("model."):]: t for name, t in loaded.items() if name != SCORE_TENSOR})
    head.load_state_dict({"weight": loaded[SCORE_TENSOR]})
    return decoder.eval().requires_grad_(False), head.eval().requires_grad_(False)


class RewardModel:
    """Scores (prompt, response) pairs with a sequence-classification checkpoint (see the module's docstring).

    `micro_batch_size` sequences go through one forward pass, shortest first so that padding stays small;
    `max_length` (None: the checkpoint's positions) is the longest input accepted; `chat_template` renders
    text prompts as a user message, as `data.chat_template` does for the policy.
    """

    def __init__(self, path: str | Path, *, device: torch.device | str = "cpu", dtype: str = "float32",
                 micro_batch_size: int = 8, max_length: int | None = None, tokenizer: str | Path | None = None,
                 chat_template: bool = False):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.path = Path(path)
        self.config = reward_model_config(self.path)
        positions = self.config.max_position_embeddings
        if max_length is not None and max_length > positions:
            raise CheckpointFormatError(f"data.reward_model.max_length={max_length} exceeds the "
                                        f"{positions} positions (max_position_embeddings) of reward model {path}")
        self.max_length = max_length or positions
        self.micro_batch_size, self.chat_template = micro_batch_size, chat_template
        self.pad_token_id = self.config.pad_token_id  # what transformers reads the score position by
        self.device = torch.device(device)
        self.tokenizer = _reward_tokenizer(tokenizer or self.path, self.config.vocab_size)
        self.decoder, self.head = load_reward_weights(self.path, self.config, getattr(torch, dtype), self.device)

    def encode(self, prompt: str | list[dict], response: str) -> list[int]:
        """The reward model's token ids of `prompt` answered by `response`."""
        if isinstance(prompt, list) or self.chat_template:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            if self.tokenizer.chat_template is None:
                raise DataError(f"reward model tokenizer {self.tokenizer.name_or_path!r} has no chat template, which "
                                "chat-message prompts (or data.chat_template=true) need: give it one "
                                "(tokenizer_config.json's chat_template), or give text prompts")
            conversation = [*messages, {"role": "assistant", "content": response}]
            return self.tokenizer.encode(self.tokenizer.apply_chat_template(conversation, add_generation_prompt=False))
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(prompt + response)

    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response)."""
        if len(prompts) != len(responses):
            raise ValueError(f"got {len(prompts)} prompts but {len(responses)} responses")
        return self.score_ids([self.encode(p, r) for p, r in zip(prompts, responses)])

    @torch.no_grad()
    def score_ids(self, sequences: Sequence[Sequence[int]]) -> list[float]:
        """One score per token sequence (no padding in them)."""
        for index, ids in enumerate(sequences):
            if not ids:
                raise DataError(f"reward model input {index} has no tokens (an empty prompt and response)")
            if len(ids) > self.max_length:
                raise DataError(
                    f"reward model input {index} (prompt + response) has {len(ids)} tokens, more than "
                    f"data.reward_model.max_length={self.max_length}; raise data.reward_model.max_length (up to "
                    f"the checkpoint's {self.config.max_position_embeddings} positions) or shorten the prompts "
                    "(data.max_prompt_length) or the responses (rollout.max_new_tokens)")
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        scores = [0.0] * len(sequences)
        for start in range(0, len(order), self.micro_batch_size):
            chunk = order[start:start + self.micro_batch_size]
            for index, value in zip(chunk, self._forward([sequences[i] for i in chunk])):
                scores[index] = value
        return scores

    def _forward(self, sequences: list[Sequence[int]]) -> list[float]:
        lengths = [len(ids) for ids in sequences]
        width = max(lengths)
        pad = self.pad_token_id if self.pad_token_id is not None else 0
        input_ids = torch.full((len(sequences), width), pad, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, :len(ids)] = torch.tensor(list(ids), dtype=torch.long)
            attention_mask[row, :len(ids)] = 1
        padded = min(lengths) != width
        hidden = self.decoder(input_ids.to(self.device), attention_mask=attention_mask.to(self.device) if padded
                              else None, return_hidden=True)
        positions = score_positions(input_ids, lengths, self.pad_token_id).to(self.device)
        picked = hidden[torch.arange(len(sequences), device=self.device), positions]
        return self.head(picked).float()[:, 0].tolist()


def score_positions(input_ids: torch.Tensor, lengths: Sequence[int], pad_token_id: int | None) -> torch.Tensor:
    """The position each right-padded row is scored at, as transformers picks it: the rightmost token that is
    not `pad_token_id` (position 0 when every token is), or with no pad id the row's last token."""
    if pad_token_id is None:
        return torch.tensor([length - 1 for length in lengths], dtype=torch.long)
    not_pad = (input_ids != pad_token_id).to(torch.int32)
    return (torch.arange(input_ids.shape[-1], dtype=torch.int32) * not_pad).argmax(-1).long()


def _reward_tokenizer(source: str | Path, vocab_size: int) -> Any:
    if not (Path(source) / "tokenizer.json").is_file():
        raise TokenizerNotFound(f"reward model tokenizer {str(source)!r} has no tokenizer.json: save the tokenizer "
                                "with the reward model, or set data.reward_model.tokenizer=<directory with "
                                "tokenizer.json>")
    tokenizer = load_tokenizer(source)
    if tokenizer.vocab_size > vocab_size:
        raise CheckpointFormatError(f"reward model tokenizer {str(source)!r} has {tokenizer.vocab_size} tokens, more "
                                    f"than the reward model's vocab_size={vocab_size}: it belongs to another model")
    return tokenizer


def reward_model_from_config(model_cfg: Any, chat_template: bool = False,
                             device: torch.device | str = "cpu") -> RewardModel | None:
    """The reward model a `data.reward_model` section names, on `device`; None without a path."""
    if not model_cfg.path:
        return None
    return RewardModel(model_cfg.path, device=device, dtype=model_cfg.dtype,
                       micro_batch_size=model_cfg.micro_batch_size, max_length=model_cfg.max_length,
                       tokenizer=model_cfg.tokenizer, chat_template=chat_template)
