"""Decode speed of two source trees side by side: interleaved rounds in one run, median ratio.

    python benchmarks/bench_ab.py --base HEAD~1                      # this tree vs its parent commit
    python benchmarks/bench_ab.py --base main --tree /path/to/other  # any ref (or directory) vs any tree
    python benchmarks/bench_ab.py --base HEAD~1 --top-p 1.0 --min-p 0.05 --temperature 1

A CPU shared with other jobs is noisy by tens of percent from one minute to the next, so two runs
made at different times cannot show a 5 % lever. Here both trees load the same model in two worker
processes (``PYTHONPATH`` = each tree; ``--base`` is a git ref exported with ``git archive`` or a
directory), prefill the same random prompt, and then take turns (A B B A A B …): each turn restores
the prompt's snapshot and decodes ``--decode`` tokens through the engine's public surface
(``Session.logits`` → ``sampling.sample`` → ``Session.eval``, what ``stream_generate`` does per token),
with the same sampling seed. A worker idles while the other runs, so they never compete for the
cores. Reported: each tree's median ms/token over the rounds, and the median over rounds of the
per-round ratio base/tree (> 1: the tree is faster), which cancels slow drifts of the machine.

Also per tree, counted in one extra turn (not timed): MLX arrays created from host data
(``mx.array(...)`` calls) and explicit ``mx.eval`` calls per decoded token.

Model: ``--model PATH``, else ``$DS4_MLX_TINY_MODEL``. Both trees must offer ``ds4_mlx.load``,
``Session`` and ``engine.sampling``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent


# --- worker (runs inside one tree) ------------------------------------------------------------------


def worker(args) -> int:
    import ds4_mlx
    import numpy as np
    from ds4_mlx.engine import sampling
    from host_traffic import HostTraffic  # this script's folder, whichever tree is measured

    model = ds4_mlx.load(args.model, numerics="default")
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.n_vocab, size=args.prompt).astype(np.int64).tolist()
    session = ds4_mlx.Session(model, ctx=args.prompt + args.decode * 2 + 8)
    session.sync(prompt)
    snap = session.snapshot()
    params = sampling.SamplingParams(temperature=args.temperature, top_p=args.top_p, min_p=args.min_p,
                                     top_k=args.top_k)

    def turn() -> tuple[list[float], list[int]]:
        session.restore(snap)
        gen_rng = sampling.XorShiftRng(args.seed + 1)
        times, toks = [], []
        for _ in range(args.decode):
            t0 = time.perf_counter()
            logits = session.logits()
            tok = sampling.argmax(logits) if params.greedy else sampling.sample(logits, params, gen_rng)
            session.eval(tok)
            times.append(time.perf_counter() - t0)
            toks.append(tok)
        return times, toks

    turn()  # warm-up: traces the compiled decode functions, fills the expert cache
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "run":
            times, toks = turn()
            print(json.dumps({"times": times, "tokens": toks}), flush=True)
        elif cmd == "count":
            with HostTraffic() as traffic:
                turn()
            arrays = sum(n for (_, kind), n in traffic.by_site.items() if kind == "mx.array")
            print(json.dumps({"arrays": arrays / args.decode,
                              "evals": traffic.by_kind.get("mx.eval", 0) / args.decode}), flush=True)
        else:
            break
    return 0


# --- driver -------------------------------------------------------------------------------------------


def export_ref(ref: str, dest: Path) -> Path:
    """A directory holding ``ref``: itself if it is a directory, else ``git archive`` of the repo's ref."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    tar = dest / "base.tar"
    with open(tar, "wb") as fh:
        subprocess.run(["git", "-C", str(REPO), "archive", ref], stdout=fh, check=True)
    out = dest / "base"
    out.mkdir()
    with tarfile.open(tar) as tf:
        tf.extractall(out, filter="data")
    return out


class Worker:
    def __init__(self, tree: Path, argv: list[str]):
        env = dict(os.environ, PYTHONPATH=str(tree))
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--worker", *argv], cwd=str(tree), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, cmd: str | None) -> dict:
        if cmd is not None:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker for {self.tree} exited (rc {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=False, default="HEAD~1", help="git ref or directory (default HEAD~1)")
    ap.add_argument("--tree", default=str(REPO), help="the tree measured against the base (default: this one)")
    ap.add_argument("--model", default=os.environ.get("DS4_MLX_TINY_MODEL"))
    ap.add_argument("--prompt", type=int, default=993, help="prompt tokens before decoding (default 993)")
    ap.add_argument("--decode", type=int, default=24, help="decoded tokens per turn")
    ap.add_argument("--rounds", type=int, default=6, help="turns per tree")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--min-p", type=float, default=0.05)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("no model: pass --model or set DS4_MLX_TINY_MODEL")
    if args.worker:
        return worker(args)

    wargs = ["--model", str(Path(args.model).resolve()), "--prompt", str(args.prompt), "--decode",
             str(args.decode), "--temperature", str(args.temperature), "--top-p", str(args.top_p),
             "--min-p", str(args.min_p), "--top-k", str(args.top_k), "--seed", str(args.seed)]
    with tempfile.TemporaryDirectory(prefix="ds4-bench-ab-") as tmp:
        base = export_ref(args.base, Path(tmp))
        tree = Path(args.tree).resolve()
        workers = {"base": Worker(base, wargs), "tree": Worker(tree, wargs)}
        try:
            for w in workers.values():
                w.ask(None)  # ready
            per = {k: [] for k in workers}
            toks = {}
            order = ["base", "tree"]
            for r in range(args.rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    out = workers[name].ask("run")
                    per[name].append(statistics.median(out["times"]))
                    toks[name] = out["tokens"]
            counts = {k: w.ask("count") for k, w in workers.items()}
        finally:
            for w in workers.values():
                w.close()
    ratios = [b / t for b, t in zip(per["base"], per["tree"])]
    print(f"model {args.model}: prompt {args.prompt}, {args.decode} tokens x {args.rounds} rounds, "
          f"temperature {args.temperature} top_p {args.top_p} min_p {args.min_p} top_k {args.top_k}")
    for name, label in (("base", f"base ({args.base})"), ("tree", f"tree ({tree})")):
        print(f"  {label:<40} {statistics.median(per[name]) * 1e3:8.1f} ms/token   rounds: "
              f"{', '.join(f'{x * 1e3:.1f}' for x in per[name])}   per token: "
              f"{counts[name]['arrays']:.1f} mx.array, {counts[name]['evals']:.1f} mx.eval")
    print(f"  speed ratio base/tree (median of rounds): {statistics.median(ratios):.3f}   "
          f"(rounds: {', '.join(f'{x:.3f}' for x in ratios)})")
    print(f"  same sampled tokens: {toks['base'] == toks['tree']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
