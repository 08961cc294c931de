"""Whole-model benchmarks (DEFAULT numerics): prefill and decode throughput, compiled vs uncompiled
decode, weight bytes per decoded token, peak memory.

    python benchmarks/bench_model.py                                   # tiny model, < 1 min
    python scripts/make_tiny_model.py --preset medium --out /tmp/medium.gguf     # 9.5 GB, ~2 min
    python benchmarks/bench_model.py --model /tmp/medium.gguf --prefill 512 2048 --decode 8

    python benchmarks/bench_model.py --experts device --json          # one JSON object (below)

Model: ``--model PATH``, else ``$DS4_MLX_TINY_MODEL``, else a tiny model
is generated into a temp dir (deleted at exit). Tokens are random ids (seeded): the cost of a step
does not depend on which ids, only (through routing) on which experts they pick.

Reported:
* load time; a warm-up prefill (pays the lazy float32 dequantization of the dense weights);
* prefill tokens/s per length (a cold session, chunked at 2048 like ds4);
* decode tokens/s after the longest prefill, uncompiled (chunk path, one-token chunks) and compiled
  (``compiled_decode``), each run the same teacher-forced tokens (greedy tokens of the first
  uncompiled round) from the same snapshot, interleaved over ``--rounds`` rounds (median reported),
  with the logits evaluated at every step; the first compiled steps (the traces) are timed
  separately; the largest |Δlogit| between the two modes;
* weight bytes per decoded token next to the active-parameter bytes: GGUF bytes of the dense
  matmul weights (all of them run for every token) and of the routed experts actually selected
  (``ExpertWeights.bytes_selected``; ``bytes_read``: bytes copied out of the mmap, i.e. expert-cache
  misses), and the bytes the CPU streams (MLX's dense matmuls: float32, 4 bytes per parameter; the
  host-multiplied output head and the native expert products: the GGUF blocks);
* VmHWM (peak RSS) and VmRSS (anonymous / file-backed) and MLX's active and peak bytes after load,
  warm-up, prefill and decode.

``--experts device|host|auto`` picks the routed-expert strategy (``ds4_mlx.load(experts=...)``);
``--experts-cache N|SIZE`` (with ``--experts device``) bounds its resident experts (``model.expert_cache``).

``--json`` measures the decode step's structure instead and prints one JSON object (``measure``):
``strategy``, ``backend``, ``prefill_tps`` (one cold prefill of the first ``--prefill`` length),
``decode_tps``, ``host_syncs_per_token`` and ``host_bytes_per_token`` (counted by ``host_traffic``
around the timed decode loop: evaluations, reads and numpy conversions of MLX arrays; bytes copied
to the host and handed from the host to MLX, plus expert slabs copied out of the mmap),
``engine_host_syncs_per_token`` (the same count for the engine's ``Session`` loop, which copies
the logits to numpy to sample on the host; that one read also evaluates the step), ``weight_bytes_per_token``
(GGUF bytes a decoded token's matmuls read: the dense weights, its embedding row, k experts of each
routed tensor), ``expert_bytes_resident`` (the device strategy's
copy of the expert blocks, or its cache's slots), ``peak_rss_bytes`` (VmHWM); with ``--experts-cache``,
``expert_cache_{slots,policy,hits,misses,hit_rate,bytes_read_per_token}`` over the timed decode. Its decode loop is the compiled step with the
greedy choice on the device: ``step(evaluate=False)``, ``argmax`` of the logits made to depend on the
new cache arrays, and the token's ``.item()`` -- the one read the host cannot avoid. So the device
strategy measures 1 sync per token; the host strategy adds per layer its host work's reads (the
router's scores on routed layers, the two mixers' logits, the native experts' inputs, the queued
``async_eval``) and the head's input (``tests/test_expert_strategies.py`` states the count).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import mlx.core as mx
import numpy as np

from ds4_mlx.formats.ggml_types import GGMLType
from ds4_mlx.engine.session import Session, Snapshot
from ds4_mlx.model.cache import ModelCache
from ds4_mlx.model.experts import ExpertWeights
from ds4_mlx.synth import benchmark_model_path

from bench_util import proc_memory as memory
from host_traffic import HostTraffic

GIB = float(1 << 30)
MIB = float(1 << 20)


def mem_line(label: str) -> dict[str, int]:
    """Print the process memory and MLX's own counters (active: live arrays; peak since start)."""
    m = memory()
    if m:
        split = f" (anon {m['RssAnon'] / GIB:.2f}, file {m['RssFile'] / GIB:.2f})" if "RssFile" in m else ""
        print(f"  memory {label:<16} VmHWM {m['VmHWM'] / GIB:7.2f} GiB   VmRSS {m['VmRSS'] / GIB:7.2f} GiB{split}   "
              f"MLX active {mx.get_active_memory() / GIB:.2f} GiB, peak {mx.get_peak_memory() / GIB:.2f} GiB")
    return m


