"""Side by side with the mlx-lm DeepSeek V4 port (ml-explore/mlx-lm PR #1192): the same weights, the same
prompt, in one process, interleaved rounds (ours, peer, ours, peer, ...), medians and the ratios ours/peer.

    git clone https://github.com/ml-explore/mlx-lm /tmp/mlx-lm-pr1192
    git -C /tmp/mlx-lm-pr1192 fetch origin pull/1192/head && git -C /tmp/mlx-lm-pr1192 checkout FETCH_HEAD
    python benchmarks/bench_peer.py --peer /tmp/mlx-lm-pr1192 --model tiny.gguf [--json]

The peer is imported from that checkout (``sys.path``), never installed: only its model files are used
(``mlx_lm/models/deepseek_v4.py`` and what it imports: ``hyper_connection``, ``cache``, ``base``, ``mla``,
``switch_layers``, ``pipeline``, ``activations``), which need nothing but MLX. ``mlx_lm/__init__.py`` imports the
generation and conversion code and with it ``transformers``; it is bypassed (an empty package object is
registered for ``mlx_lm``), so no other part of mlx-lm runs.

The peer's model is built for the GGUF's weights: every tensor is mapped by name to the peer's parameter
(``peer_weight_map``; the names the peer's ``sanitize`` produces from the HF checkpoint) and dequantized to
float32 (Q8_0, F16, IQ2_XXS, Q2_K, F32 as stored; the I32 hash tables as int32). The peer expects float
weights or MLX-quantized ones (mxfp4/mxfp8/affine, from the HF checkpoint's FP4/FP8 through ``sanitize``);
GGUF's Q8_0/IQ2_XXS/Q2_K are none of these, so float32 is the one exact choice, and on the CPU the only one
that runs (MLX 0.32's CPU ``gather_mm``, which the peer's experts use, takes float32 only). It is also what
our side computes in on the CPU: our DEFAULT numerics hold the dense Q8_0/F16 weights dequantized to float32
and dequantize the selected routed experts (IQ2_XXS/Q2_K) to float32 on use. Both sides therefore read the
same quantized values and compute in float32; ours additionally does what ds4 does and the peer does not (FP8
rounding of KV rows, Hadamard + FP4 rounding in the indexer, the shared-expert clamp; see the logit check).

What is measured (``--rounds`` interleaved rounds after one untimed warm-up round of each side; medians):
* prefill: a cold session (ours: ``ds4_mlx.load`` + ``Session.sync``, logits of the last position read to
  the host) / a fresh peer cache run exactly as mlx-lm's ``generate_step`` prefills (all but the last token
  in one call, caches evaluated, then the last token as a step with its logits);
* decode: ``--decode`` steps after that prefill, teacher-forced with the same tokens for both (our greedy
  continuation from the warm-up round). Ours: ``Session.eval`` + ``Session.logits()`` (compiled decode, the
  engine's own loop); the peer: its ``generate_step`` loop (each step's graph built and ``async_eval``-ed
  before the previous token is read with ``.item()``), so each side is timed the way its users run it.

Logit checks (``--check-tokens 0`` skips them):
* as run: a short prompt on both (last-position logits, teacher-forced decode steps, each side's own greedy
  tokens), and the same figures for the long prompt from the first timed round. These differ by design:
  ds4 (and so ours) rounds KV rows to FP8 and f16 and the indexer's vectors to FP4 after a Hadamard
  transform, clamps the shared expert's SwiGLU, and carries the ratio-4 compressor's previous window across
  calls; the peer does none of these (the first window it emits in a call pools without the previous
  window: at every 4th decode step, and at the last prompt token, which ``generate_step`` feeds as a step,
  when that token closes a window: it does for a 24-token prompt, not for 993).
* aligned, after the timed rounds: ours with those roundings switched off (a patch of our model modules,
  undone afterwards; a fresh load) and the peer with its shared expert clamped and the whole prompt in one
  call. What remains is float32 rounding (~1e-5) if every weight went to the right place.
"""

from __future__ import annotations

import argparse
import importlib
import json
import lzma
import math
import os
import statistics
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ds4_mlx.errors import Ds4Error
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.formats.quants import dequantize

from bench_util import BENCH_DATA, read_text

