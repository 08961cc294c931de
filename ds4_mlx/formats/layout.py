"""The tensor layout ds4 requires of a DS4 Flash GGUF, derived from a ``ModelConfig``.

ds4 binds every tensor by name and then checks its GGML type, dimension count and each GGUF dim
(ds4.c weights_bind, weights_validate_layout); a file passing that check is one the whole model can
run on without further shape tests. Here the same rules are written once as data
(``expected_tensors``) and checked by ``validate_layout``, with every shape taken from the config
so the 43-layer model and the small generated test models share the code.

Tensors the metadata does not account for are refused, where ds4 (which ignores every name it
does not bind) would run without them: a layer's tensors beyond ``block_count`` (block_count 5 in
a file holding blk.0..blk.5 ran five layers and dropped a trained one), a hash routing table on a
layer ``hash_layer_count`` makes a score-routed one, a compressor or indexer on a layer whose
compress ratio has none. In each case the file and its metadata disagree, and which one is wrong
cannot be known; ds4 cannot meet most of these, since it pins block_count, hash_layer_count and the
ratios to the real model's, but the small models' configs are free. Names ds4 does not know at all
(``mtp.*``, a layer tensor of another kind) are ignored by ds4 and only listed in the report.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ds4_mlx.errors import LayoutError
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.gguf import GGUFFile, TensorInfo

F16 = (GGMLType.F16,)
F32 = (GGMLType.F32,)
Q8_0 = (GGMLType.Q8_0,)
I32 = (GGMLType.I32,)
# The routed-expert types ds4-mlx multiplies. ds4 takes any of its routed types for each routed tensor,
# layer by layer (tensor_is_routed_expert_type), gate and up agreeing; so does ds4-mlx, every tensor with
# its own type (model/experts.py). The published files: IQ2_XXS gate/up + Q2_K down (ds4f-q2), Q4_K
# (ds4f-q4), Q4_K in layers 37-42 and the q2 pair elsewhere (ds4f-q2-q4), MXFP4 (ds4f-mxfp4).
ROUTED = (GGMLType.IQ2_XXS, GGMLType.Q2_K, GGMLType.Q4_K, GGMLType.MXFP4)
# Routed types ds4 (b0309611) also takes that no published DeepSeek file uses and ds4-mlx does not implement.
ROUTED_DS4_ONLY = (GGMLType.Q8_0, GGMLType.Q5_K, GGMLType.Q6_K)


@dataclass(frozen=True)
class ExpectedTensor:
    name: str
    ggml_types: tuple[GGMLType, ...]  # accepted types
    ne: tuple[int, ...]  # GGUF order (ne[0] fastest); the dimension count is len(ne)
    required: bool = True
    layer: int | None = None  # None for the global tensors

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy/MLX) shape."""
        return tuple(reversed(self.ne))

    def describe(self) -> str:
        return f"{'/'.join(t.name for t in self.ggml_types)} {list(self.ne)}"


@dataclass
class LayoutReport:
    """What ``validate_layout`` found in a file it accepted (a rejected file raises LayoutError)."""

    path: str
    n_checked: int  # tensors matched against an expectation
    routed_quant_bits: int  # 2 or 4, as ds4_engine_routed_quant_bits (layer 0's gate; a KV-cache label)
    routed_types: dict[str, str]  # layer 0's routed types: {"gate": ..., "up": ..., "down": ...}
    routed_by_layer: list[tuple[str, str]] = field(default_factory=list)  # (gate/up, down) of each layer
    missing_optional: list[str] = field(default_factory=list)
    extra_tensors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "n_checked": self.n_checked,
            "routed_quant_bits": self.routed_quant_bits,
            "routed_types": dict(self.routed_types),
            "routed_by_layer": [list(t) for t in self.routed_by_layer],
            "routed_mix": routed_mix(self.routed_by_layer),
            "missing_optional": list(self.missing_optional),
            "extra_tensors": list(self.extra_tensors),
            "warnings": list(self.warnings),
        }


