"""The tensor layouts ds4 requires of a speculative-decoding drafter GGUF, and which kind a file is.

Two drafter files exist, each belonging to one checkpoint (docs/speculative.md):

* the preview's MTP head (``DeepSeek-V4-Flash-MTP-Q4K-Q8_0-F32.gguf``, ``--mtp FILE``): one
  ``mtp.0.*`` block. ds4 binds it by name and checks each tensor's type and dims
  [mtp_weights_bind, mtp_weights_validate_layout]; it reads no metadata from it. The embedding and
  the output matrix are the target's, so the file holds neither.
* 0731's DSpark file (``DeepSeek-V4-Flash-DSpark-support-0731.gguf``): three ``mtp.<stage>.*``
  blocks, a main projection of three target layers' states, a Markov head and a confidence head
  [dspark_weights_bind], and the optional ``deepseek4.dspark.*`` parameters (``dspark_params``).

Every shape comes from the target's ``ModelConfig``: a drafter is validated against the model it
drafts for, so the same rules serve the real 4096-wide files and the small generated ones.
``drafter_kind`` tells the kinds apart by the tensors ds4 looks for (hub.py's download check uses
the same markers); a DS4 Flash model file passed as a drafter is recognised and named as such.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ds4_mlx.errors import DrafterError
from ds4_mlx.formats.config import FIXED_SWIGLU_CLAMP, REAL_FLASH, ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile, TensorInfo
from ds4_mlx.formats.layout import F32, Q8_0, ROUTED, ExpectedTensor

# ds4's "plain" layout (tensor_expect_plain_layout): F16 or F32, the MTP file's HC mixers and router
PLAIN = (GGMLType.F16, GGMLType.F32)
BF16 = (GGMLType.BF16,)

MTP_PREFIX = "mtp.0."
MTP_MARKER = MTP_PREFIX + "e_proj.weight"  # one of the tensors only the MTP head has
DSPARK_STAGES = 3  # mtp.0 .. mtp.2 [the DSpark contract ds4 encodes]
DSPARK_MARKOV_RANK = 256
DSPARK_TARGET_LAYERS = (40, 41, 42)  # the target layers whose states feed main_proj
DSPARK_BLOCK = 5  # tokens one DSpark proposal drafts
DSPARK_NOISE_TOKEN = 128799  # the block's filler token after the anchor
DSPARK_PARTS = (".main_proj.", ".markov_head.", ".confidence_head.")  # ds4's DSpark markers


class DrafterKind(enum.Enum):
    MTP = "mtp"  # the preview's one-block MTP head
    DSPARK = "dspark"  # 0731's DSpark block drafter

    @property
    def title(self) -> str:
        return ("the preview's MTP drafter head" if self is DrafterKind.MTP
                else "the Flash 0731 DSpark drafter")


def drafter_kind(f: GGUFFile) -> DrafterKind:
    """Which drafter ``f`` is; DrafterError naming what it is instead (a DS4 Flash model, another
    GGUF) when it is no drafter."""
    names = f.tensors
    if any(part in n for n in names for part in DSPARK_PARTS) and any(n.startswith("mtp.") for n in names):
        return DrafterKind.DSPARK
    if MTP_MARKER in names:
        return DrafterKind.MTP
    if "token_embd.weight" in names or any(n.startswith("blk.") for n in names):
        raise DrafterError(f"{f.path}: a DS4 Flash model file, not a drafter (no mtp.* tensors); pass the "
                           f"drafter GGUF (preview-mtp, ds4f-dspark), not the main model")
    raise DrafterError(f"{f.path}: a GGUF, but not a DS4 drafter (no {MTP_MARKER} and no DSpark "
                       f"main_proj / markov_head / confidence_head tensors)")


def block_tensors(cfg: ModelConfig, prefix: str) -> list[ExpectedTensor]:
    """One drafter block's tensors in ds4's binding order: a target layer's attention and MoE
    without compressor, indexer or hash table (ds4 runs it as the dense, score-routed layer 1),
    ``exp_probs_b.bias`` required, the HC mixers and router plain (F16 or F32)."""
    E, HC, NE, FF = cfg.n_embd, cfg.n_hc, cfg.n_expert, cfg.n_ff_exp
    hc_dim = E * HC
    q_dim = cfg.n_head * cfg.head_dim
    out_low = cfg.n_out_group * cfg.o_lora_rank
    group_in = cfg.head_dim * cfg.heads_per_group
    LQ, D = cfg.q_lora_rank, cfg.head_dim
    spec = [
        ("hc_attn_fn.weight", PLAIN, (hc_dim, cfg.hc_mix)),
        ("hc_attn_scale.weight", F32, (3,)),
        ("hc_attn_base.weight", F32, (cfg.hc_mix,)),
        ("attn_norm.weight", F32, (E,)),
        ("attn_q_a.weight", Q8_0, (E, LQ)),
        ("attn_q_a_norm.weight", F32, (LQ,)),
        ("attn_q_b.weight", Q8_0, (LQ, q_dim)),
        ("attn_kv.weight", Q8_0, (E, D)),
        ("attn_kv_a_norm.weight", F32, (D,)),
        ("attn_sinks.weight", F32, (cfg.n_head,)),
        ("attn_output_a.weight", Q8_0, (group_in, out_low)),
        ("attn_output_b.weight", Q8_0, (out_low, E)),
        ("hc_ffn_fn.weight", PLAIN, (hc_dim, cfg.hc_mix)),
        ("hc_ffn_scale.weight", F32, (3,)),
        ("hc_ffn_base.weight", F32, (cfg.hc_mix,)),
        ("ffn_norm.weight", F32, (E,)),
        ("ffn_gate_inp.weight", PLAIN, (E, NE)),
        ("exp_probs_b.bias", F32, (NE,)),
        ("ffn_gate_exps.weight", ROUTED, (E, FF, NE)),
        ("ffn_up_exps.weight", ROUTED, (E, FF, NE)),
        ("ffn_down_exps.weight", ROUTED, (FF, E, NE)),
        ("ffn_gate_shexp.weight", Q8_0, (E, FF)),
        ("ffn_up_shexp.weight", Q8_0, (E, FF)),
        ("ffn_down_shexp.weight", Q8_0, (FF, E)),
    ]
    return [ExpectedTensor(prefix + name, types, ne) for name, types, ne in spec]


def head_tensors(cfg: ModelConfig, prefix: str) -> list[ExpectedTensor]:
    """A drafter's own output mix and norm (the output matrix is the target's)."""
    E, HC = cfg.n_embd, cfg.n_hc
    return [
        ExpectedTensor(prefix + "hc_head_base.weight", F32, (HC,)),
        ExpectedTensor(prefix + "hc_head_fn.weight", PLAIN, (E * HC, HC)),
        ExpectedTensor(prefix + "hc_head_scale.weight", F32, (1,)),
        ExpectedTensor(prefix + "norm.weight", F32, (E,)),
    ]


def mtp_tensors(cfg: ModelConfig) -> list[ExpectedTensor]:
    """The preview MTP head's tensors [mtp_weights_bind]: the head, the input projections of the
    target's HC state (h) and of the next token's embedding (e), their norms, one block."""
    E = cfg.n_embd
    p = MTP_PREFIX
    out = head_tensors(cfg, p)[:3] + [
        ExpectedTensor(p + "e_proj.weight", Q8_0, (E, E)),
        ExpectedTensor(p + "h_proj.weight", Q8_0, (E, E)),
        ExpectedTensor(p + "enorm.weight", F32, (E,)),
        ExpectedTensor(p + "hnorm.weight", F32, (E,)),
        ExpectedTensor(p + "norm.weight", F32, (E,)),
    ]
    return out + block_tensors(cfg, p)


def dspark_tensors(cfg: ModelConfig) -> list[ExpectedTensor]:
    """The DSpark file's tensors [dspark_weights_bind; 81 in the 0731 file]: stage 0's main
    projection of the concatenated target-layer states and its norm, three blocks, and on the last
    stage the head, the Markov head (two BF16 [rank, vocab] factors) and the confidence head."""
    E, V, R = cfg.n_embd, cfg.n_vocab, DSPARK_MARKOV_RANK
    last = f"mtp.{DSPARK_STAGES - 1}."
    out = [
        ExpectedTensor("mtp.0.main_proj.weight", Q8_0, (len(DSPARK_TARGET_LAYERS) * E, E)),
        ExpectedTensor("mtp.0.main_norm.weight", F32, (E,)),
    ]
    for s in range(DSPARK_STAGES):
        out += block_tensors(cfg, f"mtp.{s}.")
    out += head_tensors(cfg, last)
    out += [
        ExpectedTensor(last + "markov_head.markov_w1.weight", BF16, (R, V)),
        ExpectedTensor(last + "markov_head.markov_w2.weight", BF16, (R, V)),
        ExpectedTensor(last + "confidence_head.proj.weight", BF16, (E + R,)),
    ]
    return out


def validate_drafter_layout(f: GGUFFile, cfg: ModelConfig, kind: DrafterKind) -> int:
    """Check every tensor of a ``kind`` drafter against the target config ``cfg`` (ds4's order:
    every name first, then types and dims); DrafterError on the first problem, else the count."""
    expected = mtp_tensors(cfg) if kind is DrafterKind.MTP else dspark_tensors(cfg)
    tensors: Mapping[str, TensorInfo] = f.tensors
    for e in expected:
        if e.name not in tensors:
            raise DrafterError(f"{f.path}: {kind.title}: required tensor {e.name!r} is missing "
                               f"(expected {e.describe()})")
    for e in expected:
        t = tensors[e.name]
        if t.ggml_type not in e.ggml_types:
            raise DrafterError(f"{f.path}: tensor {e.name!r} has type {t.ggml_type.name}, expected "
                               f"{' or '.join(x.name for x in e.ggml_types)}")
        if t.ne != e.ne:
            raise DrafterError(f"{f.path}: tensor {e.name!r} has GGUF dims {list(t.ne)}, expected {list(e.ne)} "
                               f"for the loaded model (n_embd {cfg.n_embd}, n_expert {cfg.n_expert}, "
                               f"n_hc {cfg.n_hc}): the drafter belongs to a model of other dims")
    prefixes = [MTP_PREFIX] if kind is DrafterKind.MTP else [f"mtp.{s}." for s in range(DSPARK_STAGES)]
    for p in prefixes:
        gate, up = tensors[p + "ffn_gate_exps.weight"].ggml_type, tensors[p + "ffn_up_exps.weight"].ggml_type
        if gate != up:
            raise DrafterError(f"{f.path}: {p}: routed gate/up experts use different quant types "
                               f"({gate.name}, {up.name}); ds4 needs one type")
    return len(expected)


@dataclass(frozen=True)
class DSparkParams:
    """A DSpark file's parameters (``deepseek4.dspark.*`` metadata, ds4's defaults when absent)."""

    block_size: int
    noise_token_id: int
    target_layers: tuple[int, ...]


# ds4's key aliases, the first present wins [model_dspark_summary]
_DSPARK_KEYS = ("deepseek4.dspark.{}", "deepseek4.dspark_{}", "dspark.{}")
MAX_DSPARK_BLOCK = 16  # ds4's DS4_DSPARK_MAX_BLOCK_SIZE bound on a proposal


def _dspark_meta(f: GGUFFile, key: str):
    for k in _DSPARK_KEYS:
        if k.format(key) in f.metadata:
            return k.format(key), f.metadata[k.format(key)]
    return None, None


def dspark_params(f: GGUFFile, cfg: ModelConfig) -> DSparkParams:
    """The DSpark file's block size, noise token and target layers, checked against the target
    ``cfg``: the metadata when present, else ds4's defaults (block 5, noise 128799, layers 40-42,
    which a target of fewer layers or a smaller vocabulary cannot take: a DrafterError names it)."""

    def integer(key: str, default: int) -> int:
        k, v = _dspark_meta(f, key)
        if k is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise DrafterError(f"{f.path}: metadata {k} is {str(v)[:24]!r}, not an integer")
        return int(v)

    block = integer("block_size", DSPARK_BLOCK)
    if not 1 <= block <= MAX_DSPARK_BLOCK:
        raise DrafterError(f"{f.path}: DSpark block size {block} is outside 1..{MAX_DSPARK_BLOCK}")
    rank = integer("markov_rank", DSPARK_MARKOV_RANK)
    if rank != DSPARK_MARKOV_RANK:
        raise DrafterError(f"{f.path}: DSpark Markov rank {rank}, ds4 runs rank {DSPARK_MARKOV_RANK}")
    noise = integer("noise_token_id", DSPARK_NOISE_TOKEN)
    if not 0 <= noise < cfg.n_vocab:
        raise DrafterError(f"{f.path}: DSpark noise token {noise} is outside the loaded model's vocabulary "
                           f"0..{cfg.n_vocab - 1}")
    k, v = _dspark_meta(f, "target_layers")
    layers = DSPARK_TARGET_LAYERS
    if k is not None:
        if not isinstance(v, (list, tuple)) or any(isinstance(x, bool) or not isinstance(x, int) for x in v):
            raise DrafterError(f"{f.path}: metadata {k} is not a list of layer indices")
        layers = tuple(int(x) for x in v)
    if len(layers) != len(DSPARK_TARGET_LAYERS) or len(set(layers)) != len(layers) \
            or any(not 0 <= il < cfg.n_layer for il in layers):
        raise DrafterError(f"{f.path}: DSpark target layers {list(layers)} are not {len(DSPARK_TARGET_LAYERS)} "
                           f"distinct layers of the loaded model (0..{cfg.n_layer - 1})")
    return DSparkParams(block, noise, layers)


def self_config(f: GGUFFile, kind: DrafterKind, base: ModelConfig | None = None) -> ModelConfig:
    """``base`` (default: the real Flash config, with the vocabulary the file declares, if any) with
    the dims a drafter file implies by its own tensors (n_embd, n_hc, the expert and attention
    sizes): what a drafter is checked against when no target is loaded (``inspect``, downloads)."""
    if base is None:
        n = REAL_FLASH["n_layer"]
        base = ModelConfig(**REAL_FLASH, compress_ratios=(0,) * n, swiglu_clamp=(FIXED_SWIGLU_CLAMP,) * n)
        vocab = f.metadata.get("deepseek4.vocab_size")
        if isinstance(vocab, int) and not isinstance(vocab, bool) and 0 < vocab <= 1 << 24:
            base = replace(base, n_vocab=vocab)
    p = "mtp.0."
    t = f.tensors

    def ne(name: str, rank: int) -> tuple[int, ...]:
        if name not in t:
            raise DrafterError(f"{f.path}: {kind.title}: required tensor {name!r} is missing")
        if len(t[name].ne) != rank:
            raise DrafterError(f"{f.path}: tensor {name!r} has {len(t[name].ne)} dims, expected {rank}")
        return t[name].ne

    (E,) = ne(p + "attn_norm.weight", 1)
    hc_dim, _ = ne(p + "hc_attn_fn.weight", 2)
    n_hc = hc_dim // E if E else 0
    _, FF, NE = ne(p + "ffn_gate_exps.weight", 3)
    LQ, _ = ne(p + "attn_q_b.weight", 2)
    (D,) = ne(p + "attn_kv_a_norm.weight", 1)
    (n_head,) = ne(p + "attn_sinks.weight", 1)
    group_in, out_low = ne(p + "attn_output_a.weight", 2)
    n_out_group = n_head * D // group_in if group_in else 0
    o_rank = out_low // n_out_group if n_out_group else 0
    n_vocab = base.n_vocab
    if kind is DrafterKind.DSPARK:
        n_vocab = ne(f"mtp.{DSPARK_STAGES - 1}.markov_head.markov_w1.weight", 2)[1]
    return replace(base, n_embd=E, n_hc=n_hc, n_ff_exp=FF, n_expert=NE, q_lora_rank=LQ, head_dim=D,
                   n_head=n_head, n_out_group=max(n_out_group, 1), o_lora_rank=o_rank, n_vocab=n_vocab)


def validate_drafter_file(f: GGUFFile, kind: DrafterKind) -> tuple[ModelConfig, int]:
    """A drafter checked on its own: against the dims its tensors imply (``self_config``).
    Returns (those dims, tensors checked); DrafterError on the first inconsistency."""
    cfg = self_config(f, kind)
    return cfg, validate_drafter_layout(f, cfg, kind)


__all__ = ["DrafterKind", "drafter_kind", "mtp_tensors", "dspark_tensors", "validate_drafter_layout",
           "DSparkParams", "dspark_params",
           "self_config", "validate_drafter_file", "MTP_PREFIX", "MTP_MARKER"]
