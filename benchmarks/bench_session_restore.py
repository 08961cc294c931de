"""Restoring a session from disk vs re-prefilling the same prefix; payload size per token.

    python benchmarks/bench_session_restore.py                      # tiny model, lengths 128..1024
    python benchmarks/bench_session_restore.py --model medium.gguf --lengths 512,2048
    python benchmarks/bench_session_restore.py --crossover          # decode vs resumed prefill

Model: ``--model PATH``, else ``$DS4_MLX_TINY_MODEL``, else a tiny
model is generated into a temp dir with ``scripts/make_tiny_model.py`` (``--preset medium``
makes the 4-layer real-dims model for ``--model``). Tokens are random ids (seeded); the cost of a
prefill and the size of a state do not depend on which ids.

Per length n: cold prefill time (after one warm-up prefill, which pays the lazy weight
dequantization), payload save time and bytes, load time of the payload file into a fresh session
(read + checksum + checks + arrays), and the speed-up. Size columns: our payload, ds4's CPU payload
for the same config (``ds4_session_payload_bytes``: all f32, whole frontiers), and the growth per
token between consecutive lengths next to spec §9.2's f32 compressed state per token (+ 4 bytes
per token id).

``--crossover``: for suffixes of m = 1..8 tokens at position ``--base``, m one-token decode steps
vs one m-token chunk (min over ``--reps``); the session's ``resume_prefill_min`` is the smallest m
where the chunk wins.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import numpy as np

from ds4_mlx.engine import payload as P
from ds4_mlx.engine.session import Session
from ds4_mlx.synth import benchmark_model_path



def ds4_payload_bytes(cfg, n: int) -> int:
    """ds4_session_payload_bytes (CPU) transposed to this config: 13 u32 header, tokens, logits,
    two u32 counts per layer, then every tensor in f32 with whole compressor frontiers."""
    total = 52 + 4 * n + 4 * cfg.n_vocab + 8 * cfg.n_layer
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        total += min(n, cfg.n_swa) * cfg.head_dim * 4
        if r:
            coff = 2 if r == 4 else 1
            total += (n // r) * cfg.head_dim * 4 + 2 * (coff * r) * (coff * cfg.head_dim) * 4
        if r == 4:
            total += (n // 4) * cfg.indexer_head_dim * 4 + 2 * 8 * (2 * cfg.indexer_head_dim) * 4
    return total


def bench_lengths(model, lengths: list[int], tokens: np.ndarray, chunk: int, tmp: Path, reps: int) -> list[dict]:
    cfg = model.config
    ctx = max(lengths) + 1
    warm = Session(model, ctx, chunk=chunk)
    warm.sync(list(tokens[:min(lengths)]))
    rows = []
    for n in lengths:
        prefix = [int(t) for t in tokens[:n]]
        t_pre = []
        for _ in range(reps):
            s = Session(model, ctx, chunk=chunk)
            t0 = time.perf_counter()
            s.sync(prefix)
            t_pre.append(time.perf_counter() - t0)
        path = tmp / f"s{n}.payload"
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            size = s.save_payload(fh)
        t_save = time.perf_counter() - t0
        t_load = []
        for _ in range(reps):
            r = Session(model, ctx, chunk=chunk)
            t0 = time.perf_counter()
            r.load_payload_file(path)
            r.logits()
            t_load.append(time.perf_counter() - t0)
        if not np.array_equal(r.logits().view(np.uint32), s.logits().view(np.uint32)):
            raise SystemExit(f"n={n}: restored logits differ from the saved session's")
        rows.append(dict(n=n, prefill_s=min(t_pre), save_s=t_save, load_s=min(t_load),
                         speedup=min(t_pre) / min(t_load), payload_bytes=size, ds4_bytes=ds4_payload_bytes(cfg, n)))
    return rows


def bench_crossover(model, tokens: np.ndarray, base: int, reps: int) -> list[dict]:
    # resume_prefill_min=1: append() always runs one chunk (eval() is a one-token step either way)
    s = Session(model, base + 16, chunk=1 << 20, auto_checkpoints=0, resume_prefill_min=1)
    s.sync([int(t) for t in tokens[:base]])
    snap = s.snapshot()
    s.append([int(t) for t in tokens[base:base + 8]])  # warm-up of both shapes
    s.restore(snap)
    out = []
    for m in range(1, 9):
        suffix = [int(t) for t in tokens[base:base + m]]
        dec, pre = [], []
        for _ in range(reps):
            s.restore(snap)
            t0 = time.perf_counter()
            for t in suffix:
                s.eval(t)
            dec.append(time.perf_counter() - t0)
            s.restore(snap)
            t0 = time.perf_counter()
            s.append(suffix)
            pre.append(time.perf_counter() - t0)
        out.append(dict(m=m, decode_ms=1e3 * min(dec), chunk_ms=1e3 * min(pre)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF (default: the tiny model, see above)")
    ap.add_argument("--numerics", choices=["default", "ds4-cpu"], default="default")
    ap.add_argument("--lengths", default="128,256,512,1024", help="comma-separated prefix lengths")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048)")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per timing (min is reported)")
    ap.add_argument("--crossover", action="store_true", help="measure decode vs chunk for short suffixes instead")
    ap.add_argument("--base", type=int, default=300, help="--crossover: position of the suffix")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ds4-bench-restore-") as td:
        tmp = Path(td)
        path = benchmark_model_path(args.model, tmp)
        model = ds4_mlx.load(path, numerics=args.numerics).network
        cfg = model.config
        tokens = np.random.default_rng(1234).integers(0, cfg.n_vocab, 1 << 16)
        if args.crossover:
            rows = bench_crossover(model, tokens, args.base, args.reps)
            if args.json:
                print(json.dumps(rows, indent=1))
                return 0
            print(f"model {path.name} numerics {args.numerics}: suffix of m tokens at position {args.base}")
            print(f"{'m':>3} {'m decodes ms':>13} {'one chunk ms':>13} {'ratio':>6}")
            for r in rows:
                ratio = r["decode_ms"] / r["chunk_ms"]
                print(f"{r['m']:>3} {r['decode_ms']:>13.1f} {r['chunk_ms']:>13.1f} {ratio:>6.2f}")
            win = [r["m"] for r in rows if r["chunk_ms"] < r["decode_ms"] and r["m"] > 1]
            print(f"crossover (smallest m > 1 where one chunk is faster): {win[0] if win else 'none up to 8'}")
            return 0

        lengths = sorted(int(x) for x in args.lengths.split(","))
        rows = bench_lengths(model, lengths, tokens, args.chunk, tmp, args.reps)
        theory = P.compressed_bytes_per_token(cfg)
        if args.json:
            print(json.dumps(dict(model=str(path), numerics=args.numerics, theory_f32_bytes_per_token=theory,
                                  rows=rows), indent=1))
            return 0
        print(f"model {path.name} ({cfg.n_layer} layers, head_dim {cfg.head_dim}, ratios "
              f"{list(cfg.compress_ratios[:cfg.n_layer])}), numerics {args.numerics}, chunk {args.chunk}")
        print(f"{'n':>6} {'prefill s':>10} {'load s':>8} {'speedup':>8} {'save s':>7} {'payload B':>11} "
              f"{'B/token':>8} {'ds4 payload B':>14} {'growth B/tok':>13}")
        prev = None
        for r in rows:
            growth = ("" if prev is None else
                      f"{(r['payload_bytes'] - prev['payload_bytes']) / (r['n'] - prev['n']):.1f}")
            print(f"{r['n']:>6} {r['prefill_s']:>10.3f} {r['load_s']:>8.3f} {r['speedup']:>7.1f}x {r['save_s']:>7.3f} "
                  f"{r['payload_bytes']:>11} {r['payload_bytes'] / r['n']:>8.0f} {r['ds4_bytes']:>14} {growth:>13}")
            prev = r
        print(f"spec §9.2 compressed state, f32: {theory:.1f} B/token (+4 B token id = {theory + 4:.1f}); "
              f"this payload stores rows as f16: {theory / 2 + 4:.1f} B/token asymptotically")
    return 0


if __name__ == "__main__":
    sys.exit(main())