def expected_tensors(cfg: ModelConfig) -> list[ExpectedTensor]:
    """Every tensor ds4 binds, in ds4's binding order, with accepted types and GGUF dims."""
    E, V, HC = cfg.n_embd, cfg.n_vocab, cfg.n_hc
    hc_dim = E * HC
    hc_mix = cfg.hc_mix
    q_dim = cfg.n_head * cfg.head_dim
    out_low = cfg.n_out_group * cfg.o_lora_rank
    group_in = cfg.head_dim * cfg.heads_per_group
    LQ, D, FF, NE = cfg.q_lora_rank, cfg.head_dim, cfg.n_ff_exp, cfg.n_expert
    ID, IH = cfg.indexer_head_dim, cfg.n_indexer_head

    out = [
        ExpectedTensor("token_embd.weight", F16, (E, V)),
        ExpectedTensor("output_hc_base.weight", F32, (HC,)),
        ExpectedTensor("output_hc_fn.weight", F16, (hc_dim, HC)),
        ExpectedTensor("output_hc_scale.weight", F32, (1,)),
        ExpectedTensor("output_norm.weight", F32, (E,)),
        ExpectedTensor("output.weight", Q8_0, (E, V)),
    ]
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        ratio = cfg.compress_ratio(il)

        def t(name: str, types, ne, required: bool = True) -> None:
            out.append(ExpectedTensor(p + name, tuple(types), tuple(ne), required, il))

        t("hc_attn_fn.weight", F16, (hc_dim, hc_mix))
        t("hc_attn_scale.weight", F32, (3,))
        t("hc_attn_base.weight", F32, (hc_mix,))
        t("attn_norm.weight", F32, (E,))
        t("attn_q_a.weight", Q8_0, (E, LQ))
        t("attn_q_a_norm.weight", F32, (LQ,))
        t("attn_q_b.weight", Q8_0, (LQ, q_dim))
        t("attn_kv.weight", Q8_0, (E, D))
        t("attn_kv_a_norm.weight", F32, (D,))
        t("attn_sinks.weight", F32, (cfg.n_head,))
        t("attn_output_a.weight", Q8_0, (group_in, out_low))
        t("attn_output_b.weight", Q8_0, (out_low, E))
        if ratio != 0:
            width = cfg.coff(il) * D
            t("attn_compressor_ape.weight", F16, (width, ratio))
            t("attn_compressor_kv.weight", F16, (E, width))
            t("attn_compressor_gate.weight", F16, (E, width))
            t("attn_compressor_norm.weight", F32, (D,))
        if ratio == 4:
            t("indexer.attn_q_b.weight", F16, (LQ, IH * ID))
            t("indexer.proj.weight", F16, (E, IH))
            t("indexer_compressor_ape.weight", F16, (2 * ID, ratio))
            t("indexer_compressor_kv.weight", F16, (E, 2 * ID))
            t("indexer_compressor_gate.weight", F16, (E, 2 * ID))
            t("indexer_compressor_norm.weight", F32, (ID,))
        t("hc_ffn_fn.weight", F16, (hc_dim, hc_mix))
        t("hc_ffn_scale.weight", F32, (3,))
        t("hc_ffn_base.weight", F32, (hc_mix,))
        t("ffn_norm.weight", F32, (E,))
        t("ffn_gate_inp.weight", F16, (E, NE))
        # Optional in ds4 for every layer: without it, selection uses the plain router scores.
        t("exp_probs_b.bias", F32, (NE,), required=False)
        t("ffn_gate_exps.weight", ROUTED, (E, FF, NE))
        t("ffn_up_exps.weight", ROUTED, (E, FF, NE))
        t("ffn_down_exps.weight", ROUTED, (FF, E, NE))
        t("ffn_gate_shexp.weight", Q8_0, (E, FF))
        t("ffn_up_shexp.weight", Q8_0, (E, FF))
        t("ffn_down_shexp.weight", Q8_0, (FF, E))
        if cfg.is_hash_layer(il):
            t("ffn_gate_tid2eid.weight", I32, (cfg.n_expert_used, V))
    return out


# A layer tensor's name as ds4 formats it (blk.%u.): ASCII decimal, no leading zero. Other spellings
# (blk.03., a non-ASCII digit) are not names ds4 would bind, so they are merely unknown.
_LAYER_NAME = re.compile(r"blk\.(0|[1-9][0-9]*)\.(.+)", re.ASCII | re.DOTALL)


