"""Speculative decoding (issue #25): what a verify step costs, and decode speed at scripted acceptance.

    python benchmarks/bench_spec.py                                   # tiny model
    flock /work/heavy.lock timeout 1800 python benchmarks/bench_spec.py --model /work/models/medium.gguf \
        --tokens 24 --rounds 2

1. Verify cost. From a prompt of ``--prompt`` random tokens: one decode step (``Session.eval``: the
   compiled step in default numerics) against one verify step of k = 1..4 drafts (``Session.verify``
   of k + 1 tokens + ``commit``), in interleaved rounds (every variant once per round, the session
   restored from a snapshot between them); the fastest round of each (on a shared machine the
   fastest is the one least disturbed), its median beside it, and each verify relative to the decode step.
2. Decode speed. ``--tokens`` tokens greedy from the same prompt, plain, then with a
   ``ScriptedDrafter`` proposing the plain continuation with a per-token error rate of 100 / 50 / 20 /
   0 % (scripted acceptance 0 / 50 / 80 / 100 %), interleaved rounds; decode t/s (the fastest round)
   relative to plain's fastest, the median over rounds of each round's ratio to that round's plain run, the measured acceptance (accepted / drafted) and whether the tokens equal plain decoding's.
3. Bytes per token: the model file's weights read by one decode step (dense + 6 routed experts per
   layer) and by a verify of L tokens (dense once + the distinct experts of L tokens, random routing:
   n_exp (1 - (1 - 6/n_exp)^L) per layer), scaled to the 43-layer model; the bandwidth-bound (GPU)
   expectation of the verify cost and of the decode speed-up at acceptance a with the best k.

The machine's load average is printed with the figures (a shared box).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ds4_mlx  # noqa: F401  (first: binds MLX to a fast BLAS before mlx.core loads)
import numpy as np

from ds4_mlx.engine.drafter import ScriptedDrafter
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.synth import benchmark_model_path

REAL_LAYERS = 43
ACCEPTANCE = (0.0, 0.5, 0.8, 1.0)


def load_text() -> str:
    la = os.getloadavg()
    return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}"


def verify_cost(eng, prompt: list[int], rounds: int, ks=(1, 2, 3, 4)) -> dict[str, float]:
    s = eng.new_session(len(prompt) + 64)
    s.sync(prompt)
    snap = s.snapshot()
    nxt = int(np.argmax(s.logits()))
    drafts = np.random.default_rng(1).integers(0, 1000, max(ks)).tolist()
    times: dict[str, list[float]] = {"decode": []} | {f"k={k}": [] for k in ks}

    def decode():
        s.eval(nxt)
        s.logits()

    def verify(k):
        rows, _ = s.verify([nxt] + drafts[:k])
        s.commit(1)
        s.logits()

    for r in range(rounds + 1):  # round 0 warms up (traces, lazy dequantisation)
        for name in times:
            s.restore(snap)
            t0 = time.perf_counter()
            decode() if name == "decode" else verify(int(name[2:]))
            if r:
                times[name].append(time.perf_counter() - t0)
    return {name: (min(v), statistics.median(v)) for name, v in times.items()}


def decode_speed(eng, prompt: list[int], n: int, rounds: int, k: int) -> dict:
    s = eng.new_session(len(prompt) + n + 8)
    s.sync(prompt)
    s.snapshot(keep=True)  # every generation restores the prompt's state instead of prefilling it
    plain = ds4_mlx.generate(eng, prompt, max_tokens=n, temperature=0, session=s, draft=False)
    script = prompt + plain.tokens
    runs: dict[str, list] = {"plain": []} | {f"{int(a * 100)} %": [] for a in ACCEPTANCE}
    for r in range(rounds):
        for name in runs:
            if name == "plain":
                res = ds4_mlx.generate(eng, prompt, max_tokens=n, temperature=0, session=s, draft=False)
            else:
                err = 1.0 - float(name[:-2]) / 100
                d = ScriptedDrafter(script, err, seed=r, n_vocab=eng.config.n_vocab)
                res = ds4_mlx.generate(eng, prompt, max_tokens=n, temperature=0, session=s, draft=d, draft_k=k)
            runs[name].append(res)
    out = {}
    for name, results in runs.items():
        tps = max(x.stats.decode_tps for x in results)
        # each round's speed over the plain run of the same round (adjacent in time), median over rounds
        ratio = statistics.median(x.stats.decode_tps / p.stats.decode_tps for x, p in zip(results, runs["plain"]))
        drafted = sum(x.stats.drafted_tokens for x in results)
        accepted = sum(x.stats.accepted_tokens for x in results)
        same = all(x.tokens == plain.tokens for x in results)
        out[name] = (tps, ratio, accepted / drafted if drafted else None, same,
                     sum(x.stats.verify_steps for x in results) / len(results))
    return out


def weight_bytes(path) -> tuple[int, int, int, int, int]:
    """(dense bytes read per token: every non-routed, non-embedding tensor incl. the output matrix;
    the output matrix alone; routed bytes per expert summed over the file's layers; n_expert; n_layer)."""
    dense = head = routed = 0
    n_exp = n_layer = 0
    with GGUFFile(path) as f:
        for name, t in f.tensors.items():
            if name == "token_embd.weight" or name.endswith("tid2eid.weight"):
                continue  # a row gather per token, not a read of the matrix
            if "_exps." in name:
                n_exp = t.ne[-1]
                routed += t.nbytes // n_exp
                continue
            if name.startswith("blk."):
                n_layer = max(n_layer, int(name.split(".")[1]) + 1)
            if name == "output.weight":
                head = t.nbytes
            dense += t.nbytes
    return dense, head, routed, n_exp, n_layer


def expected_tokens(a: float, k: int) -> float:
    """Tokens emitted per verify of k drafts when each draft is right with probability a (independently,
    up to the first wrong one): the accepted run plus the target's own token."""
    return sum(a ** i for i in range(k + 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--numerics", default="default", choices=["default", "ds4-cpu"])
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens (random ids)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cost-rounds", type=int, default=0, help="rounds of part 1 (default: --rounds)")
    ap.add_argument("--draft-k", type=int, default=4)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = benchmark_model_path(args.model, tmp)
        eng = ds4_mlx.load(path, numerics=args.numerics)
        prompt = [0] + np.random.default_rng(0).integers(100, 5000, args.prompt - 1).tolist()
        print(f"model {path.name} ({eng.config.n_layer} layers, n_embd {eng.config.n_embd}), numerics "
              f"{args.numerics}, prompt {args.prompt} tokens; {load_text()}")

        cost = verify_cost(eng, prompt, args.cost_rounds or args.rounds)
        base, base_med = cost["decode"]
        print(f"\n1. verify cost (fastest / median of {args.cost_rounds or args.rounds} interleaved rounds; "
              f"{load_text()})")
        print(f"   decode step {base * 1e3:8.1f} ms {base_med * 1e3:8.1f} ms")
        for k in (1, 2, 3, 4):
            t, med = cost[f"k={k}"]
            print(f"   verify k={k} {t * 1e3:8.1f} ms {med * 1e3:8.1f} ms  = {t / base:5.2f} x decode "
                  f"(medians: {med / base_med:5.2f} x)")

        speed = decode_speed(eng, prompt, args.tokens, args.rounds, args.draft_k)
        plain_tps = speed["plain"][0]
        print(f"\n2. decode {args.tokens} tokens, draft_k {args.draft_k} (fastest of {args.rounds} interleaved "
              f"rounds; {load_text()})")
        for name, (tps, ratio, acc, same, verifies) in speed.items():
            acc_text = "-" if acc is None else f"{100 * acc:5.1f} %"
            print(f"   {name:>6}: {tps:7.2f} t/s = {tps / plain_tps:5.2f} x plain (per round: {ratio:5.2f} x)   "
                  f"measured acceptance "
                  f"{acc_text:>7}, {verifies:5.1f} verify steps, tokens equal plain: {same}")

        dense, head, routed, n_exp, n_layer = weight_bytes(path)
        per_layer_dense = (dense - head) / max(n_layer, 1)
        per_layer_routed = routed / max(n_layer, 1)
        real_dense = per_layer_dense * REAL_LAYERS + head
        real_routed = per_layer_routed * REAL_LAYERS  # bytes of one expert in every layer
        used = eng.config.n_expert_used

        def read(L: int) -> float:
            distinct = n_exp * (1 - (1 - used / n_exp) ** L)
            return real_dense + real_routed * distinct

        print(f"\n3. bytes per token, scaled to {REAL_LAYERS} layers from this file's layers: dense "
              f"{real_dense / 1e9:.2f} GB (output matrix {head / 1e9:.2f} GB), routed {used} x "
              f"{real_routed / 1e6:.0f} MB = {used * real_routed / 1e9:.2f} GB; decode step reads "
              f"{read(1) / 1e9:.2f} GB")
        for k in (1, 2, 3, 4):
            print(f"   verify k={k} reads {read(k + 1) / 1e9:.2f} GB = {read(k + 1) / read(1):.2f} x a decode step "
                  f"(bandwidth-bound expectation of its cost)")
        for a in ACCEPTANCE:
            best = max(range(0, 5), key=lambda k: expected_tokens(a, k) * read(1) / read(k + 1))
            gain = expected_tokens(a, best) * read(1) / read(best + 1)
            print(f"   acceptance {int(a * 100):3d} %: best k {best}, expected speed-up {gain:.2f} x "
                  f"(back-off to plain steps at k 0)")


if __name__ == "__main__":
    sys.exit(main())