def experts_of(model) -> list[ExpertWeights]:
    return [e for b in model.blocks for e in (b.ffn.gate_exps, b.ffn.up_exps, b.ffn.down_exps)]


def dense_params(model) -> tuple[int, int]:
    """(GGUF bytes, parameters) of the dense matmul weights a decoded token runs through: every
    2-D Q8_0 / F16 / F32 tensor but the embedding (one row per token), the APE tables (one row)
    and the expert-id tables."""
    nbytes = params = 0
    for name, info in model.source.tensors.items():
        if len(info.shape) != 2 or name == "token_embd.weight" or "_ape." in name or "tid2eid" in name:
            continue
        if info.ggml_type not in (GGMLType.Q8_0, GGMLType.F16, GGMLType.F32):
            continue
        nbytes += info.nbytes
        params += info.n_elements
    return nbytes, params


def timed_prefill(model, tokens: np.ndarray, compile: bool) -> tuple[float, object]:
    s = Session(model, len(tokens) + 64, compile=compile)
    t0 = time.perf_counter()
    s.append(tokens)
    s.logits()
    return time.perf_counter() - t0, s


def decode_run(model, snap, feed: list[int] | None, n: int, compile: bool, ctx: int):
    """n decode steps from ``snap``: greedy when ``feed`` is None, else teacher-forced. Returns
    (seconds per step, the fed tokens, logits per step)."""
    s = Session(model, ctx, compile=compile)
    s.restore(snap)
    nxt = int(np.argmax(np.array(snap.logits)))
    fed, logits, times = [], [], []
    for i in range(n):
        tok = nxt if feed is None else feed[i]
        t0 = time.perf_counter()
        s.eval(tok)
        lg = s.logits()
        times.append(time.perf_counter() - t0)
        fed.append(tok)
        logits.append(lg)
        nxt = int(np.argmax(lg))
    return times, fed, logits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF to benchmark (default: a tiny model)")
    ap.add_argument("--prefill", type=int, nargs="+", default=None,
                    help="prefill lengths (default: 512 2048 on the tiny model, 512 on others)")
    ap.add_argument("--decode", type=int, default=None, help="timed decode steps per mode and round "
                                                            "(default 32 tiny, 6 otherwise)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of uncompiled / compiled decode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts", choices=("auto", "device", "host"), default="auto",
                    help="routed-expert strategy (device: blocks resident, routing on the device)")
    ap.add_argument("--experts-cache", default=None, metavar="N|SIZE",
                    help="--experts device: the bounded expert cache's budget (ds4_mlx.load(experts_cache=...))")
    ap.add_argument("--experts-cache-policy", choices=("lru", "lfu"), default=None)
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object: t/s, host syncs and bytes per decoded token, memory")
    args = ap.parse_args(argv)
    if args.json:
        with tempfile.TemporaryDirectory(prefix="ds4-bench-model-") as tmpdir:
            path = benchmark_model_path(args.model, Path(tmpdir))
            n_prefill = (args.prefill or [512])[0]
            print(json.dumps(measure(path, args.experts, n_prefill, args.decode or 16, args.seed,
                                     experts_cache=args.experts_cache, policy=args.experts_cache_policy)))
        return 0

    with tempfile.TemporaryDirectory(prefix="ds4-bench-model-") as tmpdir:
        path = benchmark_model_path(args.model, Path(tmpdir))
        return run(path, args)


