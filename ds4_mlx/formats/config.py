"""Model configuration read from GGUF metadata (``deepseek4.*`` keys).

The same code reads the 43-layer DS4 Flash and the small generated test models: every shape comes
from metadata. Values that are not shapes (rope bases, YaRN, scales, epsilons) are compared with the
constants ds4 compiles in, because ds4 refuses a file that disagrees and so do we; the config then
holds ds4's constants, not the file's values, since ds4 computes with the constants (its tolerance
would otherwise let, e.g., an RMS epsilon of 1.5e-6 through and change the arithmetic).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_mlx.errors import LayoutError

ARCH = "deepseek4"
# The context a session gets when none is given: ds4's CLI default (32768 tokens), capped at the
# model's context length (``Engine.default_ctx``). Defined here, below the model and the chat
# layers, because both use it: the chat templates and the loader's memory plan (KV sized at it).
DEFAULT_CTX = 32768

# Non-shape constants ds4 enforces on every file (ds4.c config_validate_model), with its tolerance (see _close).
FIXED_FLOATS = {
    "rope.freq_base": 10000.0,
    "attention.compress_rope_freq_base": 160000.0,
    "rope.scaling.factor": 16.0,
    "rope.scaling.yarn_beta_fast": 32.0,
    "rope.scaling.yarn_beta_slow": 1.0,
    "expert_weights_scale": 1.5,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "hyper_connection.epsilon": 1e-6,
}
FIXED_ROPE_ORIG_CTX = 65536
MAX_PER_LAYER_ARRAY = 1024  # entries of a per-layer array (compress_ratios, swiglu_clamp_exp)
FIXED_SWIGLU_CLAMP = 10.0

# The real DeepSeek V4 Flash shape: enforced when a file claims to be that model (43 layers).
REAL_FLASH = {
    "n_layer": 43,
    "n_embd": 4096,
    "n_vocab": 129280,
    "n_head": 64,
    "n_head_kv": 1,
    "head_dim": 512,
    "value_dim": 512,
    "n_rot": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "n_out_group": 8,
    "n_expert": 256,
    "n_expert_used": 6,
    "n_expert_shared": 1,
    "n_ff_exp": 2048,
    "n_hash_layer": 3,
    "n_swa": 128,
    "n_indexer_head": 64,
    "indexer_head_dim": 128,
    "indexer_top_k": 512,
    "n_hc": 4,
    "hc_sinkhorn_iter": 20,
}


# Allowed range of every integer key (without the "deepseek4." prefix), checked before anything is
# sized from it: generous above the real model (its value is in REAL_FLASH / REAL_OTHER) so variants
# and test models pass, tight enough that no value can make a buffer absurd (a sliding_window of
# 2^31-1 used to reach mx.zeros and segfault). Keys ds4 pins to one value are still checked for it
# afterwards, with their own message.
INT_RANGES: dict[str, tuple[int, int]] = {
    "block_count": (1, 1024),
    "embedding_length": (1, 65536),
    "vocab_size": (1, 1 << 21),
    "attention.head_count": (1, 1024),
    "attention.head_count_kv": (1, 1024),
    "attention.key_length": (1, 8192),
    "attention.value_length": (1, 8192),
    "rope.dimension_count": (1, 8192),
    "attention.q_lora_rank": (1, 65536),
    "attention.output_lora_rank": (1, 65536),
    "attention.output_group_count": (1, 1024),
    "expert_count": (1, 4096),
    "expert_used_count": (1, 256),
    "expert_shared_count": (1, 64),
    "expert_feed_forward_length": (1, 65536),
    "hash_layer_count": (0, 1024),
    "attention.sliding_window": (1, 16384),
    "attention.indexer.head_count": (1, 1024),
    "attention.indexer.key_length": (1, 8192),
    "attention.indexer.top_k": (1, 65536),
    "hyper_connection.count": (1, 64),
    "hyper_connection.sinkhorn_iterations": (1, 256),
    "context_length": (1, 1 << 24),
    "rope.scaling.original_context_length": (1, 1 << 24),
    "expert_group_count": (0, 1024),
    "expert_group_used_count": (0, 1024),
}
# The real model's value of the keys REAL_FLASH does not name by key, for the range messages.
REAL_OTHER = {"context_length": 1048576, "rope.scaling.original_context_length": 65536,
              "expert_group_count": 0, "expert_group_used_count": 0}
# Products that size buffers, each bounded so a file whose every value is in range still cannot ask
# for an absurd allocation: (description, factors as ModelConfig fields, limit in elements).
PRODUCT_LIMITS = (
    ("sliding-window KV rows of all layers", ("n_layer", "n_swa", "head_dim"), 1 << 31),
    ("per-query attention keys x heads x key_length", ("n_head", "head_dim", "_keys_per_query"), 1 << 31),
    ("KV cache at the full context", ("context_length", "head_dim", "n_layer"), 1 << 40),
)


# Every integer shape key and the ModelConfig field it fills: ``from_metadata`` reads them in this
# order (the first bad one is the one reported). INT_RANGES bounds each (from 1, but
# hash_layer_count from 0), so no shape that sizes a buffer can be zero.
_ATTR_OF_KEY = {
    "block_count": "n_layer", "embedding_length": "n_embd", "vocab_size": "n_vocab", "attention.head_count": "n_head",
    "attention.head_count_kv": "n_head_kv", "attention.key_length": "head_dim", "attention.value_length": "value_dim",
    "rope.dimension_count": "n_rot", "attention.q_lora_rank": "q_lora_rank",
    "attention.output_lora_rank": "o_lora_rank", "attention.output_group_count": "n_out_group",
    "expert_count": "n_expert", "expert_used_count": "n_expert_used", "expert_shared_count": "n_expert_shared",
    "expert_feed_forward_length": "n_ff_exp", "hash_layer_count": "n_hash_layer",
    "attention.sliding_window": "n_swa", "attention.indexer.head_count": "n_indexer_head",
    "attention.indexer.key_length": "indexer_head_dim", "attention.indexer.top_k": "indexer_top_k",
    "hyper_connection.count": "n_hc", "hyper_connection.sinkhorn_iterations": "hc_sinkhorn_iter",
}


def ds4_compress_ratio(il: int) -> int:
    """ds4's fixed schedule: two dense layers, then 4 on even and 128 on odd layers."""
    if il < 2:
        return 0
    return 4 if il % 2 == 0 else 128


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    value_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    n_out_group: int
    n_expert: int
    n_expert_used: int
    n_expert_shared: int
    n_ff_exp: int
    n_hash_layer: int
    n_swa: int
    n_indexer_head: int
    indexer_head_dim: int
    indexer_top_k: int
    n_hc: int
    hc_sinkhorn_iter: int
    compress_ratios: tuple[int, ...]
    swiglu_clamp: tuple[float, ...]
    rope_freq_base: float = 10000.0
    compress_rope_freq_base: float = 160000.0
    rope_scaling_factor: float = 16.0
    rope_orig_ctx: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    expert_weights_scale: float = 1.5
    expert_weights_norm: bool = True
    rms_eps: float = 1e-6
    hc_eps: float = 1e-6
    context_length: int = 1048576
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # -- derived -----------------------------------------------------------------------------------

    @property
    def n_nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def heads_per_group(self) -> int:
        return self.n_head // self.n_out_group

    @property
    def hc_mix(self) -> int:
        """Rows of an HC mixer: pre (n_hc) + post (n_hc) + comb (n_hc²)."""
        return 2 * self.n_hc + self.n_hc * self.n_hc

    def compress_ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    def coff(self, il: int) -> int:
        return 2 if self.compress_ratios[il] == 4 else 1

    def is_hash_layer(self, il: int) -> bool:
        return il < self.n_hash_layer

    def claims_real_flash(self) -> bool:
        return self.n_layer == REAL_FLASH["n_layer"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        d["compress_ratios"] = list(self.compress_ratios)
        d["swiglu_clamp"] = list(self.swiglu_clamp)
        return d

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf_file: Any) -> "ModelConfig":
        """From an open ``GGUFFile``, checking declared value types as strictly as ds4."""
        return cls.from_metadata(gguf_file.metadata, gguf_file.path, value_types=config_value_types(gguf_file))

    @classmethod
    def from_metadata(
        cls,
        md: Mapping[str, Any],
        source: str = "GGUF",
        *,
        value_types: Mapping[str, tuple[int, int | None]] | None = None,
    ) -> "ModelConfig":
        """Build and validate; raises LayoutError naming the key, expected and found values.

        ``value_types`` (key -> (GGUF value type id, array element type id or None), as
        ``config_value_types(gguf_file)`` gives) makes the check as strict as ds4 about declared
        types: ds4 reads shapes only from u32 keys, floats from f32/f64/u32/i32, and so on. Without
        it only the Python values are checked.
        """
        arch = md.get("general.architecture")
        if arch is not None and arch != ARCH:
            raise LayoutError(f"{source}: general.architecture is {_short(arch)}, expected {ARCH!r}")

        def get(key: str, kind: type, default: Any = None, required: bool = True):
            v = _get(key, kind, default, required)
            if kind is int and key in INT_RANGES:
                lo, hi = INT_RANGES[key]
                if not lo <= v <= hi:
                    raise LayoutError(f"{source}: metadata '{ARCH}.{key}' is {v}, outside the allowed range "
                                      f"{lo}..{hi} ({_real_value(key)})")
            return v

        def _get(key: str, kind: type, default: Any, required: bool):
            full = f"{ARCH}.{key}"
            if full not in md:
                if required:
                    raise LayoutError(f"{source}: required metadata key {full!r} is missing")
                return default
            v = md[full]
            if value_types is not None and full in value_types:
                _check_declared_type(source, full, kind, value_types[full])
            if kind is int:
                if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                    raise LayoutError(f"{source}: metadata {full!r} must be a non-negative integer, found {_short(v)}")
            elif kind is float:
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise LayoutError(f"{source}: metadata {full!r} must be a finite number, found {_short(v)}")
                v = float(v)
            elif kind is bool:
                if not isinstance(v, bool):
                    raise LayoutError(f"{source}: metadata {full!r} must be a bool, found {_short(v)}")
            elif kind is list:
                # a numeric array can be a lazy ``NumericArray`` (long ones are not made into lists)
                if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
                    raise LayoutError(f"{source}: metadata {full!r} must be an array, found {type(v).__name__}")
                if len(v) > MAX_PER_LAYER_ARRAY:
                    raise LayoutError(f"{source}: metadata {full!r} has {len(v)} entries, more than "
                                      f"{MAX_PER_LAYER_ARRAY} (one per layer at most)")
            return v

        n_layer = get("block_count", int)

        ratios = get("attention.compress_ratios", list)
        if len(ratios) < n_layer:
            raise LayoutError(f"{source}: deepseek4.attention.compress_ratios has {len(ratios)} entries, "
                              f"needs at least block_count={n_layer}")
        for il in range(n_layer):
            want = ds4_compress_ratio(il)
            r = ratios[il]
            if isinstance(r, bool) or not isinstance(r, int) or r != want:
                raise LayoutError(f"{source}: deepseek4.attention.compress_ratios[{il}] is {_short(r)}, "
                                  f"ds4's fixed schedule needs {want}")

        clamp = get("swiglu_clamp_exp", list)
        if len(clamp) < n_layer:
            raise LayoutError(f"{source}: deepseek4.swiglu_clamp_exp has {len(clamp)} entries, "
                              f"needs at least block_count={n_layer}")
        for il in range(n_layer):
            c = clamp[il]
            if isinstance(c, bool) or not isinstance(c, (int, float)) or not _close(c, FIXED_SWIGLU_CLAMP):
                raise LayoutError(f"{source}: deepseek4.swiglu_clamp_exp[{il}] is {_short(c)}, "
                                  f"expected {FIXED_SWIGLU_CLAMP}")

        for key, want in FIXED_FLOATS.items():
            v = get(key, float)
            if not _close(v, want):
                raise LayoutError(f"{source}: metadata 'deepseek4.{key}' is {_short(v)}, expected {want}")
        orig = get("rope.scaling.original_context_length", int)
        if orig != FIXED_ROPE_ORIG_CTX:
            raise LayoutError(f"{source}: metadata 'deepseek4.rope.scaling.original_context_length' is {orig}, "
                              f"expected {FIXED_ROPE_ORIG_CTX}")
        norm = get("expert_weights_norm", bool)
        if norm is not True:
            raise LayoutError(f"{source}: metadata 'deepseek4.expert_weights_norm' must be true, found {_short(norm)}")
        for key in ("expert_group_count", "expert_group_used_count"):
            g = get(key, int, 0, required=False)
            if g != 0:
                raise LayoutError(f"{source}: metadata 'deepseek4.{key}' is {g}, expected 0 "
                                  f"(ds4 has no group-limited routing)")

        cfg = cls(
            n_layer=n_layer,
            **{attr: get(key, int) for key, attr in _ATTR_OF_KEY.items() if attr != "n_layer"},
            compress_ratios=tuple(int(r) for r in ratios[:n_layer]),
            swiglu_clamp=(FIXED_SWIGLU_CLAMP,) * n_layer,
            rope_freq_base=FIXED_FLOATS["rope.freq_base"],
            compress_rope_freq_base=FIXED_FLOATS["attention.compress_rope_freq_base"],
            rope_scaling_factor=FIXED_FLOATS["rope.scaling.factor"],
            rope_orig_ctx=orig,
            yarn_beta_fast=FIXED_FLOATS["rope.scaling.yarn_beta_fast"],
            yarn_beta_slow=FIXED_FLOATS["rope.scaling.yarn_beta_slow"],
            expert_weights_scale=FIXED_FLOATS["expert_weights_scale"],
            expert_weights_norm=True,
            rms_eps=FIXED_FLOATS["attention.layer_norm_rms_epsilon"],
            hc_eps=FIXED_FLOATS["hyper_connection.epsilon"],
            context_length=get("context_length", int, 1048576, required=False),
            name=str(md.get("general.name", "")),
        )
        cfg._check_shapes(source)
        return cfg

    @property
    def _keys_per_query(self) -> int:
        """Most keys one query attends: the window plus the indexer's selection."""
        return self.n_swa + self.indexer_top_k

    def _check_shapes(self, source: str) -> None:
        def bad(msg: str):
            raise LayoutError(f"{source}: {msg}")

        for what, factors, limit in PRODUCT_LIMITS:
            n = math.prod(getattr(self, f) for f in factors)
            if n > limit:
                shown = " x ".join(f"{f.lstrip('_')} {getattr(self, f)}" for f in factors)
                bad(f"{what} would need {shown} = {n:,} elements, more than the sanity limit {limit:,} "
                    f"(corrupt metadata?)")

        if self.n_head_kv != 1:
            bad(f"attention.head_count_kv is {self.n_head_kv}; DS4 Flash has one latent KV head (K = V)")
        if self.value_dim != self.head_dim:
            bad(f"attention.value_length {self.value_dim} != key_length {self.head_dim} (K = V)")
        if self.n_expert_shared != 1:
            bad(f"expert_shared_count is {self.n_expert_shared}, expected 1")
        if self.n_expert_used > self.n_expert:
            bad(f"expert_used_count {self.n_expert_used} > expert_count {self.n_expert}")
        if self.n_hash_layer > self.n_layer:
            bad(f"hash_layer_count {self.n_hash_layer} > block_count {self.n_layer}")
        if self.n_head % self.n_out_group:
            bad(f"head_count {self.n_head} is not a multiple of output_group_count {self.n_out_group}")
        if self.n_rot % 2 or self.n_rot > self.head_dim or self.n_rot > self.indexer_head_dim:
            bad(f"rope.dimension_count {self.n_rot} must be even and fit in key_length {self.head_dim} "
                f"and indexer key_length {self.indexer_head_dim}")
        if self.n_nope % 64:
            bad(f"key_length - rope dims = {self.n_nope} is not a multiple of 64 (FP8 KV blocks)")
        if self.indexer_head_dim != 128:
            bad(f"attention.indexer.key_length is {self.indexer_head_dim}; the indexer's Hadamard/FP4 "
                f"rounding is defined for 128")
        if self.head_dim == self.indexer_head_dim:
            bad("key_length equals the indexer key_length; ds4 tells FP8 from FP4 compressor rows by width")
        if self.n_hc != 4:
            bad(f"hyper_connection.count is {self.n_hc}, expected 4")
        if self.claims_real_flash():
            for name, want in REAL_FLASH.items():
                if getattr(self, name) != want:
                    bad(f"file claims the real DS4 Flash ({self.n_layer} layers) but {name} is "
                        f"{getattr(self, name)}, expected {want}")


