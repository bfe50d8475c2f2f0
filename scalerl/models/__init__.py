"""The built-in decoder (Qwen2/3, Llama, Mistral, Gemma 2/3: docs/models.md), Hugging Face checkpoint interop,
and tokenizers."""

from scalerl.models.config import ModelConfig
from scalerl.models.decoder import CausalLM, build_model
from scalerl.models.hf_checkpoint import (
    CheckpointFormatError,
    from_pretrained,
    save_pretrained,
)
from scalerl.models.kv_cache import KVCache
from scalerl.models.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "CausalLM", "CharTokenizer", "CheckpointFormatError", "HFTokenizer", "KVCache", "ModelConfig", "build_model",
    "from_pretrained", "load_tokenizer", "save_pretrained",
]
