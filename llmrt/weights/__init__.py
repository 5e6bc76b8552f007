"""Checkpoint loading (random, safetensors directories, GGUF), the converted-checkpoint
cache, and tokenizers.

May import ``families`` (the registry names GGUF architectures), ``kernels`` (weight
formats), ``device``, ``errors``, ``paths``; never the runtime core or anything above.
"""

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
    "load_checkpoint",
    "load_tokenizer",
]