def _real_value(key: str) -> str:
    attr = _ATTR_OF_KEY.get(key)
    real = REAL_FLASH[attr] if attr is not None else REAL_OTHER.get(key)
    return f"DS4 Flash has {real:,}" if real is not None else "no DS4 Flash value"


def _short(v: Any, limit: int = 96) -> str:
    """repr for a message, cut short: a corrupt file can put a 100k-element array where a number goes."""
    r = repr(v)
    if len(r) <= limit:
        return r
    size = f" ({type(v).__name__} of {len(v)})" if hasattr(v, "__len__") else ""
    return r[:limit] + "..." + size


def _close(got: float, want: float) -> bool:
    """ds4's float check (config_expect_f32): absolute 1e-6 below 1, relative 1e-6 above."""
    return abs(got - want) <= max(abs(want), 1.0) * 1e-6


# GGUF value type ids (ds4_mlx.formats.gguf.ValueType) ds4 accepts for each kind of key.
_U32, _I32, _F32, _BOOL, _ARRAY, _U64, _F64 = 4, 5, 6, 7, 9, 10, 12
_TYPE_NAMES = {0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
               7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64"}
_ACCEPTED_TYPES: dict[str, tuple[frozenset[int], frozenset[int] | None]] = {
    # ds4's required_u64 takes u32 or u64; every other integer is required_u32.
    "deepseek4.rope.scaling.original_context_length": (frozenset({_U32, _U64}), None),
    "deepseek4.context_length": (frozenset({_U32, _U64}), None),
    "deepseek4.attention.compress_ratios": (frozenset({_ARRAY}), frozenset({_U32, _I32})),
    "deepseek4.swiglu_clamp_exp": (frozenset({_ARRAY}), frozenset({_F32, _F64})),
}
_ACCEPTED_BY_KIND = {
    int: (frozenset({_U32}), None),
    float: (frozenset({_F32, _F64, _U32, _I32}), None),  # ds4 required_f32
    bool: (frozenset({_BOOL}), None),
}


def _check_declared_type(source: str, key: str, kind: type, declared: tuple[int, int | None]) -> None:
    accepted = _ACCEPTED_TYPES.get(key) or _ACCEPTED_BY_KIND.get(kind)
    if accepted is None:
        return
    types, subs = accepted
    vtype, sub = declared
    if vtype in types and (subs is None or sub in subs):
        return
    want = " or ".join(sorted(_TYPE_NAMES[t] for t in types))
    if subs is not None:
        want += " of " + " or ".join(sorted(_TYPE_NAMES[t] for t in subs))
    found = _TYPE_NAMES.get(vtype, str(vtype))
    if vtype == _ARRAY:
        found += f" of {_TYPE_NAMES.get(sub, str(sub))}"
    raise LayoutError(f"{source}: metadata {key!r} is declared {found}; ds4 reads it only as {want}")


def config_value_types(gguf_file: Any) -> dict[str, tuple[int, int | None]]:
    """Declared GGUF types of a GGUFFile's metadata, in the form ``from_metadata`` takes."""
    return {k: (int(f.type), None if f.sub_type is None else int(f.sub_type)) for k, f in gguf_file.fields.items()}
