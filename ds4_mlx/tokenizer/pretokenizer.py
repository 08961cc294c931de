"""Pre-tokenizer: cut text into pieces that BPE then encodes independently.

It reproduces the HF ``tokenizers`` semantics of a ``Sequence`` of ``Split`` steps with behaviour
``Isolated``: each step runs its regex over every piece produced by the previous step (a regex never
sees across a piece boundary, so look-aheads such as ``(?!\\S)`` stop at the piece end), every match
becomes a piece and so does every stretch of text between matches. The final ``ByteLevel`` step
(``use_regex: false``) only changes the alphabet and is done by ``byte_map``.

The truth for DeepSeek V4 is its HF ``tokenizer.json``; ds4.c hand-codes an approximation that
differs on some inputs (see tests/test_tokenizer_ds4_divergence.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import regex

from ds4_mlx.errors import TokenizerError
from ds4_mlx.tokenizer.class_remap import deepseek_remap

# DeepSeek V3 / V4 (GGUF ``tokenizer.ggml.pre`` "deepseek-v3", "joyai-llm"): the three Split regexes
# of the official tokenizer.json, in order. \r and \n are the literal characters.
DEEPSEEK_V4_PATTERNS: tuple[str, ...] = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # CJK ideographs, hiragana, katakana
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*"
    "|\\s*[\r\n]+"
    "|\\s+(?!\\S)"
    "|\\s+",
)

# GGUF pre-tokenizer names that mean the patterns above.
GGUF_PRE_PATTERNS: dict[str, tuple[str, ...]] = {
    "joyai-llm": DEEPSEEK_V4_PATTERNS,
    "deepseek-v3": DEEPSEEK_V4_PATTERNS,
}


class PreTokenizer:
    """Sequential isolating regex splits (HF ``Split`` with ``behavior: Isolated``, ``invert: false``)."""

    def __init__(self, patterns: Sequence[str]):
        self.patterns = tuple(patterns)
        compiled = []
        for i, p in enumerate(self.patterns):
            try:
                compiled.append(regex.compile(p))
            except regex.error as exc:
                raise TokenizerError(f"pre-tokenizer regex #{i} {p!r} does not compile: {exc}") from None
        self._compiled = tuple(compiled)
        # For the DeepSeek patterns, characters that ``regex`` and HF classify differently are
        # matched through stand-ins (class_remap.py). Other pattern sets get ``regex``'s tables.
        self._remap = deepseek_remap() if self.patterns == DEEPSEEK_V4_PATTERNS else None

    def split(self, text: str) -> list[str]:
        return [text[a:b] for a, b in self.split_spans(text)]

    def split_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of every piece, in order; together they cover ``text`` exactly."""
        subject = text
        if self._remap is not None and not text.isascii():
            subject = text.translate(self._remap)
        spans = [(0, len(text))] if text else []
        for rx in self._compiled:
            out: list[tuple[int, int]] = []
            for lo, hi in spans:
                # the piece on its own, as HF matches it: anchors and look-arounds end at its edges
                piece = subject[lo:hi]
                pos = 0
                for m in rx.finditer(piece):
                    start, end = m.span()
                    if start == end:
                        continue  # HF drops empty matches; none of the DeepSeek patterns can produce one
                    if start > pos:
                        out.append((lo + pos, lo + start))
                    out.append((lo + start, lo + end))
                    pos = end
                if lo + pos < hi:
                    out.append((lo + pos, hi))
            spans = out
        return spans

    @classmethod
    def from_hf_config(cls, config: Any) -> PreTokenizer:
        """Build from a tokenizer.json ``pre_tokenizer`` object (only the shapes DeepSeek uses)."""
        steps = _flatten(config)
        patterns: list[str] = []
        saw_byte_level = False
        for i, step in enumerate(steps):
            kind = step.get("type") if isinstance(step, dict) else None
            where = f"pre_tokenizer step #{i} ({kind})"
            if kind == "Split":
                pattern = step.get("pattern") or {}
                if "Regex" not in pattern:
                    raise TokenizerError(f"{where}: only Regex split patterns are supported, got {pattern!r}")
                if step.get("behavior") != "Isolated" or step.get("invert"):
                    raise TokenizerError(
                        f"{where}: only behavior 'Isolated' without invert is supported, got "
                        f"behavior={step.get('behavior')!r} invert={step.get('invert')!r}")
                if saw_byte_level:
                    raise TokenizerError(f"{where}: a Split after ByteLevel is not supported")
                patterns.append(pattern["Regex"])
            elif kind == "ByteLevel":
                if step.get("use_regex") or step.get("add_prefix_space"):
                    raise TokenizerError(
                        f"{where}: ByteLevel with use_regex/add_prefix_space is not supported")
                saw_byte_level = True
            else:
                raise TokenizerError(f"{where}: unsupported pre-tokenizer type")
        if not saw_byte_level:
            raise TokenizerError("pre_tokenizer has no ByteLevel step: not a byte-level BPE tokenizer")
        return cls(patterns)


def _flatten(config: Any) -> list[Any]:
    if not isinstance(config, dict):
        raise TokenizerError(f"pre_tokenizer must be an object, got {type(config).__name__}")
    if config.get("type") == "Sequence":
        steps = config.get("pretokenizers")
        if not isinstance(steps, list):
            raise TokenizerError("pre_tokenizer Sequence has no 'pretokenizers' list")
        out: list[Any] = []
        for s in steps:
            out.extend(_flatten(s))
        return out
    return [config]
