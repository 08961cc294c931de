"""Distributed runs (``--distributed MODE``) next to one process, on loopback; and the paper model.

    python benchmarks/bench_distributed.py                          # tiny model, pipeline, ~1 min
    python benchmarks/bench_distributed.py --mode experts --json    # one JSON object (below)
    python benchmarks/bench_distributed.py --paper                  # the README's table (no model run)

Model: ``--model PATH``, else ``$DS4_MLX_TINY_MODEL``, else a tiny model generated into a temp dir.
One invocation measures, one after the other on the same prompt (``--prompt-tokens`` random ids,
seeded like bench_model.py: the cost of a step does not depend on which ids), a one-process run and
a ``--ranks``-rank run started the way users start one (``mlx.launch -n R --backend ring``, every
rank on this machine, over loopback). Each run is a worker process (this script, ``--worker``): load
(``model.loader.load``), one cold prefill of the prompt, ``--decode`` greedy steps (the engine's
loop: evaluate, logits to the host, argmax), then it writes its own figures: VmHWM (peak RSS) and
the traffic the transport counted (``PipelineModel.sent``: bytes and messages sent by this rank, by
prefill / decode / stop). Ranks > 0 serve their share (``follow()``) until rank 0 stops them.

Reported (``--json``): per-rank peak RSS and its ratio to the one-process figure (the issue's target:
<= 0.6 on two ranks for pipeline), prefill and decode tokens/s of both runs and their ratio, bytes
sent between ranks per prefilled and per decoded token (every rank's sends summed), and whether the
greedy tokens agree. A mode this ds4-mlx does not know is skipped with a one-line message (exit 0).

Loopback numbers are not a network's: the ranks share this machine's cores and memory bandwidth, and
a message costs a memory copy. ``--paper`` is the model of real links (``paper_decode``), from
measured single-Mac decode speeds and stated link figures: see the README, "Across two machines".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAUNCH = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
MIB = float(1 << 20)


# -- the paper model (pure arithmetic: README table, tests) ------------------------------------------

# DeepSeek V4 Flash (spec: ARCHITECTURE.md): 43 layers, n_embd 4096, 4 hyper-connection streams,
# 256 routed experts of width 2048 (k = 6 per token), vocabulary 129280; every layer has a routed MoE.
FLASH = {"n_layer": 43, "n_embd": 4096, "n_hc": 4, "n_vocab": 129280, "n_expert": 256, "k": 6, "d_ff": 2048}

# Links: (one-way latency per message in seconds, bandwidth in bytes/s). Thunderbolt 5 is 80 Gb/s
# (Apple/Intel spec; 10 GB/s, taken as the usable rate for RDMA); ~10 us per message over JACCL's RDMA
# is an assumption in line with MLX's docs calling JACCL "low latency" (an order of magnitude below
# TCP); 10 GbE is 1.25 GB/s with ~50 us per message through the kernel's TCP stack (the ring backend).
LINKS = {
    "TB5 JACCL": (10e-6, 10e9),
    "10 GbE ring": (50e-6, 1.25e9),
}

# Measured single-Mac decode (ds4's README, short prompt, Metal): M3 Max 128 GB q2 26.68 t/s;
# M3 Ultra q2 36.86, q4 35.50 t/s. The paper Mac is an M3 Max-class machine (~400 GB/s); q4 does not
# fit one, so its M3 Ultra figure is scaled by the measured q2 Ultra/Max ratio (36.86 / 26.68).
SINGLE_MAC_TPS = {"q2": 26.68, "q4": 35.50 * 26.68 / 36.86}

# Bytes per routed expert (gate + up + down, 3 x 2048 x 4096 weights): q2 = IQ2_XXS gate/up (2.0625
# bits) + Q2_K down (2.625 bits); q4 from the file size: (153 GB - the non-expert bytes) / experts.
_EXPERT_PARAMS = 3 * 2048 * 4096
_NON_EXPERT_BYTES = 81e9 - 43 * 256 * (2 * _EXPERT_PARAMS / 3 * 2.0625 / 8 + _EXPERT_PARAMS / 3 * 2.625 / 8)
EXPERT_BYTES = {
    "q2": 2 * _EXPERT_PARAMS / 3 * 2.0625 / 8 + _EXPERT_PARAMS / 3 * 2.625 / 8,
    "q4": (153e9 - _NON_EXPERT_BYTES) / (43 * 256),
}
MODEL_BYTES = {"q2": 81e9, "q4": 153e9}


def expert_share(quant: str) -> float:
    """The routed experts' share of the bytes one decoded token reads (k experts per layer against
    the dense per-layer weights, embedding row and head): the part of a layer's time that expert
    parallel divides among ranks, assuming decode time proportional to bytes read."""
    dense_per_layer = (_NON_EXPERT_BYTES - FLASH["n_vocab"] * FLASH["n_embd"] * (2 + 34 / 32)) / FLASH["n_layer"]
    routed = FLASH["k"] * EXPERT_BYTES[quant]
    return routed / (routed + dense_per_layer)


def paper_decode(t_layer: float, n_layer: int, n_ranks: int, mode: str, latency: float, bandwidth: float,
                 n_embd: int, n_hc: int, n_vocab: int, expert_share: float = 0.0) -> dict:
    """Seconds per decoded token of one sequence on ``n_ranks`` machines (one machine: ``n_ranks`` = 1)
    with per-layer compute ``t_layer`` s on one machine; a message costs ``latency + bytes / bandwidth``.

    pipeline: the layers run one rank after the other (no overlap for one sequence): all layers'
    compute, plus per rank boundary one H message (n_hc * n_embd float32 + the 40-byte header and the
    token id), plus the logits back to rank 0 (n_vocab float32): model/pipeline.py's protocol with the
    whole head on the last rank. The loader shares the head's rows with rank 0 by a cut that depends
    on the file and the memory it weighs (not modelled here): the last rank then sends n_embd floats
    of hidden state first and only its rows' logits, one message more and up to n_vocab - n_embd
    floats fewer, so these link figures are an upper bound on bytes and one latency low.
    experts: every rank runs the dense part of each layer and 1/n_ranks of its routed experts
    (``expert_share`` of the layer's time), then one all_sum of n_embd float32 per layer, modelled
    as a ring all-reduce: 2 (n - 1) messages of n_embd * 4 / n bytes each.
    Returns {"s_per_token", "tps", "comm_s", "bytes_per_token"}."""
    if n_ranks < 1 or n_layer < 1:
        raise ValueError("n_ranks and n_layer must be >= 1")
    compute = n_layer * t_layer
    if n_ranks == 1:
        comm, nbytes = 0.0, 0
    elif mode == "pipeline":
        h = n_hc * n_embd * 4 + 5 * 8 + 8
        logits = n_vocab * 4 + 8
        comm = (n_ranks - 1) * (latency + h / bandwidth) + latency + logits / bandwidth
        nbytes = (n_ranks - 1) * h + logits
    elif mode == "experts":
        compute = n_layer * t_layer * ((1 - expert_share) + expert_share / n_ranks)
        piece = n_embd * 4 / n_ranks
        steps = 2 * (n_ranks - 1)
        comm = n_layer * steps * (latency + piece / bandwidth)
        nbytes = int(n_layer * steps * piece * n_ranks)  # summed over every rank's sends
    else:
        raise ValueError(f"unknown mode {mode!r}")
    s = compute + comm
    return {"s_per_token": s, "tps": 1.0 / s, "comm_s": comm, "bytes_per_token": nbytes}


def paper_table(t_layer_ms: float | None = None) -> list[dict]:
    """The README's rows: q2 / q4, 1, 2 and 4 Macs, pipeline and expert parallel, both links.
    ``t_layer_ms``: your own per-layer decode time (e.g. bench_model.py's ms per token on your Mac
    divided by the layers) instead of ds4's measured figures, for both quants."""
    rows = []
    for quant in ("q2", "q4"):
        t_layer = 1.0 / SINGLE_MAC_TPS[quant] / FLASH["n_layer"] if t_layer_ms is None else t_layer_ms / 1e3
        share = expert_share(quant)
        for link, (lat, bw) in LINKS.items():
            for n in (1, 2, 4):
                for mode in (("pipeline", "experts") if n > 1 else ("one",)):
                    r = paper_decode(t_layer, FLASH["n_layer"], n, mode if n > 1 else "pipeline", lat, bw,
                                     FLASH["n_embd"], FLASH["n_hc"], FLASH["n_vocab"], share)
                    experts_total = FLASH["n_layer"] * FLASH["n_expert"] * EXPERT_BYTES[quant]
                    if mode == "experts":  # every rank: all non-expert weights, 1/n of the experts
                        per_rank = (MODEL_BYTES[quant] - experts_total + experts_total / n) / 1e9
                    else:  # the layers split by bytes: about 1/n each
                        per_rank = MODEL_BYTES[quant] / n / 1e9
                    rows.append({"quant": quant, "link": link, "macs": n, "mode": mode,
                                 "t_layer_ms": 1e3 * t_layer, "expert_share": share,
                                 "tps": r["tps"], "comm_ms": 1e3 * r["comm_s"],
                                 "bytes_per_token": r["bytes_per_token"], "gb_per_mac": per_rank})
    return rows


def paper_lines(rows: list[dict]) -> list[str]:
    """The table as Markdown lines (the README holds them verbatim)."""
    out = ["| quant | link | Macs | mode | GB per Mac | comm ms/token | decode t/s |",
           "|---|---|---:|---|---:|---:|---:|"]
    seen_one = set()
    for r in rows:
        if r["mode"] == "one":
            if r["quant"] in seen_one:
                continue
            seen_one.add(r["quant"])
            link = "-"
        else:
            link = r["link"]
        out.append(f"| {r['quant']} | {link} | {r['macs']} | {r['mode']} | {r['gb_per_mac']:.0f} | "
                   f"{r['comm_ms']:.2f} | {r['tps']:.1f} |")
    return out


# -- one worker: a one-process run or one rank ---------------------------------------------------------


def _memory() -> tuple[int, dict[str, int]]:
    """(peak RSS in bytes, this process's /proc memory fields); imported here so ``--paper`` stays
    free of MLX."""
    from bench_util import proc_memory
    from ds4_mlx.engine.generate import peak_rss_bytes

    mem = proc_memory()
    return mem.get("VmHWM") or peak_rss_bytes(), mem


def worker(args) -> int:
    import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS)
    import numpy as np

    from ds4_mlx.engine.session import Session
    from ds4_mlx.model.loader import load

    mode = None if args.mode == "none" else args.mode
    t0 = time.perf_counter()
    model = load(args.model, numerics=args.numerics, distributed=mode)
    t_load = time.perf_counter() - t0
    rank = getattr(model, "rank", 0)
    rows = getattr(model, "head_rows", None)  # a pipeline rank's rows of the output matrix
    out = {"rank": rank, "load_s": t_load, "layers": [int(b.il) for b in model.blocks],
           "head": getattr(model, "output", None) is not None,
           "head_rows": None if rows is None else [rows.start, rows.stop]}
    if rank:
        model.follow()
    else:
        cfg = model.config
        rng = np.random.default_rng(args.seed)
        tokens = rng.integers(0, cfg.n_vocab, size=args.prompt_tokens).astype(np.int64)
        tokens[0] = 0
        run = Session(model, args.prompt_tokens + args.decode + 8)
        t0 = time.perf_counter()
        run.append(tokens)
        nxt = int(np.argmax(run.logits()))
        t_prefill = time.perf_counter() - t0
        chosen = [nxt]
        t0 = time.perf_counter()
        for _ in range(args.decode):
            run.eval(nxt)
            nxt = int(np.argmax(run.logits()))
            chosen.append(nxt)
        t_decode = time.perf_counter() - t0
        out.update(prefill_s=t_prefill, decode_s=t_decode, tokens=chosen,
                   cache_layers=[il for il, lc in enumerate(run.state.layers) if lc is not None])
        close = getattr(model, "close", None)
        if close is not None:
            close()  # stop the other ranks now, so their figures are final
    sent = getattr(model, "sent", None)
    if sent is not None:
        out["sent"] = sent
    from ds4_mlx.model.experts import EXPERT_CACHE

    out["expert_cache"] = {"limit_bytes": EXPERT_CACHE.limit_bytes, "bytes": EXPERT_CACHE.nbytes}
    out["peak_rss_bytes"], out["memory_at_end"] = _memory()
    name = "one.json" if mode is None else f"rank{rank}.json"
    (Path(args.worker) / name).write_text(json.dumps(out))
    return 0


