"""DeepSeek V4 byte-level BPE tokenizer (exact to HF ``tokenizers`` on the official tokenizer.json)."""

from __future__ import annotations

from ds4_mlx.tokenizer.tokenizer import SPECIAL_STRINGS, AddedToken, Tokenizer
from ds4_mlx.tokenizer.utf8_stream import Utf8StreamDecoder

__all__ = ["AddedToken", "SPECIAL_STRINGS", "Tokenizer", "Utf8StreamDecoder"]
