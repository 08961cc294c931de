#!/usr/bin/env python3
"""The memory plan against what a load really holds (issue #24).

    python benchmarks/bench_memory_plan.py --model PATH [--experts host,device] [--ctx 4096]
                                           [--prompt-tokens 256] [--json]

For each expert strategy, in a fresh Python process: ``ds4_mlx.load(model, experts=..., ctx=...)``,
then one session prefills ``--prompt-tokens`` tokens and decodes 4, so every dense weight has
built its resident form, the LRU has filled as far as those tokens fill it and the KV buffers
exist. Printed side by side, per strategy:

  planned    the plan's total without scratch (dense + routed experts + expert cache + KV at ctx)
  mlx peak   ``mx.get_peak_memory()``: every MLX buffer at its peak (weights, caches, activations)
  anon peak  the process's peak anonymous memory (RssAnon sampled every 20 ms by a thread): what
             the plan must cover (Python, numpy copies, MLX); the mapping's file pages are not in it
  total      the plan's total with scratch, which must stay above the anon peak

and the ratios mlx peak / planned and anon peak / total. The plan is right when mlx peak / planned
is close to 1 (the LRU may hold less than its budget: below 1) and anon peak / total is below 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, threading, time
import ds4_mlx
import mlx.core as mx
path, experts, ctx, n_prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

def status():
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                out[k] = int(v.split()[0]) * 1024
    return out

peak = [0]
def sample():
    while True:
        peak[0] = max(peak[0], status()["RssAnon"])
        time.sleep(0.02)
threading.Thread(target=sample, daemon=True).start()

model = ds4_mlx.load(path, experts=experts, ctx=ctx)
plan = model.memory_plan
s = model.new_session()
s.append([(17 * i + 3) % 1000 + 100 for i in range(n_prompt)])
for _ in range(4):
    s.append([int(s.logits().argmax())])
st = status()
print(json.dumps({"experts": plan.weights.strategy, "planned": plan.planned, "total": plan.total,
                  "dense": plan.weights.dense_bytes, "routed": plan.experts_bytes, "cache": plan.cache_bytes,
                  "kv": plan.kv_total, "session_kv": s.memory_bytes(), "mlx_peak": mx.get_peak_memory(),
                  "mlx_active": mx.get_active_memory(), "anon_peak": max(peak[0], st["RssAnon"]), **st}))
"""


def measure(model: str, experts: str, ctx: int, n_prompt: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD, model, experts, str(ctx), str(n_prompt)],
                         capture_output=True, text=True, cwd=REPO)
    if out.returncode != 0:
        raise SystemExit(f"bench_memory_plan: the {experts} run failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--experts", default="host,device")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = [measure(args.model, e, args.ctx, args.prompt_tokens) for e in args.experts.split(",")]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    gib = 1 << 30
    print(f"{'experts':<8} {'planned':>9} {'mlx peak':>9} {'ratio':>6} {'anon peak':>10} {'total':>9} {'ratio':>6}"
          f"   (GiB; dense / routed / cache / KV planned, session KV)")
    for r in rows:
        print(f"{r['experts']:<8} {r['planned'] / gib:>9.2f} {r['mlx_peak'] / gib:>9.2f} "
              f"{r['mlx_peak'] / r['planned']:>6.2f} {r['anon_peak'] / gib:>10.2f} {r['total'] / gib:>9.2f} "
              f"{r['anon_peak'] / r['total']:>6.2f}   {r['dense'] / gib:.2f} / {r['routed'] / gib:.2f} / "
              f"{r['cache'] / gib:.2f} / {r['kv'] / gib:.3f}, {r['session_kv'] / gib:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