HERE = Path(__file__).resolve().parent
# Manzoni's I promessi sposi (public domain), as the tokenizer tests hold it: its opening is the prompt
DEFAULT_PROMPT = BENCH_DATA / "promessi_sposi.txt.xz"
GET_PEER = ("git clone https://github.com/ml-explore/mlx-lm PATH && git -C PATH fetch origin pull/1192/head "
            "&& git -C PATH checkout FETCH_HEAD")
PEER_MODULES = ("deepseek_v4", "hyper_connection", "cache", "base", "mla", "switch_layers", "pipeline")


class PeerError(Exception):
    """The peer checkout is missing or is not the port this script knows (exit status 2)."""


# -- the weight mapping ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeerTensor:
    """Where one GGUF tensor goes in the peer's model: its parameter name and the shape the peer holds it
    in (row-major); ``int32`` for the hash-routing tables, float otherwise."""

    name: str
    shape: tuple[int, ...]
    int32: bool = False


def peer_weight_map(cfg: ModelConfig, tensor_names) -> tuple[dict[str, PeerTensor], list[str]]:
    """Map the GGUF tensors of a DS4 Flash file to the peer's parameters.

    Returns ``(mapping, unused)``: ``mapping`` GGUF name -> ``PeerTensor`` for every tensor the peer has a
    parameter for, ``unused`` the GGUF tensors neither side reads (a router bias on a hash-routed layer:
    ds4 ignores it there and the peer's hash gate has no such parameter). Any other name raises
    ``ValueError``: a tensor this mapping does not know would silently be left at the peer's init values.

    The names are those the peer's ``Model.sanitize`` makes from the HF checkpoint (``layers.N.`` ->
    ``model.layers.N.``, ``hc_attn_fn`` -> ``attn_hc.fn``, experts stacked into ``switch_mlp``, ``wo_a``
    reshaped to (groups, o_lora_rank, in) for its ``MultiLinear``); the HF names are those of
    ds4's GGUF converter (spec §2.2-2.5).
    """
    E, V, HC, D = cfg.n_embd, cfg.n_vocab, cfg.n_hc, cfg.head_dim
    LQ, FF, NE = cfg.q_lora_rank, cfg.n_ff_exp, cfg.n_expert
    IH, ID = cfg.n_indexer_head, cfg.indexer_head_dim
    mix = cfg.hc_mix
    table: dict[str, PeerTensor] = {
        "token_embd.weight": PeerTensor("model.embed_tokens.weight", (V, E)),
        "output_hc_fn.weight": PeerTensor("model.hc_head.fn", (HC, HC * E)),
        "output_hc_scale.weight": PeerTensor("model.hc_head.scale", (1,)),
        "output_hc_base.weight": PeerTensor("model.hc_head.base", (HC,)),
        "output_norm.weight": PeerTensor("model.norm.weight", (E,)),
        "output.weight": PeerTensor("lm_head.weight", (V, E)),
    }
    unused: set[str] = set()
    for il in range(cfg.n_layer):
        g, p = f"blk.{il}.", f"model.layers.{il}."
        ratio = cfg.compress_ratio(il)
        width = cfg.coff(il) * D

        def put(gguf: str, peer: str, shape, int32: bool = False) -> None:
            table[g + gguf] = PeerTensor(p + peer, tuple(shape), int32)

        for sub in ("attn", "ffn"):
            put(f"hc_{sub}_fn.weight", f"{sub}_hc.fn", (mix, HC * E))
            put(f"hc_{sub}_scale.weight", f"{sub}_hc.scale", (3,))
            put(f"hc_{sub}_base.weight", f"{sub}_hc.base", (mix,))
            put(f"{sub}_norm.weight", f"{sub}_norm.weight", (E,))
        put("attn_q_a.weight", "attn.wq_a.weight", (LQ, E))
        put("attn_q_a_norm.weight", "attn.q_norm.weight", (LQ,))
        put("attn_q_b.weight", "attn.wq_b.weight", (cfg.n_head * D, LQ))
        put("attn_kv.weight", "attn.wkv.weight", (D, E))
        put("attn_kv_a_norm.weight", "attn.kv_norm.weight", (D,))
        put("attn_sinks.weight", "attn.attn_sink", (cfg.n_head,))
        put("attn_output_a.weight", "attn.wo_a.weight", (cfg.n_out_group, cfg.o_lora_rank, D * cfg.heads_per_group))
        put("attn_output_b.weight", "attn.wo_b.weight", (E, cfg.n_out_group * cfg.o_lora_rank))
        if ratio:
            put("attn_compressor_ape.weight", "attn.compressor.ape", (ratio, width))
            put("attn_compressor_kv.weight", "attn.compressor.wkv.weight", (width, E))
            put("attn_compressor_gate.weight", "attn.compressor.wgate.weight", (width, E))
            put("attn_compressor_norm.weight", "attn.compressor.norm.weight", (D,))
        if ratio == 4:
            put("indexer.attn_q_b.weight", "attn.indexer.wq_b.weight", (IH * ID, LQ))
            put("indexer.proj.weight", "attn.indexer.weights_proj.weight", (IH, E))
            put("indexer_compressor_ape.weight", "attn.indexer.compressor.ape", (ratio, 2 * ID))
            put("indexer_compressor_kv.weight", "attn.indexer.compressor.wkv.weight", (2 * ID, E))
            put("indexer_compressor_gate.weight", "attn.indexer.compressor.wgate.weight", (2 * ID, E))
            put("indexer_compressor_norm.weight", "attn.indexer.compressor.norm.weight", (ID,))
        put("ffn_gate_inp.weight", "ffn.gate.weight", (NE, E))
        if cfg.is_hash_layer(il):
            put("ffn_gate_tid2eid.weight", "ffn.gate.tid2eid", (V, cfg.n_expert_used), int32=True)
            unused.add(g + "exp_probs_b.bias")
        else:
            put("exp_probs_b.bias", "ffn.gate.e_score_correction_bias", (NE,))
        put("ffn_gate_exps.weight", "ffn.switch_mlp.gate_proj.weight", (NE, FF, E))
        put("ffn_up_exps.weight", "ffn.switch_mlp.up_proj.weight", (NE, FF, E))
        put("ffn_down_exps.weight", "ffn.switch_mlp.down_proj.weight", (NE, E, FF))
        put("ffn_gate_shexp.weight", "ffn.shared_experts.gate_proj.weight", (FF, E))
        put("ffn_up_shexp.weight", "ffn.shared_experts.up_proj.weight", (FF, E))
        put("ffn_down_shexp.weight", "ffn.shared_experts.down_proj.weight", (E, FF))

    names = list(tensor_names)
    unknown = [n for n in names if n not in table and n not in unused]
    if unknown:
        raise ValueError(f"{len(unknown)} GGUF tensor(s) have no place in the peer's model, e.g. {unknown[0]!r}")
    present = set(names)
    return {k: v for k, v in table.items() if k in present}, sorted(unused & present)