def run(path: Path, args) -> int:
    mem0 = memory()
    t0 = time.perf_counter()
    kw = {} if args.experts_cache is None else {"experts_cache": args.experts_cache}
    if args.experts_cache_policy is not None:
        kw["experts_cache_policy"] = args.experts_cache_policy
    model = ds4_mlx.load(path, numerics="default", experts=args.experts, **kw).network
    cfg = model.config
    t_load = time.perf_counter() - t0
    tiny = cfg.n_embd < 1024
    lengths = args.prefill or ([512, 2048] if tiny else [512])
    n_dec = args.decode or (32 if tiny else 6)
    rng = np.random.default_rng(args.seed)
    tokens = rng.integers(0, cfg.n_vocab, size=max(lengths) + 1).astype(np.int64)
    tokens[0] = 0

    ratios = [cfg.compress_ratio(i) for i in range(cfg.n_layer)]
    print(f"model {path}  ({os.path.getsize(path) / GIB:.2f} GiB)  {cfg.n_layer} layers, n_embd {cfg.n_embd}, "
          f"ratios {ratios}, {cfg.n_expert} experts (k={cfg.n_expert_used})")
    print(f"load {t_load:.2f} s")
    mem = {"start": mem0, "load": mem_line("after load")}

    t_warm, _ = timed_prefill(model, tokens[:16], compile=False)
    print(f"warm-up prefill (16 tokens, first-use weight dequantization) {t_warm:.2f} s")
    mem["warm-up"] = mem_line("after warm-up")

    print("prefill (cold session, one chunk per 2048 tokens)")
    snap_session = None
    for n in lengths:
        dt, s = timed_prefill(model, tokens[:n], compile=False)
        print(f"  {n:6d} tokens  {dt:8.2f} s  {n / dt:9.1f} tokens/s")
        snap_session = s
    mem["prefill"] = mem_line("after prefill")

    snap = snap_session.snapshot()
    p0 = snap.pos
    ctx = p0 + n_dec + 8
    print(f"decode from position {p0}: {n_dec} timed steps per mode, {args.rounds} interleaved rounds")
    # warm-up: the first compiled steps trace every layer function (and the expert cache fills)
    warm_u, feed, _ = decode_run(model, snap, None, n_dec, False, ctx)
    dec = model.decoder()
    traces0 = dec.traces
    warm_c, _, _ = decode_run(model, snap, feed, 2, True, ctx)
    print(f"  first compiled steps (trace + run): {warm_c[0] * 1e3:.1f} ms, then {warm_c[1] * 1e3:.1f} ms "
          f"({dec.traces - traces0} traces)")
    per_u, per_c = [], []
    worst = 0.0
    experts = experts_of(model)
    for r in range(args.rounds):
        tu, _, lu = decode_run(model, snap, feed, n_dec, False, ctx)
        for e in experts:
            e.reset_counters()
        traces1 = dec.traces
        tc, _, lc = decode_run(model, snap, feed, n_dec, True, ctx)
        if dec.traces != traces1:
            print(f"  WARNING: {dec.traces - traces1} retraces during the timed compiled run")
        per_u.append(statistics.median(tu))
        per_c.append(statistics.median(tc))
        worst = max(worst, max(float(np.abs(a - b).max()) for a, b in zip(lu, lc)))
    mu, mc = statistics.median(per_u), statistics.median(per_c)
    print(f"  uncompiled  {mu * 1e3:9.1f} ms/token  {1 / mu:8.2f} tokens/s   (rounds: "
          f"{', '.join(f'{x * 1e3:.1f}' for x in per_u)} ms)")
    print(f"  compiled    {mc * 1e3:9.1f} ms/token  {1 / mc:8.2f} tokens/s   (rounds: "
          f"{', '.join(f'{x * 1e3:.1f}' for x in per_c)} ms)")
    print(f"  speed-up compiled / uncompiled: {mu / mc:.2f}x    max |dlogit| between the modes: {worst:.3g}")
    mem["decode"] = mem_line("after decode")

    # bytes per decoded token (counters of the last compiled run: n_dec tokens)
    d_bytes, d_params = dense_params(model)
    emb_row = cfg.n_embd * 2
    if model.expert_strategy == "device":
        # the device strategy's compiled step routes inside the trace, where the counters run only
        # while tracing: count what each token selects instead (k distinct experts per tensor)
        for e in experts:
            e.bytes_selected = n_dec * cfg.n_expert_used * e.expert_nbytes
    sel = sum(e.bytes_selected for e in experts) / n_dec
    read = sum(e.bytes_read for e in experts) / n_dec
    sel_f32 = sum(e.bytes_selected / e.expert_nbytes * e.shape[1] * e.shape[2] * 4 for e in experts) / n_dec
    active_exp = sum(cfg.n_expert_used * e.expert_nbytes for e in experts)
    active = d_bytes + emb_row + active_exp
    # what the CPU actually streams: MLX's dense matmuls read float32; the output head multiplied on
    # the host (``Model.host_head``) and the native expert products read the GGUF blocks in place
    head = model.output if model.host_head else None
    head_params = head.shape[0] * head.shape[1] if head is not None else 0
    dense_stream = 4 * (d_params - head_params) + (head.nbytes if head is not None else 0)
    native_experts = bool(experts) and model.expert_strategy == "host" and experts[0]._native_lib() is not None
    exp_stream = sel if native_experts else sel_f32
    print("weight bytes per decoded token")
    print(f"  dense matmul weights (GGUF)        {d_bytes / MIB:10.1f} MiB   ({d_params / 1e6:.1f} M params; "
          f"streamed: {dense_stream / MIB:.1f} MiB, float32 except "
          f"{'the output head, read as Q8_0 on the host' if head is not None else 'nothing'})")
    print(f"  routed experts selected (GGUF)     {sel / MIB:10.1f} MiB   (as float32: {sel_f32 / MIB:.1f} MiB; "
          + ("read in place by the native products)" if native_experts else
             f"copied out of the mmap: {read / MIB:.1f} MiB, the rest hit the expert cache)"))
    print(f"  touched (GGUF) / active parameters {(d_bytes + emb_row + sel) / MIB:10.1f} / {active / MIB:.1f} MiB "
          f"= {(d_bytes + emb_row + sel) / active:.3f}")
    print(f"  CPU bytes streamed                 {(dense_stream + emb_row + exp_stream) / MIB:10.1f} MiB "
          f"= {(dense_stream + emb_row + exp_stream) / active:.2f}x the active GGUF bytes")
    return 0


