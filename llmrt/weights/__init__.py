"""Checkpoint loading (random, safetensors directories, GGUF) and tokenizers."""

from llmrt.weights.cache import default_cache_dir
from llmrt.weights.checkpoint import Checkpoint, CheckpointFormat, load_checkpoint
from llmrt.weights.tokenizer import (
    BYTE_BOS_TOKEN_ID,
    BYTE_EOS_TOKEN_ID,
    BYTE_VOCAB_SIZE,
    DetokenizerStream,
    Tokenizer,
    byte_tokenizer,
)
from llmrt.weights.tokenizer_files import load_tokenizer

__all__ = [
    "BYTE_BOS_TOKEN_ID",
    "BYTE_EOS_TOKEN_ID",
    "BYTE_VOCAB_SIZE",
    "Checkpoint",
    "CheckpointFormat",
    "DetokenizerStream",
    "Tokenizer",
    "byte_tokenizer",
    "default_cache_dir",
    "load_checkpoint",
    "load_tokenizer",
]
