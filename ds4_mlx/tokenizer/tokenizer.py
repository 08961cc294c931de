"""The DeepSeek V4 tokenizer: byte-level BPE with the official pre-tokenizer.

Built from GGUF metadata (``tokenizer.ggml.*``) or from an HF ``tokenizer.json``. Three ways in:

* ``encode(text)``: plain text, no special-token recognition (ds4's plain-text APIs: user content,
  system text). Equals HF ``encode(text, add_special_tokens=False)`` on text containing no added-token
  string.
* ``encode_rendered(text)``: a rendered prompt; exactly ds4's 7 special strings (BOS, EOS, User,
  Assistant, ``<think>``, ``</think>``, ``｜DSML｜``) become their ids, everything between is BPE'd
  (spec §11.4). Other added tokens such as ``<｜fim▁hole｜>`` or ``<｜tool▁calls▁begin｜>`` stay text.
* ``encode_hf_compatible(text)``: what HF ``encode(text, add_special_tokens=False)`` returns: every
  added token of the vocabulary (1,283 for V4: the specials, ``<｜place▁holder…｜>``, FIM, table
  markers, ...) is cut out, in HF's two passes (see added_tokens.py). It differs from
  ``encode_rendered`` only on text containing such other added-token strings.

Memory: the vocabulary is kept as a compact ``Vocab`` (one UTF-8 blob, copied out of the GGUF: the
tokenizer holds no reference to the file) and the BPE merge table as one dict of packed ints; no
per-token Python string exists until a token is read (~20 MB in all for V4, 13 of them the merges).

The pre-tokenizer follows HF, not ds4.c's hand-written approximation (spec §11.2), which differs on
some inputs (e.g. ``.»`` followed by newlines); tests/test_tokenizer_ds4_divergence.py shows where.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ds4_mlx.errors import TokenizerError
from ds4_mlx.formats.gguf import StringArray
from ds4_mlx.tokenizer.added_tokens import LiteralMatcher, split_literals
from ds4_mlx.tokenizer.bpe import BPE
from ds4_mlx.tokenizer.byte_map import unicode_to_bytes
from ds4_mlx.tokenizer.pretokenizer import DEEPSEEK_V4_PATTERNS, GGUF_PRE_PATTERNS, PreTokenizer
from ds4_mlx.tokenizer.vocab import Vocab

# ds4's special strings (spec §11.3), resolved by exact lookup in the vocabulary.
SPECIAL_STRINGS: dict[str, str] = {
    "bos": "<｜begin▁of▁sentence｜>",
    "eos": "<｜end▁of▁sentence｜>",
    "user": "<｜User｜>",
    "assistant": "<｜Assistant｜>",
    "think_start": "<think>",
    "think_end": "</think>",
    "dsml": "｜DSML｜",
}

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_LITERAL_MARK = "\uff5c"  # fullwidth vertical bar: token strings containing it are shown literally


@dataclass(frozen=True)
class AddedToken:
    """A token HF cuts out of the text before BPE. ``normalized`` picks the matching pass."""

    content: str
    id: int
    normalized: bool = False


class Tokenizer:
    """Byte-level BPE tokenizer for DeepSeek V4 Flash (see module docstring for the three encoders)."""

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Iterable[str | bytes | Sequence[str]],  # or a GGUF StringArray of "A B"
        *,
        added_tokens: Sequence[AddedToken] = (),
        pre_patterns: Sequence[str] = DEEPSEEK_V4_PATTERNS,
        bos_id: int | None = None,
        eos_id: int | None = None,
        source: str = "tokenizer",
    ):
        self.source = source
        vocab = Vocab.from_strings(tokens, source)
        n = len(vocab)
        if n == 0:
            raise TokenizerError(f"{source}: the vocabulary is empty")
        self._tokens = vocab
        self._bpe = BPE.from_vocab(vocab, merges)
        self._pre = PreTokenizer(pre_patterns)

        special: dict[str, int] = {}
        for name, s in SPECIAL_STRINGS.items():
            tid = vocab.id_of(s)
            if tid is None:
                raise TokenizerError(f"{source}: the vocabulary lacks the special token {s!r} ({name})")
            special[name] = tid
        self._special = special
        for field, value, name in (("bos_id", bos_id, "bos"), ("eos_id", eos_id, "eos")):
            if value is not None and value != special[name]:
                raise TokenizerError(
                    f"{source}: {field} is {value} but {SPECIAL_STRINGS[name]!r} is token {special[name]}")

        for a in added_tokens:
            if not 0 <= a.id < n or vocab[a.id] != a.content:
                raise TokenizerError(f"{source}: added token {a.content!r} does not match vocabulary id {a.id}")
        self.added_tokens = tuple(added_tokens)
        self._rendered_matcher = LiteralMatcher({SPECIAL_STRINGS[k]: v for k, v in special.items()})
        self._hf_passes = (
            LiteralMatcher({a.content: a.id for a in added_tokens if not a.normalized}),
            LiteralMatcher({a.content: a.id for a in added_tokens if a.normalized}),
        )
        self._text_cache: dict[int, bytes] = {}

    # -- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: Any) -> Tokenizer:
        """From a GGUF path or an open ``GGUFFile`` (anything with a ``metadata`` dict)."""
        if isinstance(gguf, (str, os.PathLike)):
            from ds4_mlx.formats.gguf import GGUFFile

            with GGUFFile(gguf) as f:
                return cls.from_metadata(f.metadata, source=str(gguf))
        meta = getattr(gguf, "metadata", None)
        if not isinstance(meta, dict):
            raise TokenizerError(f"from_gguf needs a path or a GGUFFile, got {type(gguf).__name__}")
        return cls.from_metadata(meta, source=str(getattr(gguf, "path", "GGUF")))

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], source: str = "GGUF") -> Tokenizer:
        """From GGUF metadata as Python values (keys ``tokenizer.ggml.*``)."""

        def need(key: str) -> Any:
            if key not in meta:
                raise TokenizerError(f"{source}: metadata key {key!r} is missing")
            return meta[key]

        model = meta.get("tokenizer.ggml.model", "gpt2")
        if model != "gpt2":
            raise TokenizerError(
                f"{source}: tokenizer.ggml.model is {model!r}; only 'gpt2' (byte-level BPE) is supported")
        tokens = need("tokenizer.ggml.tokens")
        merges = need("tokenizer.ggml.merges")
        types = need("tokenizer.ggml.token_type")
        for key, value, kind in (("tokenizer.ggml.tokens", tokens, str), ("tokenizer.ggml.merges", merges, str),
                                 ("tokenizer.ggml.token_type", types, int)):
            if not isinstance(value, (list, tuple, StringArray)) or (len(value) and not isinstance(value[0], kind)):
                raise TokenizerError(f"{source}: {key} must be an array of {kind.__name__}")
        if len(types) != len(tokens):
            raise TokenizerError(
                f"{source}: tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens {len(tokens)}")
        pre = meta.get("tokenizer.ggml.pre")
        if pre is None:
            patterns = DEEPSEEK_V4_PATTERNS  # ds4 ignores the key and always splits the DeepSeek way
        elif pre in GGUF_PRE_PATTERNS:
            patterns = GGUF_PRE_PATTERNS[pre]
        else:
            raise TokenizerError(
                f"{source}: tokenizer.ggml.pre is {pre!r}; supported: {', '.join(sorted(GGUF_PRE_PATTERNS))}")
        ids = {}
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            v = meta.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < len(tokens)):
                raise TokenizerError(f"{source}: {key} = {v!r} is not a token id in [0, {len(tokens)})")
            ids[key] = v
        # GGUF does not keep HF's ``normalized`` flag: one matching pass over all of them (for the V4
        # vocabulary this gives the same result as HF's two passes; tested).
        added = [AddedToken(tokens[i], i) for i, ty in enumerate(types)
                 if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        return cls(tokens, merges, added_tokens=added, pre_patterns=patterns,
                   bos_id=ids["tokenizer.ggml.bos_token_id"], eos_id=ids["tokenizer.ggml.eos_token_id"],
                   source=source)

    @classmethod
    def from_tokenizer_json(cls, path: str | os.PathLike) -> Tokenizer:
        """From an HF ``tokenizer.json`` (byte-level BPE with Split/ByteLevel pre-tokenizers only)."""
        source = str(path)
        try:
            with open(path, encoding="utf-8") as fh:
                tj = json.load(fh)
        except OSError as exc:
            raise TokenizerError(f"{source}: cannot read: {exc.strerror or exc}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(tj, dict) or not isinstance(tj.get("model"), dict):
            raise TokenizerError(f"{source}: field 'model' is missing")
        model = tj["model"]
        if model.get("type") != "BPE":
            raise TokenizerError(f"{source}: model.type is {model.get('type')!r}, expected 'BPE'")
        for key, ok in (("dropout", None), ("continuing_subword_prefix", None), ("end_of_word_suffix", None),
                        ("byte_fallback", False), ("ignore_merges", False)):
            if model.get(key) not in (ok, None):
                raise TokenizerError(f"{source}: model.{key} = {model.get(key)!r} is not supported")
        vocab = model.get("vocab")
        merges = model.get("merges")
        if not isinstance(vocab, dict):
            raise TokenizerError(f"{source}: model.vocab must be an object")
        if not isinstance(merges, list):
            raise TokenizerError(f"{source}: model.merges must be a list")
        normalizer = tj.get("normalizer")
        if normalizer is not None and not (normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")):
            raise TokenizerError(f"{source}: normalizer {normalizer.get('type')!r} is not supported")
        pre = PreTokenizer.from_hf_config(tj.get("pre_tokenizer"))

        by_id: dict[int, str] = {}
        for s, i in vocab.items():
            by_id[i] = s
        added: list[AddedToken] = []
        for k, a in enumerate(tj.get("added_tokens") or []):
            try:
                content, tid = a["content"], a["id"]
            except (TypeError, KeyError):
                raise TokenizerError(f"{source}: added_tokens[{k}] lacks 'content' or 'id'") from None
            for flag in ("lstrip", "rstrip", "single_word"):
                if a.get(flag):
                    raise TokenizerError(f"{source}: added_tokens[{k}] {content!r}: {flag}=true is not supported")
            if tid in by_id and by_id[tid] != content:
                raise TokenizerError(f"{source}: added_tokens[{k}] {content!r} reuses id {tid} of {by_id[tid]!r}")
            by_id[tid] = content
            added.append(AddedToken(content, tid, bool(a.get("normalized", False))))
        n = max(by_id) + 1 if by_id else 0
        holes = [i for i in range(n) if i not in by_id]
        if holes or min(by_id, default=0) < 0:
            raise TokenizerError(f"{source}: token ids are not dense, e.g. id {holes[0] if holes else min(by_id)}")
        tokens = [by_id[i] for i in range(n)]
        return cls(tokens, merges, added_tokens=added, pre_patterns=pre.patterns, source=source)

    # -- properties ----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int:
        return self._special["bos"]

    @property
    def eos_id(self) -> int:
        return self._special["eos"]

    @property
    def special_ids(self) -> dict[str, int]:
        """ds4's 7 special strings -> ids, keyed by the string (``SPECIAL_STRINGS`` names them)."""
        return {SPECIAL_STRINGS[name]: tid for name, tid in self._special.items()}

    # -- encoding ------------------------------------------------------------------------------------

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces BPE encodes one by one (ordinary text, not byte-level)."""
        return self._pre.split(text)

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids. No special-token recognition: ``<think>`` in ``text`` is BPE'd as text."""
        out: list[int] = []
        encode_piece = self._bpe.encode_piece
        try:
            for a, b in self._pre.split_spans(text):
                out.extend(encode_piece(text[a:b]))
        except UnicodeEncodeError as exc:  # lone surrogates (e.g. from a "\ud800" JSON escape)
            k = a + exc.start
            raise TokenizerError(
                f"text has no UTF-8 form: lone surrogate U+{ord(text[k]):04X} at index {k}") from None
        return out

    def encode_rendered(self, text: str) -> list[int]:
        """Rendered prompt -> ids, recognising exactly ds4's 7 special strings (spec §11.4)."""
        return self._encode_segments(split_literals(text, (self._rendered_matcher,)))

    def encode_hf_compatible(self, text: str) -> list[int]:
        """Same ids as HF ``encode(text, add_special_tokens=False)``: every added token recognised."""
        return self._encode_segments(split_literals(text, self._hf_passes))

    def _encode_segments(self, segments: list[str | int]) -> list[int]:
        out: list[int] = []
        for seg in segments:
            if isinstance(seg, int):
                out.append(seg)
            else:
                out.extend(self.encode(seg))
        return out

    # -- decoding ------------------------------------------------------------------------------------

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is out of range [0, {len(self._tokens)})")

    def piece(self, token_id: int) -> str:
        """The vocabulary string of a token (byte-level alphabet for ordinary tokens)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_to_id(self, piece: str) -> int | None:
        """Id of a vocabulary string (the lowest, should it repeat), or None."""
        return self._tokens.id_of(piece)

    def token_text(self, token_id: int) -> bytes:
        """Bytes a token stands for (ds4_token_text): markers containing U+FF5C literally, others
        through the inverse byte map (code points outside it dropped)."""
        hit = self._text_cache.get(token_id)
        if hit is not None:
            return hit
        s = self.piece(token_id)
        data = s.encode("utf-8") if _LITERAL_MARK in s else unicode_to_bytes(s)
        self._text_cache[token_id] = data
        return data

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.token_text(i) for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Ids -> text; invalid or truncated UTF-8 becomes U+FFFD (as HF's byte-level decoder)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size}, merges={self._bpe.n_merges})"