def weight_bytes_per_token(model) -> int:
    """GGUF bytes a decoded token's matmuls read: every dense matmul weight, its embedding row, and
    k experts of each routed-expert tensor."""
    cfg = model.config
    d_bytes, _ = dense_params(model)
    return d_bytes + cfg.n_embd * 2 + sum(cfg.n_expert_used * e.expert_nbytes for e in experts_of(model))


def greedy_decode(model, cache: ModelCache, token: int, n: int) -> tuple[list[int], list[float]]:
    """n compiled decode steps from ``cache`` with the greedy choice on the device; one host read per
    token (the chosen id), the cache arrays evaluated with it. Returns (tokens chosen, seconds/step)."""
    dec = model.decoder()
    out, times = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        logits = dec.step(token, cache, evaluate=False)
        nxt = mx.depends(mx.argmax(logits), cache.arrays())
        token = nxt.item()
        times.append(time.perf_counter() - t0)
        out.append(token)
    return out, times


def engine_loop_syncs(model, cache: ModelCache, token: int, n: int) -> float:
    """Host syncs per token of the engine's own loop (``Session.eval`` then ``logits()`` to numpy and
    a host argmax, as ``Session`` decodes) from the state in ``cache``, for comparison with the
    device-greedy loop: the logits' copy to numpy is its one sync (it evaluates the step with them)."""
    r = Session(model, cache.n_tokens + n + 8, compile=True)
    r.restore(Snapshot((0,) * cache.n_tokens, cache, None))  # restore copies the cache
    r.eval(token)  # the first step's traces
    token = int(np.argmax(r.logits()))
    with HostTraffic() as t:
        for _ in range(n):
            r.eval(token)
            token = int(np.argmax(r.logits()))
    return t.syncs / n