def _stray_layer_tensor(name: str, cfg: ModelConfig, layer_suffixes: set[str]) -> str | None:
    """Why the tensor ``name``, which no expectation matched, contradicts the metadata; None if it
    is merely unknown (ignored, as ds4 does)."""
    m = _LAYER_NAME.fullmatch(name)
    if m is None:
        return None
    digits, suffix = m.groups()
    # int() of a corrupt name's thousands of digits is slow (and refused past 4300): any index
    # longer than 9 digits is past every block_count the config accepts.
    if len(digits) > 9 or int(digits) >= cfg.n_layer:
        return (f"belongs to layer {digits if len(digits) <= 12 else digits[:12] + '...'}, but "
                f"deepseek4.block_count is {cfg.n_layer} (layers 0..{cfg.n_layer - 1}): the file holds more "
                f"layers than its metadata says, and running {cfg.n_layer} would silently leave them out")
    il = int(digits)
    if suffix not in layer_suffixes:
        return None
    ratio = cfg.compress_ratio(il)
    if suffix == "ffn_gate_tid2eid.weight":
        return (f"is a hash routing table, but layer {il} is not a hash layer (deepseek4.hash_layer_count is "
                f"{cfg.n_hash_layer}): the layer would route by scores and the table be ignored")
    if suffix.startswith("indexer"):
        return (f"is an indexer tensor, but deepseek4.attention.compress_ratios[{il}] is {ratio} and only "
                f"ratio-4 layers have an indexer: it would be ignored")
    if suffix.startswith("attn_compressor"):
        return (f"is a compressor tensor, but deepseek4.attention.compress_ratios[{il}] is {ratio}, a layer "
                f"without a compressor: it would be ignored")
    # every per-layer kind that only some layers have is named above; kept for a future kind
    return f"is not a tensor layer {il} has under this file's metadata: it would be ignored"


def routed_quant_bits(tensors: Mapping[str, TensorInfo] | GGUFFile) -> int:
    """4 if layer 0's routed gate is Q4_K, 2 for any other type, 0 without one (ds4's rule).

    ds4 writes this into its KV-cache files and compares it on load (ds4_engine_routed_quant_bits, still
    layer 0 only in b0309611), so it is kept as ds4 computes it: 2 for ds4f-q2-q4 (IQ2_XXS in layer 0)
    and for ds4f-mxfp4 too. It describes no layer's arithmetic; ``routed_mix`` does."""
    if isinstance(tensors, GGUFFile):
        tensors = tensors.tensors
    gate = tensors.get("blk.0.ffn_gate_exps.weight")
    if gate is None:
        return 0
    return 4 if gate.ggml_type == GGMLType.Q4_K else 2