# -- the side-by-side run -----------------------------------------------------------------------------


def known_modes() -> tuple[str, ...]:
    """The distributed modes this ds4-mlx's loader accepts (``model.distributed`` once expert
    parallel lands, else ``model.pipeline``)."""
    for mod in ("ds4_mlx.model.distributed", "ds4_mlx.model.pipeline"):
        try:
            return tuple(__import__(mod, fromlist=["MODES"]).MODES)
        except (ImportError, AttributeError):
            continue
    return ()


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _worker_cmd(args, out_dir: Path, mode: str) -> list[str]:
    return [sys.executable, str(HERE), "--worker", str(out_dir), "--model", str(args.model), "--mode", mode,
            "--numerics", args.numerics, "--prompt-tokens", str(args.prompt_tokens), "--decode", str(args.decode),
            "--seed", str(args.seed)]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive loopback ports free right now (mlx.launch gives rank i the
    port start + i: one free port is not enough, the next may be some other process's)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n > 65535:
            continue
        socks = []
        try:
            for p in range(first, first + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()


def _run_all(cmd: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` (with ``env``, else this script's) in a session of its own; past ``timeout`` every
    process of that session is killed (``subprocess.run(timeout=)`` kills only ``cmd``: under
    ``mlx.launch`` that is the launcher, and the ranks it started kept spinning on their sockets) and
    ``TimeoutExpired`` raised. tests/test_distributed.py launches its runs with it too."""
    proc = subprocess.Popen(cmd, env=_env() if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:  # an exception of ours while waiting: leave nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _run(cmd: list[str], what: str, timeout: float) -> None:
    r = _run_all(cmd, timeout)
    if r.returncode != 0:
        tail = (r.stdout + r.stderr).strip().splitlines()[-1:]
        raise RuntimeError(f"{what} failed (exit {r.returncode}): " + " | ".join(tail))


def _read(path: Path, what: str, log: str = "") -> dict:
    if not path.is_file():
        raise RuntimeError(f"{what} wrote no figures ({path.name}); {log}".strip())
    return json.loads(path.read_text())


def measure(model: Path, mode: str = "pipeline", ranks: int = 2, prompt_tokens: int = 64, decode: int = 16,
            numerics: str = "default", seed: int = 0, timeout: float = 600) -> dict:
    """One process, then ``ranks`` ranks under ``mlx.launch`` (ring backend, loopback), same
    prompt; the comparison (module docstring)."""
    args = argparse.Namespace(model=model, numerics=numerics, prompt_tokens=prompt_tokens, decode=decode, seed=seed)
    with tempfile.TemporaryDirectory(prefix="ds4-bench-dist-") as tmp:
        out = Path(tmp)
        _run(_worker_cmd(args, out, "none"), "the one-process run", timeout)
        one = _read(out / "one.json", "the one-process run")
        # mlx.launch picks the ports (from --starting-port): a free one, so that two runs at once
        # on one machine do not collide
        cmd = LAUNCH + ["-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks)), "--"] \
            + _worker_cmd(args, out, mode)
        r = _run_all(cmd, timeout)
        log = " | ".join((r.stdout + r.stderr).strip().splitlines()[-5:])
        per_rank = [_read(out / f"rank{i}.json", f"rank {i}", log) for i in range(ranks)]
    lead = per_rank[0]
    sent = {phase: sum(p.get("sent", {}).get(phase, {}).get("bytes", 0) for p in per_rank)
            for phase in ("prefill", "decode", "stop")}
    n_dec = max(decode, 1)
    counted = any("sent" in p for p in per_rank)
    return {
        "model": str(model),
        "mode": mode,
        "ranks": ranks,
        "backend": "ring (loopback)",
        "numerics": numerics,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode,
        "one": {"peak_rss_bytes": one["peak_rss_bytes"], "expert_cache": one["expert_cache"],
                "memory_at_end": one.get("memory_at_end"),
                "prefill_tps": prompt_tokens / one["prefill_s"],
                "decode_tps": decode / one["decode_s"] if decode else None},
        "per_rank": [{"rank": p["rank"], "layers": p["layers"], "peak_rss_bytes": p["peak_rss_bytes"],
                      "rss_ratio": p["peak_rss_bytes"] / one["peak_rss_bytes"], "sent": p.get("sent"),
                      "head": p["head"], "head_rows": p.get("head_rows"), "expert_cache": p["expert_cache"],
                      "memory_at_end": p.get("memory_at_end")} for p in per_rank],
        "rss_ratio_max": max(p["peak_rss_bytes"] for p in per_rank) / one["peak_rss_bytes"],
        "prefill_tps": prompt_tokens / lead["prefill_s"],
        "decode_tps": decode / lead["decode_s"] if decode else None,
        "prefill_speedup": one["prefill_s"] / lead["prefill_s"],
        "decode_speedup": one["decode_s"] / lead["decode_s"] if decode else None,
        # None: this mode's transport does not count its traffic (no ``sent`` on the model)
        "bytes_per_prefill_token": sent["prefill"] / prompt_tokens if counted else None,
        "bytes_per_decode_token": sent["decode"] / n_dec if counted else None,
        "same_tokens": one["tokens"] == lead["tokens"],
        "rank0_cache_layers": lead["cache_layers"],  # the layers rank 0's live cache holds
    }


def print_report(res: dict) -> None:
    one = res["one"]
    print(f"model {res['model']}  mode {res['mode']} on {res['ranks']} ranks ({res['backend']}), "
          f"numerics {res['numerics']}, {res['prompt_tokens']} prompt + {res['decode_tokens']} decoded tokens")
    print(f"  one process   peak RSS {one['peak_rss_bytes'] / MIB:8.0f} MiB   prefill {one['prefill_tps']:8.1f} t/s"
          f"   decode {one['decode_tps'] or 0:7.2f} t/s")
    for p in res["per_rank"]:
        rows = p.get("head_rows")
        head = f", head rows {rows[0]}..{rows[1] - 1}" if rows and rows[1] > rows[0] else ""
        print(f"  rank {p['rank']} (layers {p['layers'][0]}..{p['layers'][-1]}{head})  peak RSS "
              f"{p['peak_rss_bytes'] / MIB:8.0f} MiB = {p['rss_ratio']:.2f}x one process")
    print(f"  distributed   prefill {res['prefill_tps']:8.1f} t/s ({res['prefill_speedup']:.2f}x)   decode "
          f"{res['decode_tps'] or 0:7.2f} t/s ({res['decode_speedup'] or 0:.2f}x)   same greedy tokens: "
          f"{res['same_tokens']}")
    if res["bytes_per_decode_token"] is None:
        print("  sent between ranks: not counted by this mode's transport")
    else:
        print(f"  sent between ranks: {res['bytes_per_prefill_token']:.0f} B per prefilled token, "
              f"{res['bytes_per_decode_token']:.0f} B per decoded token")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF to run (default: $DS4_MLX_TINY_MODEL or a tiny model)")
    ap.add_argument("--mode", default="pipeline", help="distributed mode (pipeline; experts once available)")
    ap.add_argument("--ranks", type=int, default=2, help="ranks of the distributed run (default 2)")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16, help="greedy decode steps after the prompt")
    ap.add_argument("--numerics", default="default", choices=("default", "ds4-cpu"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600,
                    help="seconds each run (one process, the ranks) may take (default 600; the 4-layer "
                         "real-dims model on a loaded 2-core box needs more)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--paper", action="store_true", help="print the paper model of real links (README table)")
    ap.add_argument("--t-layer-ms", type=float, default=None,
                    help="--paper with this per-layer decode time (ms) instead of ds4's measured Mac figures")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one run, figures to this dir
    args = ap.parse_args(argv)
    if args.worker:
        from ds4_mlx.errors import Ds4Error

        try:
            return worker(args)
        except Ds4Error as exc:  # one line, which the parent reports
            print(exc, file=sys.stderr)
            return 2
    if args.t_layer_ms is not None and not (args.t_layer_ms > 0 and args.t_layer_ms < float("inf")):
        ap.error(f"--t-layer-ms must be a positive number of milliseconds, got {args.t_layer_ms}")
    if args.paper:
        rows = paper_table(args.t_layer_ms)
        print(json.dumps(rows) if args.json else "", end="\n" if args.json else "")
        if not args.json:
            print("\n".join(paper_lines(rows)))
        return 0
    if args.prompt_tokens < 2 or args.decode < 0 or args.ranks < 2:
        ap.error("--prompt-tokens must be >= 2, --decode >= 0 and --ranks >= 2")
    if not args.timeout > 0:
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    known = known_modes()
    if args.mode not in known:
        print(f"bench_distributed: mode {args.mode!r} is not available in this ds4-mlx "
              f"(known: {', '.join(known) or 'none'}); skipped")
        return 0
    from ds4_mlx.synth import benchmark_model_path

    with tempfile.TemporaryDirectory(prefix="ds4-bench-dist-model-") as tmpdir:
        args.model = benchmark_model_path(args.model, Path(tmpdir))
        try:
            res = measure(args.model, args.mode, args.ranks, args.prompt_tokens, args.decode, args.numerics,
                          args.seed, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"bench_distributed: error: {exc}", file=sys.stderr)
            return 1
    print(json.dumps(res) if args.json else "", end="\n" if args.json else "")
    if not args.json:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