def measure(path, experts: str = "auto", n_prefill: int = 512, n_decode: int = 16, seed: int = 0,
            warmup: int = 2, experts_cache=None, policy: str | None = None) -> dict:
    """The ``--json`` measurement (module docstring): load with ``experts``, a 16-token warm-up
    prefill (first-use weight dequantization), one timed cold prefill of ``n_prefill`` random
    tokens, ``warmup`` untimed decode steps (the traces), then ``n_decode`` timed steps with host
    traffic counted. ``experts_cache`` / ``policy``: the bounded device expert cache; its decode
    hits, misses and bytes read from the file per token are reported (``expert_cache_*``)."""
    kw = {} if experts_cache is None else {"experts_cache": experts_cache}
    if policy is not None:
        kw["experts_cache_policy"] = policy
    engine = ds4_mlx.load(path, numerics="default", experts=experts, **kw)
    model = engine.network
    cfg = model.config
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.n_vocab, size=n_prefill).astype(np.int64)
    timed_prefill(model, tokens[:16], compile=False)  # first-use dequantization of the dense weights
    session = Session(model, n_prefill + warmup + n_decode + 8, compile=True)
    t0 = time.perf_counter()
    session.append(tokens)
    first = int(np.argmax(session.logits()))
    t_prefill = time.perf_counter() - t0
    cache = session.state  # the live cache: the session is dropped next
    del session
    chosen, _ = greedy_decode(model, cache, first, warmup)
    dec = model.decoder()
    traces0 = dec.traces
    experts_list = experts_of(model)
    read0 = sum(e.bytes_read for e in experts_list)
    ecache = model.expert_cache
    c0 = ecache.counters() if ecache is not None else None
    with HostTraffic() as traffic:
        _, times = greedy_decode(model, cache, chosen[-1], n_decode)
    slab_bytes = sum(e.bytes_read for e in experts_list) - read0
    cache_stats = {}
    if ecache is not None:
        d = ecache.counters() - c0
        cache_stats = {"expert_cache_slots": ecache.n_slots, "expert_cache_policy": ecache.policy,
                       "expert_cache_hits": d.hits, "expert_cache_misses": d.misses,
                       "expert_cache_hit_rate": d.hit_rate,
                       "expert_cache_bytes_read_per_token": d.bytes_read / n_decode}
    engine_syncs = engine_loop_syncs(model, cache, chosen[-1], n_decode)
    mem = memory()
    return {
        "model": str(path),
        "strategy": engine.experts,
        "backend": engine.load_plan.backend,  # "metal" / "cuda" when MLX runs on that GPU
        "numerics": engine.numerics,
        "prefill_tokens": int(n_prefill),
        "prefill_tps": n_prefill / t_prefill,
        "decode_tokens": int(n_decode),
        "decode_tps": n_decode / sum(times),
        "decode_ms_median": 1e3 * statistics.median(times),
        "host_syncs_per_token": traffic.syncs / n_decode,
        "host_syncs_by_kind": traffic.by_kind,
        "engine_host_syncs_per_token": engine_syncs,
        "host_bytes_per_token": (traffic.host_bytes + slab_bytes) / n_decode,
        "weight_bytes_per_token": weight_bytes_per_token(model),
        "expert_bytes_resident": sum(getattr(e, "resident_nbytes", 0) for e in experts_list),
        "traces_during_timed": dec.traces - traces0,
        "peak_rss_bytes": mem.get("VmHWM"),
        **cache_stats,
    }


if __name__ == "__main__":
    sys.exit(main())
