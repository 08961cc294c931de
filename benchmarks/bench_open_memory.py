#!/usr/bin/env python3
"""Memory and time of opening a model: mmap open, config + layout validation, tokenizer.

    python benchmarks/bench_open_memory.py [--model PATH] [--keep DIR] [--json]

Without ``--model`` it writes a >= 1 GB random-weight DS4 model with the real tokenizer into a
temporary folder (scripts/make_tiny_model.py when present, else the oracle generator). Each
measurement runs in a fresh Python process, reading VmRSS / RssAnon / RssFile from
/proc/self/status after each step:

  baseline   imports done (numpy, ds4_mlx, the tokenizer module), nothing opened
  open       GGUFFile(path): header, metadata and tensor directory parsed; tensor data not read
  validate   ModelConfig.from_gguf + validate_layout
  views      a zero-copy numpy view of every tensor (touches no tensor data)
  tokenizer  Tokenizer.from_gguf (if ds4_mlx.tokenizer provides it)

Growth is reported against the file size; the target is < 5 % for the whole (open + config +
layout + views + tokenizer), and the last line says PASS or FAIL. Anonymous memory should be about
the size of the tokenizer tables (string arrays stay in the file until read; the tokenizer keeps a
compact vocabulary and its merge table), file-backed memory the header pages read, and nothing
should grow with the tensor data. The growth is a fixed cost (~33 MiB with the real 129k-token
vocabulary, ~13 MiB of it the BPE merge table), so the fraction falls with the file size: ~3 % of
the default 1.07 GiB model, ~0.04 % of the 81 GB one. Also times GGUFFile open on the file (best of
several, warm page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_FRACTION = 0.05
# 6 layers at n_embd 1024 with 256 experts of width 512 and the real 129k vocabulary: ~1.25 GB
DEFAULT_DIMS = ["--n-layer", "6", "--n-embd", "1024", "--n-expert", "256", "--n-ff-exp", "512",
                "--n-expert-used", "6"]

_CHILD = r"""
import json, sys, time
path = sys.argv[1]

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out

steps = []
def mark(name, t0):
    steps.append({"step": name, "seconds": round(time.perf_counter() - t0, 6), **status()})

t0 = time.perf_counter()
import numpy as np
import ds4_mlx
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.formats.config import ModelConfig
from ds4_mlx.formats.layout import validate_layout
try:
    from ds4_mlx.tokenizer.tokenizer import Tokenizer
except ImportError:
    Tokenizer = None
import gc
gc.collect()
mark("baseline", t0)

t0 = time.perf_counter()
f = GGUFFile(path)
mark("open", t0)

t0 = time.perf_counter()
cfg = ModelConfig.from_gguf(f)
report = validate_layout(f, cfg)
mark("validate", t0)

t0 = time.perf_counter()
views = [f.tensor_array(name) for name in f.tensors]
mark("views", t0)

if Tokenizer is not None and hasattr(Tokenizer, "from_gguf"):
    t0 = time.perf_counter()
    tok = Tokenizer.from_gguf(f)
    mark("tokenizer", t0)

print(json.dumps({"steps": steps, "n_tensors": len(f.tensors), "header_bytes": f.data_offset,
                  "routed_quant_bits": report.routed_quant_bits}))
"""

_TIMING = r"""
import json, sys, time
from ds4_mlx.formats.gguf import GGUFFile
path, n = sys.argv[1], int(sys.argv[2])
GGUFFile(path).close()
ts = []
for _ in range(n):
    t0 = time.perf_counter()
    GGUFFile(path).close()
    ts.append(time.perf_counter() - t0)
