"""The bounded device expert cache (issue #24): unbounded vs a budget, side by side, and the policies.

    flock /work/heavy.lock timeout 3000 python benchmarks/bench_expert_cache.py \\
        --model /work/models/medium.gguf --budget 25% --prefill 256 --decode 16
    python benchmarks/bench_expert_cache.py --model /work/models/tiny.gguf --policies-only

Side by side (``--budget``, default 25 % of the routed experts, as an expert count): each
configuration runs in its own subprocess (so VmHWM is its own): load with ``experts="device"``
(unbounded, then bounded), prefill ``--prefill`` tokens of a real text (``--prompt-file``, default
``benchmarks/data/story_excerpt.txt``: the shared long-context story's opening), then ``--decode``
greedy compiled decode steps. Each child reports VmHWM, MLX peak, prefill/decode t/s, the greedy
tokens, and with a budget the cache's slots, hits, misses and bytes read from the file per decoded
token. The parent prints both, the t/s ratio, whether the tokens are equal, and the memory bound
``dense + budget + KV + slack`` (``dense``: the file's non-routed bytes, whose pages the process
touches, plus the float32 copies MLX holds of the dense matmul weights; ``slack``: the
interpreter's RSS before the load plus ds4's prefill reserve of two full routed layers).

Policies (``--policies``): the routing of the same run is recorded (per layer call: the distinct
experts and their pair counts; routing does not depend on the cache) and replayed through each
replacement policy (``model.expert_cache_policy``: LRU, LFU at several decays) at the same slot
count, offline: decode hit rate and bytes read per decoded token for each, the same trace.

One run each (not interleaved rounds): the unbounded device strategy copies every expert into MLX
memory (~6.8 GB on the medium model), which a shared 24 GB machine runs once, not in a loop.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PROMPT = HERE / "data" / "story_excerpt.txt"


def vm(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def child(args) -> dict:
    """One configuration in this process: the JSON the parent reads."""
    import ds4_mlx  # first: binds MLX to a fast BLAS

    import mlx.core as mx
    import numpy as np

    from ds4_mlx.model.expert_cache_policy import SlotPolicy

    import ds4_mlx.model.loader  # noqa: F401  (the libraries' own RSS, before any weight)
    from ds4_mlx.engine.session import Session

    mx.eval(mx.zeros((1,)) + 1)
    rss0 = vm("VmRSS")
    kw = {}
    if args.cache is not None:
        kw["experts_cache"] = args.cache
    if args.policy is not None:
        kw["experts_cache_policy"] = args.policy
    trace: list[tuple[int, str, list[int], list[int]]] = []
    phase = ["prefill"]
    if args.trace:
        real = SlotPolicy.access

        def access(self, experts, counts=None):
            trace.append((id(self), phase[0], np.asarray(experts).tolist(),
                          np.ones(len(experts), int).tolist() if counts is None else np.asarray(counts).astype(int).tolist()))
            return real(self, experts, counts)

        SlotPolicy.access = access
    t0 = time.perf_counter()
    eng = ds4_mlx.load(args.model, experts="device", numerics=args.numerics, **kw)
    load_s = time.perf_counter() - t0
    model = eng.network
    text = Path(args.prompt_file).read_text(encoding="utf-8")
    ids = eng.tokenizer.encode(text)[: args.prefill]
    if len(ids) < args.prefill:
        raise SystemExit(f"{args.prompt_file} has only {len(ids)} tokens, --prefill {args.prefill}")
    # ds4-cpu runs its reference arithmetic uncompiled
    session = Session(model, args.prefill + args.decode + 8, chunk=args.chunk,
                      compile=args.numerics == "default")
    t0 = time.perf_counter()
    session.append(ids)
    logits = session.logits()
    prefill_s = time.perf_counter() - t0
    # every logits row read, as the sha256 of its float32 bytes: equal bits or not, bounded vs unbounded
    digests = [hashlib.sha256(np.asarray(logits, dtype=np.float32).tobytes()).hexdigest()]
    cache = model.expert_cache
    c_pre = cache.counters() if cache is not None else None
    phase[0] = "decode"
    toks, times = [], []
    for _ in range(args.decode):
        toks.append(int(np.argmax(logits)))
        t0 = time.perf_counter()
        session.eval(toks[-1])
        logits = session.logits()
        times.append(time.perf_counter() - t0)
        digests.append(hashlib.sha256(np.asarray(logits, dtype=np.float32).tobytes()).hexdigest())
    mx.eval(*session.state.arrays())
    kv = sum(a.nbytes for a in session.state.arrays())
    experts = [e for b in model.blocks for e in (b.ffn.gate_exps, b.ffn.up_exps, b.ffn.down_exps)]
    routed_file = sum(int(e.raw.nbytes) for e in experts)
    dense_mlx = sum(w.resident_nbytes() for w in _dense_weights(model))
    out = {
        "cache": args.cache, "load_s": load_s, "prefill_tokens": len(ids), "prefill_tps": len(ids) / prefill_s,
        "decode_tokens": args.decode, "decode_tps": args.decode / sum(times), "tokens": toks,
        "numerics": args.numerics, "logits_sha256": digests,
        "rss_before_load": rss0, "vm_hwm": vm("VmHWM"), "vm_rss_end": vm("VmRSS"),
        "rss_file_end": vm("RssFile"), "rss_anon_end": vm("RssAnon"),
        "mlx_peak": int(mx.get_peak_memory()), "mlx_active_end": int(mx.get_active_memory()),
        "kv_bytes": int(kv), "file_bytes": int(model.source.file_size), "routed_file_bytes": routed_file,
        "dense_mlx_bytes": int(dense_mlx),
        "expert_resident_bytes": sum(int(e.resident_nbytes) for e in experts),
    }
    if cache is not None:
        d = cache.counters() - c_pre
        out.update(slots=cache.n_slots, policy=cache.policy, cache_bytes=cache.nbytes,
                   prefill_reserve_bytes=cache.plan.prefill_reserve_nbytes,
                   prefill_misses=c_pre.misses, prefill_bytes_read=c_pre.bytes_read,
                   decode_hits=d.hits, decode_misses=d.misses, decode_hit_rate=d.hit_rate,
                   decode_bytes_read_per_token=d.bytes_read / args.decode,
                   triplet_bytes=list(cache.plan.triplet_nbytes), n_expert=cache.plan.n_expert)
        if args.trace:
            layer_of = {id(c.policy): il for il, c in cache.layers.items()}
            out["trace"] = [(layer_of[k], ph, e, c) for k, ph, e, c in trace]
    return out


def _dense_weights(model):
    """The model's DenseWeight objects (what MLX holds as float32 on the CPU backend)."""
    from ds4_mlx.model.linear import DenseWeight

    seen, stack = [], [model]
    ids = set()
    while stack:
        o = stack.pop()
        if id(o) in ids:
            continue
        ids.add(id(o))
        if isinstance(o, DenseWeight):
            seen.append(o)
            continue
        d = getattr(o, "__dict__", None)
        if d is None or type(o).__module__.split(".")[0] != "ds4_mlx":
            continue
        for v in d.values():
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif type(v).__module__.split(".")[0] == "ds4_mlx":
                stack.append(v)
    return seen