def peer_args(cfg: ModelConfig) -> dict:
    """The peer's ``ModelArgs`` for this GGUF (the HF config.json fields of DS4 Flash, from the GGUF metadata)."""
    return dict(
        model_type="deepseek_v4", vocab_size=cfg.n_vocab, hidden_size=cfg.n_embd,
        moe_intermediate_size=cfg.n_ff_exp, intermediate_size=cfg.n_ff_exp, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_head_kv, n_shared_experts=cfg.n_expert_shared,
        n_routed_experts=cfg.n_expert, routed_scaling_factor=cfg.expert_weights_scale, q_lora_rank=cfg.q_lora_rank,
        qk_rope_head_dim=cfg.n_rot, num_experts_per_tok=cfg.n_expert_used, norm_topk_prob=cfg.expert_weights_norm,
        hidden_act="silu", max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.rms_eps,
        rope_theta=cfg.rope_freq_base, head_dim=cfg.head_dim, scoring_func="sqrtsoftplus",
        rope_scaling={"type": "yarn", "factor": cfg.rope_scaling_factor,
                      "original_max_position_embeddings": cfg.rope_orig_ctx,
                      "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow},
        compress_ratios=list(cfg.compress_ratios), compress_rope_theta=cfg.compress_rope_freq_base,
        hc_mult=cfg.n_hc, hc_sinkhorn_iters=cfg.hc_sinkhorn_iter, hc_eps=cfg.hc_eps,
        num_hash_layers=cfg.n_hash_layer, swiglu_limit=cfg.swiglu_clamp[0], sliding_window=cfg.n_swa,
        o_groups=cfg.n_out_group, o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.n_indexer_head,
        index_head_dim=cfg.indexer_head_dim, index_topk=cfg.indexer_top_k, num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    )


def peer_weights(gguf, cfg: ModelConfig, dtype=mx.float32) -> list[tuple[str, mx.array]]:
    """Every mapped GGUF tensor, dequantized to ``dtype`` (int32 tables stay int32), under its peer name."""
    mapping, _ = peer_weight_map(cfg, gguf.tensors)
    out = []
    for gname, dst in mapping.items():
        info = gguf.tensors[gname]
        if info.ggml_type == GGMLType.I32:
            arr = np.array(gguf.tensor_array(gname), dtype=np.int32)
        else:
            arr = dequantize(gguf.tensor_data(gname), info.ggml_type, info.n_elements)
        arr = np.ascontiguousarray(arr).reshape(dst.shape)
        a = mx.array(arr)
        out.append((dst.name, a if dst.int32 else a.astype(dtype)))
    return out


# -- the peer ---------------------------------------------------------------------------------------------

def import_peer(root: str | os.PathLike):
    """The peer's ``deepseek_v4`` module from an mlx-lm checkout at ``root`` (see the module docstring)."""
    pkg_dir = Path(root) / "mlx_lm"
    if not (pkg_dir / "models" / "deepseek_v4.py").is_file():
        raise PeerError(f"{root}: no mlx_lm/models/deepseek_v4.py (an mlx-lm checkout of PR #1192 is needed: "
                        f"{GET_PEER})")
    loaded = sys.modules.get("mlx_lm")
    if loaded is not None and list(getattr(loaded, "__path__", [])) != [str(pkg_dir)]:
        raise PeerError(f"another mlx_lm is already imported ({getattr(loaded, '__path__', loaded)})")
    pkg = types.ModuleType("mlx_lm")
    pkg.__path__ = [str(pkg_dir)]
    sys.modules["mlx_lm"] = pkg
    try:
        mod = importlib.import_module("mlx_lm.models.deepseek_v4")
    except ImportError as exc:
        raise PeerError(f"{root}: importing the peer's deepseek_v4 failed: {exc}") from None
    for name in ("Model", "ModelArgs"):
        if not hasattr(mod, name):
            raise PeerError(f"{root}: mlx_lm/models/deepseek_v4.py has no {name} (not the PR #1192 port?)")
    return mod


def build_peer(mod, gguf, cfg: ModelConfig, dtype=mx.float32):
    args = mod.ModelArgs.from_dict(peer_args(cfg))
    model = mod.Model(args)
    # strict both ways: every parameter of the peer's model is given (nothing left at its init values) and
    # every weight given lands on a parameter of the same shape (another revision of the port could rename one)
    weights = peer_weights(gguf, cfg, dtype)
    params = dict(tree_flatten(model.parameters()))
    for name, w in weights:
        if name not in params:
            raise PeerError(f"the peer's model has no parameter {name!r} (not the PR #1192 port's names?)")
        if tuple(params[name].shape) != tuple(w.shape):
            raise PeerError(f"the peer's {name} has shape {tuple(params[name].shape)}, the GGUF gives "
                            f"{tuple(w.shape)}")
    missing = set(params) - {k for k, _ in weights}
    if missing:
        # a non-hash layer without the optional router bias: ds4 selects on the plain scores, the peer's
        # zero-initialised bias does the same
        bias_only = {k for k in missing if k.endswith(".ffn.gate.e_score_correction_bias")}
        if missing - bias_only:
            raise PeerError(f"the peer's model has parameters the GGUF does not give: "
                            f"{sorted(missing - bias_only)[:3]}")
    model.load_weights(weights, strict=False)
    model.eval()
    mx.eval(model.parameters())
    return model


class PeerRunner:
    """The peer run as mlx-lm's ``generate_step`` runs it (prefill in one call of all but the last token,
    then the last token as a step; decode steps built and ``async_eval``-ed one ahead)."""

    def __init__(self, model):
        self.model = model

    def _step(self, cache, token):
        logits = self.model(mx.array([[token]], dtype=mx.int32), cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logits[0]

    def prefill(self, tokens: list[int]):
        """(cache, first sampled token array, last-position logits array), all evaluated."""
        cache = self.model.make_cache()
        if len(tokens) > 1:
            self.model(mx.array([tokens[:-1]], dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
        y, logits = self._step(cache, tokens[-1])
        mx.eval(y, logits)
        return cache, y, logits

    def decode(self, cache, feed: list[int]) -> tuple[float, list]:
        """Teacher-forced steps on ``feed``: (seconds, the logits of each step as lazy-then-evaluated arrays)."""
        out = []
        t0 = time.perf_counter()
        cur = self._step(cache, feed[0])
        mx.async_eval(*cur)
        for i in range(len(feed)):
            if i + 1 < len(feed):
                nxt = self._step(cache, feed[i + 1])
                mx.async_eval(*nxt)
            cur[0].item()
            out.append(cur[1])
            if i + 1 < len(feed):
                cur = nxt
        return time.perf_counter() - t0, out

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        cache, y, _ = self.prefill(tokens)
        got = [int(y.item())]
        while len(got) < n:
            y, _ = self._step(cache, got[-1])
            got.append(int(y.item()))
        return got


# -- our side ---------------------------------------------------------------------------------------------

class OursRunner:
    def __init__(self, engine, ctx: int):
        self.engine = engine
        self.ctx = ctx

    def prefill(self, tokens: list[int]):
        s = self.engine.new_session(ctx=self.ctx, compile=True)
        s.sync(tokens)
        return s, s.logits()

    def decode(self, s, feed: list[int]) -> tuple[float, list[np.ndarray]]:
        out = []
        t0 = time.perf_counter()
        for tok in feed:
            s.eval(tok)
            out.append(s.logits())
        return time.perf_counter() - t0, out

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        s, lg = self.prefill(tokens)
        got = [int(np.argmax(lg))]
        while len(got) < n:
            s.eval(got[-1])
            got.append(int(np.argmax(s.logits())))
        return got


# -- the aligned check ------------------------------------------------------------------------------------

# ds4's rounding steps the peer does not have (spec §13): FP8 of KV rows, f16 storage of KV rows, Hadamard +
# FP4 of the indexer's queries and rows. The aligned check swaps them for the identity in our model modules.
DS4_ONLY_ROUNDINGS = ("fp8_kv_round", "f16_round", "indexer_qat")


class without_ds4_roundings:
    """Context manager: our model modules with the roundings of ``DS4_ONLY_ROUNDINGS`` replaced by the
    identity (every ``ds4_mlx.model.*`` module that imported one of them from ``ds4_mlx.model.numerics``), and
    the peer's shared expert clamped as ds4 clamps it. For the weight-mapping check only: the timed runs are
    over before it is entered and everything is put back when it exits. ``patched`` lists what was replaced
    (empty if our internals no longer look like this, and the check then says so instead of running)."""

    def __init__(self, peer_model, limit: float):
        self.peer_model, self.limit = peer_model, limit
        self.patched: list[str] = []
        self._undo: list = []

    def __enter__(self):
        try:
            from ds4_mlx.model import numerics
        except ImportError:
            return self
        originals = {getattr(numerics, n, None): n for n in DS4_ONLY_ROUNDINGS}
        originals.pop(None, None)
        for mname, module in list(sys.modules.items()):
            if not mname.startswith("ds4_mlx.model.") or module is None or module is numerics:
                continue
            for attr, value in list(vars(module).items()):
                if attr in DS4_ONLY_ROUNDINGS and value in originals:
                    self._undo.append((module, attr, value))
                    setattr(module, attr, _identity)
                    self.patched.append(f"{mname}.{attr}")
        for layer in self.peer_model.model.layers:
            shared = layer.ffn.shared_experts
            self._undo.append((shared, "swiglu_limit", shared.swiglu_limit))
            shared.swiglu_limit = self.limit
        return self

    def __exit__(self, *exc):
        for obj, attr, value in reversed(self._undo):
            setattr(obj, attr, value)
        return False


def _identity(x, *args, **kwargs):
    return x


def aligned_check(args, peer_model, cfg, lengths: list[int], ids: list[int], log) -> dict:
    """Logits of ours (a fresh load) and the peer (the whole prompt in one call) with the known differences
    taken out: they must agree to float32 rounding, else the weight mapping (or the peer) is wrong."""
    out = {}
    with without_ds4_roundings(peer_model, cfg.swiglu_clamp[0]) as patch:
        if not patch.patched:
            log("aligned check skipped: ds4_mlx.model no longer imports the roundings it switches off")
            return {"skipped": True}
        engine = ds4_mlx.load(args.model, numerics="default")  # fresh: nothing traced before the patch
        ours = OursRunner(engine, ctx=max(lengths) + 8)
        for n in lengths:
            _, lo = ours.prefill(ids[:n])
            lp = peer_model(mx.array([ids[:n]], dtype=mx.int32), cache=peer_model.make_cache())[0, -1]
            d = max_abs_diff(lo, lp)
            agree = int(np.argmax(lo)) == int(np.argmax(np.array(lp)))
            log(f"aligned check, {n} tokens (ds4-only roundings off, peer's shared expert clamped, peer in one call): "
                f"max |dlogit| {d:.3g}, argmax {'equal' if agree else 'DIFFERENT'}")
            out[str(n)] = {"max_abs_dlogit": d, "argmax_equal": agree}
    out["patched"] = patch.patched
    return out


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float32) - np.asarray(b, dtype=np.float32))))