print(json.dumps(sorted(ts)))
"""


def generate(out: Path) -> Path:
    cmd = [sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), "--out", str(out), "--preset", "tiny",
           "--no-sha256", "--quiet", *DEFAULT_DIMS]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    print(f"generated {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - t0:.0f} s "
          f"with {Path(cmd[1]).name}", file=sys.stderr)
    return out


def measure(model: Path) -> dict:
    env = dict(os.environ, PYTHONHASHSEED="0")
    r = subprocess.run([sys.executable, "-c", _CHILD, str(model)], check=True, capture_output=True, text=True,
                       env=env, cwd=REPO)
    result = json.loads(r.stdout.strip().splitlines()[-1])
    t = subprocess.run([sys.executable, "-c", _TIMING, str(model), "7"], check=True, capture_output=True,
                       text=True, cwd=REPO)
    result["open_seconds_sorted"] = json.loads(t.stdout.strip().splitlines()[-1])
    result["file_size"] = model.stat().st_size
    return result


def report(result: dict) -> str:
    size = result["file_size"]
    base = result["steps"][0]
    lines = [f"file {size:,} bytes ({size / 2**30:.2f} GiB), header {result['header_bytes']:,} bytes, "
             f"{result['n_tensors']} tensors",
             f"{'step':<10} {'time ms':>8} {'VmRSS MiB':>10} {'RssAnon':>9} {'RssFile':>9} "
             f"{'growth MiB':>11} {'% of file':>10} {'anon +MiB':>10} {'file +MiB':>10}"]
    for s in result["steps"]:
        growth = s["VmRSS"] - base["VmRSS"]
        lines.append(f"{s['step']:<10} {s['seconds'] * 1000:>8.1f} {s['VmRSS'] / 2**20:>10.1f} {s['RssAnon'] / 2**20:>9.1f} "
                     f"{s['RssFile'] / 2**20:>9.1f} {growth / 2**20:>11.1f} {100 * growth / size:>9.2f}% "
                     f"{(s['RssAnon'] - base['RssAnon']) / 2**20:>10.1f} {(s['RssFile'] - base['RssFile']) / 2**20:>10.1f}")
    by_step = {s["step"]: s for s in result["steps"]}
    for label, step in (("reader (open + config + layout + views)", "views"),
                        ("with the tokenizer", "tokenizer")):
        if step in by_step:
            frac = _growth(result, step)
            verdict = "OK" if frac < TARGET_FRACTION else "OVER TARGET"
            mib = (by_step[step]["VmRSS"] - base["VmRSS"]) / 2**20
            lines.append(f"growth {label}: {mib:.1f} MiB = {100 * frac:.2f} % of the file "
                         f"(target < {100 * TARGET_FRACTION:.0f} %): {verdict}")
    ts = result["open_seconds_sorted"]
    lines.append(f"GGUFFile open: best {ts[0] * 1000:.1f} ms, median {ts[len(ts) // 2] * 1000:.1f} ms "
                 f"({len(ts)} warm runs)")
    last = result["steps"][-1]
    frac = _growth(result, last["step"])
    lines.append(f"{'PASS' if frac < TARGET_FRACTION else 'FAIL'}: RSS growth through '{last['step']}' is "
                 f"{(last['VmRSS'] - base['VmRSS']) / 2**20:.1f} MiB = {100 * frac:.2f} % of the file "
                 f"(target < {100 * TARGET_FRACTION:.0f} %)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="GGUF to measure (default: generate a >= 1 GB one)")
    ap.add_argument("--keep", type=Path, help="generate into this folder and keep the file")
    ap.add_argument("--json", action="store_true", help="print the raw measurements as JSON")
    ap.add_argument("--strict", action="store_true", help="exit 1 when the total growth misses the target")
    args = ap.parse_args(argv)

    if args.model:
        result = measure(args.model)
    elif args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        model = args.keep / "bench-open.gguf"
        result = measure(model if model.is_file() else generate(model))
    else:
        with tempfile.TemporaryDirectory(prefix="ds4-bench-open-") as tmp:
            result = measure(generate(Path(tmp) / "bench-open.gguf"))
    passed = _growth(result, result["steps"][-1]["step"]) < TARGET_FRACTION
    print(json.dumps(dict(result, passed=passed), indent=1) if args.json else report(result))
    return 1 if args.strict and not passed else 0


def _growth(result: dict, step: str) -> float:
    """RSS growth from the baseline to ``step``, as a fraction of the file size."""
    base = result["steps"][0]["VmRSS"]
    at = next(s for s in result["steps"] if s["step"] == step)["VmRSS"]
    return (at - base) / result["file_size"]


if __name__ == "__main__":
    sys.exit(main())