def _layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for il in layers:
        if runs and il == runs[-1][1] + 1:
            runs[-1][1] = il
        else:
            runs.append([il, il])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def routed_mix(routed_by_layer: list[tuple[str, str]]) -> str:
    """The routed-expert types layer by layer, one entry per (gate/up, down) pairing in order of its
    first layer: "IQ2_XXS/Q2_K layers 0-36, Q4_K layers 37-42" (one name when down is gate/up's type)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for il, pair in enumerate(routed_by_layer):
        groups.setdefault(tuple(pair), []).append(il)
    return ", ".join(f"{g if g == d else f'{g}/{d}'} layer{'s' if len(ls) > 1 else ''} {_layer_ranges(ls)}"
                     for (g, d), ls in groups.items())


def validate_layout(gguf_file: GGUFFile, cfg: ModelConfig) -> LayoutReport:
    """Check every tensor ds4 needs; LayoutError on the first problem, else a report.

    As ds4 does, all required names are looked up first (a missing tensor is reported before a
    misshaped one), then each tensor's type and dims are compared in binding order.
    """
    path = gguf_file.path
    tensors = gguf_file.tensors
    expected = expected_tensors(cfg)

    for e in expected:
        if e.required and e.name not in tensors:
            raise LayoutError(f"{path}: required tensor {e.name!r} is missing (expected {e.describe()})")

    missing_optional: list[str] = []
    for e in expected:
        t = tensors.get(e.name)
        if t is None:
            missing_optional.append(e.name)
            continue
        if t.ggml_type not in e.ggml_types and e.ggml_types == ROUTED:
            also = (f"; ds4 also takes {t.ggml_type.name} routed experts, ds4-mlx does not implement them"
                    if t.ggml_type in ROUTED_DS4_ONLY else "")
            raise LayoutError(f"{path}: layer {e.layer}: tensor {e.name!r} has type {t.ggml_type.name}, expected "
                              f"{' or '.join(x.name for x in e.ggml_types)} (a routed-expert type){also}")
        if t.ggml_type not in e.ggml_types:
            raise LayoutError(f"{path}: tensor {e.name!r} has type {t.ggml_type.name}, expected "
                              f"{' or '.join(x.name for x in e.ggml_types)} (expected {e.describe()}, "
                              f"found {t.ggml_type.name} {list(t.ne)})")
        if t.ne != e.ne:
            raise LayoutError(f"{path}: tensor {e.name!r} has GGUF dims {list(t.ne)}, expected {list(e.ne)} "
                              f"(expected {e.describe()}, found {t.ggml_type.name} {list(t.ne)})")

    routed_by_layer = []
    for il in range(cfg.n_layer):
        gate = tensors[f"blk.{il}.ffn_gate_exps.weight"].ggml_type
        up = tensors[f"blk.{il}.ffn_up_exps.weight"].ggml_type
        down = tensors[f"blk.{il}.ffn_down_exps.weight"].ggml_type
        if gate != up:
            raise LayoutError(f"{path}: layer {il}: routed gate/up experts use different quant types "
                              f"(ffn_gate_exps is {gate.name}, ffn_up_exps is {up.name}); ds4 needs one type")
        routed_by_layer.append((gate, down))

    known = {e.name for e in expected}
    layer_suffixes = {e.name.split(".", 2)[2] for e in expected if e.layer is not None}
    extra = []
    for name in tensors:
        if name in known:
            continue
        why = _stray_layer_tensor(name, cfg, layer_suffixes)
        if why is not None:
            shown = name if len(name) <= 96 else name[:96] + "..."
            raise LayoutError(f"{path}: tensor {shown!r} {why}")
        extra.append(name)
    warnings: list[str] = []
    if extra:
        shown = ", ".join(n if len(n) <= 64 else n[:64] + "..." for n in extra[:5]) + (", ..." if len(extra) > 5 else "")
        warnings.append(f"{len(extra)} tensor(s) ds4 does not use (ignored): {shown}")
    no_bias = [il for il in range(cfg.n_hash_layer, cfg.n_layer) if f"blk.{il}.exp_probs_b.bias" not in tensors]
    if no_bias:
        warnings.append(f"non-hash layers without exp_probs_b.bias (experts chosen by unbiased scores): {no_bias}")
    # types differing between layers are no warning: ds4f-q2-q4 is published so (``routed_mix``)

    g0, d0 = routed_by_layer[0]
    return LayoutReport(
        path=path,
        n_checked=sum(1 for e in expected if e.name in tensors),
        routed_quant_bits=routed_quant_bits(tensors),
        routed_types={"gate": g0.name, "up": g0.name, "down": d0.name},
        routed_by_layer=[(g.name, d.name) for g, d in routed_by_layer],
        missing_optional=missing_optional,
        extra_tensors=extra,
        warnings=warnings,
    )


def load_model_file(path: str | os.PathLike) -> tuple[GGUFFile, ModelConfig, LayoutReport]:
    """Open (mmap), read the config and validate the layout; the file is closed again on any error.

    Raises GGUFError for an unreadable container, LayoutError for a readable file that is not a
    DS4 Flash model ds4 would run. The returned file is guarded (``GGUFFile.guard``).
    """
    f = GGUFFile(path)
    try:
        cfg = ModelConfig.from_gguf(f)
        report = validate_layout(f, cfg)
    except BaseException:
        f.close()
        raise
    f.guard()  # the weights will be read: a SIGBUS from a truncated file names it
    return f, cfg, report


__all__ = [
    "ExpectedTensor",
    "LayoutReport",
    "expected_tensors",
    "routed_mix",
    "routed_quant_bits",
    "validate_layout",
    "load_model_file",
]