# -- main -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", default=os.environ.get("DS4_MLX_PEER"),
                    help="an mlx-lm checkout of PR #1192 (default: $DS4_MLX_PEER)")
    ap.add_argument("--model", default=os.environ.get("DS4_MLX_TINY_MODEL"),
                    help="DS4 Flash GGUF (default: $DS4_MLX_TINY_MODEL)")
    ap.add_argument("--prompt-file", type=Path, default=DEFAULT_PROMPT)
    ap.add_argument("--prompt-tokens", type=int, default=993,
                    help="BOS + the file's first tokens, this many in all (default 993)")
    ap.add_argument("--decode", type=int, default=32, help="timed decode steps per round (default 32)")
    ap.add_argument("--rounds", type=int, default=5, help="timed interleaved rounds (default 5)")
    ap.add_argument("--check-tokens", type=int, default=24,
                    help="prompt length of the short logit check (default 24; 0 skips it)")
    ap.add_argument("--check-decode", type=int, default=8, help="decode steps of the short logit check")
    ap.add_argument("--json", action="store_true", help="print one JSON object (nothing else on stdout)")
    args = ap.parse_args(argv)

    for name in ("prompt_tokens", "decode", "rounds"):
        if getattr(args, name) < 1:
            print(f"bench_peer: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.check_tokens < 0 or args.check_decode < 0:
        print("bench_peer: --check-tokens and --check-decode must be >= 0", file=sys.stderr)
        return 2
    if not args.peer:
        print(f"bench_peer: needs --peer PATH, an mlx-lm checkout of PR #1192; get one with: {GET_PEER}",
              file=sys.stderr)
        return 2
    if not args.model:
        print("bench_peer: needs --model PATH (a DS4 Flash GGUF, e.g. the tiny model) or $DS4_MLX_TINY_MODEL",
              file=sys.stderr)
        return 2
    try:
        peer_mod = import_peer(args.peer)
    except PeerError as exc:
        print(f"bench_peer: {exc}", file=sys.stderr)
        return 2
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    try:
        result = run(args, peer_mod, log)
    except (PeerError, Ds4Error) as exc:
        print(f"bench_peer: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def read_prompt(path: Path) -> str:
    """The text of a prompt file, decompressed when its name ends in ``.xz``."""
    try:
        return read_text(path)
    except (OSError, UnicodeDecodeError, lzma.LZMAError, EOFError) as exc:
        raise PeerError(f"cannot read the prompt file {path}: {exc}") from None


def prompt_ids(tokenizer, bos: int, text: str, n: int) -> list[int] | None:
    """BOS + the text's first tokens, ``n`` in all (None when the text holds fewer). Only a prefix is
    encoded (the novel is ~417k tokens, seconds to encode): up to a line end past 16 characters per
    token wanted, longer while that gives fewer than n + 16 tokens; the margin keeps the cut's
    pre-tokenizer chunk clear of the tokens kept, so they are those of the whole text."""
    end = 16 * n
    while True:
        cut = text.find("\n", end)
        cut = len(text) if cut < 0 else cut
        ids = [bos] + tokenizer.encode(text[:cut])
        if len(ids) >= n + 16 or cut == len(text):
            return ids[:n] if len(ids) >= n else None
        end = 2 * cut


def run(args, peer_mod, log) -> dict:
    text = read_prompt(args.prompt_file)
    t0 = time.perf_counter()
    engine = ds4_mlx.load(args.model, numerics="default")
    t_ours = time.perf_counter() - t0
    cfg = engine.config
    t0 = time.perf_counter()
    peer_model = build_peer(peer_mod, engine.network.source, cfg, mx.float32)
    t_peer = time.perf_counter() - t0

    prompt = prompt_ids(engine.tokenizer, engine.bos_id, text, args.prompt_tokens)
    if prompt is None:
        raise PeerError(f"{args.prompt_file} gives fewer than --prompt-tokens {args.prompt_tokens} tokens "
                        "(with BOS)")
    ours = OursRunner(engine, ctx=len(prompt) + args.decode + 8)
    peer = PeerRunner(peer_model)
    log(f"model {args.model}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_expert} experts "
        f"(k={cfg.n_expert_used}),"
        f" window {cfg.n_swa}, indexer top-k {cfg.indexer_top_k}")
    log(f"peer {args.peer} (mlx-lm PR #1192), weights dequantized to float32; "
        f"ours: DEFAULT numerics, compiled decode; MLX {mx.__version__}, device {mx.default_device()}")
    log(f"load: ours {t_ours:.2f} s, peer {t_peer:.2f} s (dequantize + build)")

    result: dict = {
        "model": str(args.model), "peer": str(args.peer), "peer_dtype": "float32",
        "mlx": mx.__version__, "device": str(mx.default_device()), "prompt_tokens": len(prompt),
        "decode_tokens": args.decode, "rounds": args.rounds,
    }

    if args.check_tokens:
        short = prompt[:args.check_tokens]
        _, lo = ours.prefill(short)
        _, _, lp = peer.prefill(short)
        ours_greedy = ours.greedy(short, args.check_decode + 1)
        peer_greedy = peer.greedy(short, args.check_decode + 1)
        feed = ours_greedy[:args.check_decode]
        s, _ = ours.prefill(short)
        _, dec_o = ours.decode(s, feed)
        cache, _, _ = peer.prefill(short)
        _, dec_p = peer.decode(cache, feed)
        d_prefill = max_abs_diff(lo, lp)
        d_decode = [max_abs_diff(a, b) for a, b in zip(dec_o, dec_p)]
        scale = float(np.std(lo))
        log(f"logit check, {len(short)}-token prompt: max |dlogit| after the prompt {d_prefill:.3g} "
            f"(logit std {scale:.3g}), argmax ours {int(np.argmax(lo))} / peer {int(np.argmax(np.array(lp)))}")
        log(f"  teacher-forced decode, max |dlogit| per step: {', '.join(f'{d:.3g}' for d in d_decode)}")
        log(f"  greedy ours {ours_greedy}")
        log(f"  greedy peer {peer_greedy}  ({sum(a == b for a, b in zip(ours_greedy, peer_greedy))}"
            f"/{len(ours_greedy)} equal)")
        result["check"] = {"prompt_tokens": len(short), "max_abs_dlogit_prefill": d_prefill, "logit_std": scale,
                           "max_abs_dlogit_decode": d_decode, "greedy_ours": ours_greedy,
                           "greedy_peer": peer_greedy}

    # warm-up (untimed): first use dequantizes our weights and traces both sides' compiled functions; our
    # greedy continuation is the teacher-forced feed of every timed round
    s, lg = ours.prefill(prompt)
    feed = [int(np.argmax(lg))]
    for _ in range(args.decode - 1):
        s.eval(feed[-1])
        feed.append(int(np.argmax(s.logits())))
    cache, _, _ = peer.prefill(prompt)
    peer.decode(cache, feed)

    pre = {"ours": [], "peer": []}
    dec = {"ours": [], "peer": []}
    d_pre, d_dec = 0.0, [0.0] * args.decode
    argmax_agree = 0
    log(f"{args.rounds} rounds, interleaved: prefill {len(prompt)} tokens, then {args.decode} teacher-forced "
        f"decode steps")
    for r in range(args.rounds):
        t0 = time.perf_counter()
        s, lo = ours.prefill(prompt)
        pre["ours"].append(time.perf_counter() - t0)
        dt, dec_o = ours.decode(s, feed)
        dec["ours"].append(dt / args.decode)

        t0 = time.perf_counter()
        cache, _, lp = peer.prefill(prompt)
        pre["peer"].append(time.perf_counter() - t0)
        dt, dec_p = peer.decode(cache, feed)
        dec["peer"].append(dt / args.decode)

        if r == 0:
            d_pre = max_abs_diff(lo, lp)
            d_dec = [max_abs_diff(a, b) for a, b in zip(dec_o, dec_p)]
            argmax_agree = sum(int(np.argmax(a)) == int(np.argmax(np.array(b))) for a, b in zip(dec_o, dec_p))
        log(f"  round {r + 1}: prefill ours {pre['ours'][-1]:.3f} s, peer {pre['peer'][-1]:.3f} s; "
            f"decode ours {dec['ours'][-1] * 1e3:.1f} ms/token, peer {dec['peer'][-1] * 1e3:.1f} ms/token")

    med = {k: {side: statistics.median(v[side]) for side in v} for k, v in (("prefill", pre), ("decode", dec))}
    prefill_tps = {side: len(prompt) / med["prefill"][side] for side in ("ours", "peer")}
    decode_tps = {side: 1.0 / med["decode"][side] for side in ("ours", "peer")}
    log(f"logits on the {len(prompt)}-token prompt: max |dlogit| {d_pre:.3g} after the prompt; teacher-forced "
        f"decode steps max {max(d_dec):.3g} (first {d_dec[0]:.3g}), argmax equal at {argmax_agree}/{args.decode} steps")
    # each round's own ratio too: ours and the peer ran back to back, so a load change between rounds (a
    # shared machine) cancels in it; their median and range show how far the ratio of medians can be trusted
    round_ratio = {k: [p / o for o, p in zip(v["ours"], v["peer"])] for k, v in (("prefill", pre), ("decode", dec))}

    def spread(k: str) -> str:
        r = round_ratio[k]
        return f"per-round ratios median {statistics.median(r):.2f}x, range {min(r):.2f}-{max(r):.2f}x"

    log(f"prefill  ours {prefill_tps['ours']:8.1f} t/s   peer {prefill_tps['peer']:8.1f} t/s   "
        f"ours/peer {prefill_tps['ours'] / prefill_tps['peer']:.2f}x   ({spread('prefill')})")
    log(f"decode   ours {decode_tps['ours']:8.2f} t/s   peer {decode_tps['peer']:8.2f} t/s   "
        f"ours/peer {decode_tps['ours'] / decode_tps['peer']:.2f}x   ({spread('decode')})")
    result.update({
        "prefill_tps": prefill_tps, "decode_tps": decode_tps,
        "prefill_ratio": prefill_tps["ours"] / prefill_tps["peer"],
        "decode_ratio": decode_tps["ours"] / decode_tps["peer"],
        "prefill_ratio_per_round": round_ratio["prefill"], "decode_ratio_per_round": round_ratio["decode"],
        "prefill_seconds": pre, "decode_seconds_per_token": dec,
        "max_abs_dlogit_prefill": d_pre, "max_abs_dlogit_decode": d_dec, "decode_argmax_equal": argmax_agree,
        "load_seconds": {"ours": t_ours, "peer": t_peer},
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    })
    if not all(math.isfinite(v) for v in (d_pre, *d_dec)):
        log("WARNING: non-finite logits on one side")
    if args.check_tokens:
        lengths = sorted({min(args.check_tokens, len(prompt)), len(prompt)})
        result["aligned_check"] = aligned_check(args, peer_model, cfg, lengths, prompt, log)
    return result


if __name__ == "__main__":
    sys.exit(main())