def run_child(args, cache: str | None, trace: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", str(args.model), "--prefill", str(args.prefill),
           "--decode", str(args.decode), "--chunk", str(args.chunk), "--prompt-file", str(args.prompt_file),
           "--numerics", args.numerics]
    if cache is not None:
        cmd += ["--cache", cache]
    if args.policy is not None:
        cmd += ["--policy", args.policy]
    if trace:
        cmd += ["--trace"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"child {cache!r} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def replay(trace, slots: int, n_expert: int, policy: str, **kw) -> dict:
    """The recorded routing through ``policy`` at ``slots`` per layer: decode hit rate, misses."""
    from ds4_mlx.model.expert_cache_policy import make_policy

    pols: dict[int, object] = {}
    hits = misses = 0
    for layer, phase, experts, counts in trace:
        p = pols.get(layer)
        if p is None:
            p = pols[layer] = make_policy(policy, slots, n_expert, **kw)
        a = p.access(experts, counts)
        if phase == "decode":
            hits += a.hits
            misses += a.misses
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="25%", help="expert count, size (8GB) or percent of the routed experts")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--policy", choices=("lru", "lfu"), default=None)
    ap.add_argument("--numerics", choices=("default", "ds4-cpu"), default="default",
                    help="ds4-cpu: the parent also says whether every logits row is bit-identical")
    ap.add_argument("--prompt-file", default=str(DEFAULT_PROMPT))
    ap.add_argument("--policies-only", action="store_true", help="only the bounded run and the policy replay")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    budget = args.budget
    if budget.endswith("%"):
        sys.path.insert(0, str(HERE.parent))
        from ds4_mlx.formats.gguf import GGUFFile

        with GGUFFile(args.model) as f:
            n_layer = sum(1 for n in f.tensors if n.endswith("ffn_gate_exps.weight"))
            n_expert = f.tensor(next(n for n in f.tensors if n.endswith("ffn_gate_exps.weight"))).shape[0]
        budget = str(int(round(float(budget[:-1]) / 100 * n_layer * n_expert)))
    M = 2 ** 20
    bounded = run_child(args, budget, trace=True)
    trace = bounded.pop("trace")
    print(f"bounded ({budget} experts, {bounded['slots']} of {bounded['n_expert']} per layer, "
          f"{bounded['cache_bytes'] / M:.0f} MiB, {bounded['policy']}): prefill {bounded['prefill_tps']:.2f} t/s, "
          f"decode {bounded['decode_tps']:.3f} t/s, VmHWM {bounded['vm_hwm'] / M:.0f} MiB, "
          f"MLX peak {bounded['mlx_peak'] / M:.0f} MiB, decode hit rate {bounded['decode_hit_rate']:.3f}, "
          f"{bounded['decode_bytes_read_per_token'] / M:.1f} MiB read/token, "
          f"prefill read {bounded['prefill_bytes_read'] / M:.0f} MiB")
    print("policies (the same routing replayed, decode hit rate):")
    trip = bounded["triplet_bytes"]
    per_miss = sum(trip) / len(trip)
    rows = []
    for name, kw in (("lru", {}), ("lfu", {"decay": 0.9}), ("lfu", {"decay": 0.99}), ("lfu", {"decay": 1.0})):
        r = replay(trace, bounded["slots"], bounded["n_expert"], name, **kw)
        label = name + (f" decay {kw['decay']}" if kw else "")
        rows.append((label, r))
        print(f"  {label:16s} hit rate {r['hit_rate']:.3f}  misses {r['misses']}  "
              f"~{r['misses'] * per_miss / args.decode / M:.1f} MiB read/token")
    result = {"bounded": bounded, "policies": {k: v for k, v in rows}}
    if not args.policies_only:
        full = run_child(args, None, trace=False)
        print(f"unbounded: prefill {full['prefill_tps']:.2f} t/s, decode {full['decode_tps']:.3f} t/s, "
              f"VmHWM {full['vm_hwm'] / M:.0f} MiB, MLX peak {full['mlx_peak'] / M:.0f} MiB, "
              f"experts resident {full['expert_resident_bytes'] / M:.0f} MiB")
        dense = (bounded["file_bytes"] - bounded["routed_file_bytes"]) + bounded["dense_mlx_bytes"]
        slack = bounded["rss_before_load"] + bounded["prefill_reserve_bytes"]
        bound = dense + bounded["cache_bytes"] + bounded["kv_bytes"] + slack
        same_bits = bounded["logits_sha256"] == full["logits_sha256"]
        print(f"{args.numerics} numerics: logits rows bit-identical: {same_bits} "
              f"({len(full['logits_sha256'])} rows: the prefill's last and every decoded step's)")
        print(f"tokens equal: {bounded['tokens'] == full['tokens']}; decode t/s bounded/unbounded "
              f"{bounded['decode_tps'] / full['decode_tps']:.2f}, prefill {bounded['prefill_tps'] / full['prefill_tps']:.2f}")
        print(f"bound = dense {dense / M:.0f} (file non-routed {(bounded['file_bytes'] - bounded['routed_file_bytes']) / M:.0f}"
              f" + float32 {bounded['dense_mlx_bytes'] / M:.0f}) + budget {bounded['cache_bytes'] / M:.0f} + KV "
              f"{bounded['kv_bytes'] / M:.0f} + slack {slack / M:.0f} (interpreter {bounded['rss_before_load'] / M:.0f}"
              f" + prefill reserve {bounded['prefill_reserve_bytes'] / M:.0f}) = {bound / M:.0f} MiB; "
              f"VmHWM bounded {bounded['vm_hwm'] / M:.0f} ({'within' if bounded['vm_hwm'] <= bound else 'OVER'}), "
              f"unbounded {full['vm_hwm'] / M:.0f} ({'within' if full['vm_hwm'] <= bound else 'over'})")
        result.update(unbounded=full, bound=bound, tokens_equal=bounded["tokens"] == full["tokens"],
                      logits_bit_identical=same_bits)
    out = os.environ.get("BENCH_EXPERT_CACHE_JSON")
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
