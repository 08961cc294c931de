#!/usr/bin/env python3
"""Fuzz the GGUF reader, config and layout validation with mutated copies of a small DS4 model.

    python scripts/fuzz_gguf.py --cases 10000 --seed 1 [--model small.gguf] [--save-failures DIR]

Each case mutates a valid file (byte flips, interesting values, insertions, deletions in the
header, metadata and tensor-directory region; truncations anywhere), then opens it, reads every
metadata value and tensor view, builds the config and validates the layout. The only acceptable
outcomes are success, GGUFError, or (for a readable file) LayoutError; anything else, or a case
running past its time limit, is a bug. The summary counts outcomes per mutation kind.

The small model and the byte-patch helpers are in tests/small_model.py; tests/test_fuzz.py
loads this script by path to run the engine on fewer cases.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import struct
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

# The small model's builder is a test helper (tests/small_model.py), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from small_model import build_small_model  # noqa: E402

# -- the fuzz engine -------------------------------------------------------------------------------

INTERESTING_U32 = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x7FFFFFFF,
                   0x80000000, 0xFFFFFFFF]
# 0x10001: one past the reader's caps on the key and tensor counts, and small enough for a small
# model's bytes to hold, so the caps themselves are reached (not only the bytes-left bound).
INTERESTING_U64 = [0, 1, 8, 32, 0x100, 0x10001, 0xFFFFFFFF, 1 << 32, 1 << 40, 0x7FFFFFFFFFFFFFFF,
                   0x8000000000000000, 0xFFFFFFFFFFFFFFFF]
KINDS = ("flip", "interesting", "insert", "delete", "truncate")


def mutate(data: bytes, header_end: int, rng: random.Random) -> tuple[bytes, str]:
    """One random mutation; returns (new bytes, kind)."""
    kind = rng.choice(KINDS)
    b = bytearray(data)
    if kind == "flip":
        for _ in range(rng.choice((1, 1, 1, 2, 4, 8))):
            b[rng.randrange(header_end)] ^= rng.randint(1, 255)
    elif kind == "interesting":
        pos = rng.randrange(header_end)
        if rng.random() < 0.5:
            v = rng.choice(INTERESTING_U32 + [len(data) & 0xFFFFFFFF])
            b[pos : pos + 4] = struct.pack("<I", v)
        else:
            v = rng.choice(INTERESTING_U64 + [len(data), len(data) - header_end])
            b[pos : pos + 8] = struct.pack("<Q", v)
        del b[len(data):]  # writing near the end must not grow the file
    elif kind == "insert":
        pos = rng.randrange(header_end)
        b[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "delete":
        pos = rng.randrange(header_end)
        del b[pos : pos + rng.randint(1, 16)]
    else:  # truncate: half inside the header region, half anywhere
        end = rng.randrange(header_end) if rng.random() < 0.5 else rng.randrange(len(data))
        del b[end:]
    return bytes(b), kind


class CaseTimeout(Exception):
    """A case ran past its time limit (a hang or a runaway loop)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise CaseTimeout in the main thread after ``seconds`` of wall time."""
    def _alarm(signum, frame):
        raise CaseTimeout(f"case exceeded {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def exercise(path: Path) -> str:
    """Open, read everything, configure, validate. Returns 'valid', 'layout' or 'gguf'; any other
    exception propagates (that is a bug)."""
    from ds4_mlx.errors import GGUFError, LayoutError
    from ds4_mlx.formats.gguf import GGUFFile
    from ds4_mlx.formats.layout import load_model_file

    try:
        f = GGUFFile(path)
    except GGUFError as exc:
        _check_message(exc)
        return "gguf"
    with f:
        for key, fl in f.fields.items():
            if fl.count is not None and fl.sub_type is not None and fl.sub_type.name not in ("STRING", "ARRAY"):
                arr = f.metadata_array(key)
                assert len(arr) == fl.count
        for name in f.tensors:
            a = f.tensor_array(name)
            assert a.nbytes == f.tensors[name].nbytes
    try:
        f, _cfg, _report = load_model_file(path)
    except LayoutError as exc:
        _check_message(exc)
        return "layout"
    f.close()
    return "valid"


def _check_message(exc: Exception) -> None:
    """Errors are printed as one line by the CLI: no newline, and no megabyte-long quotes of
    corrupt names or values."""
    msg = str(exc)
    if "\n" in msg or len(msg) > 2000:
        raise AssertionError(f"badly formed error message ({len(msg)} chars): {msg[:300]!r}")


def run_fuzz(base: bytes, header_end: int, cases: int, seed: int, workdir: Path, *,
             per_case_s: float = 10.0, on_case: Callable[[int, str, str], None] | None = None,
             save_failures: Path | None = None) -> dict[str, Any]:
    rng = random.Random(seed)
    path = workdir / "case.gguf"
    outcomes: Counter = Counter()
    by_kind: dict[str, Counter] = {k: Counter() for k in KINDS}
    failures: list[dict[str, Any]] = []
    slowest = 0.0
    for i in range(cases):
        data, kind = mutate(base, header_end, rng)
        path.write_bytes(data)
        t0 = time.perf_counter()
        try:
            with time_limit(per_case_s):
                outcome = exercise(path)
        except CaseTimeout:
            outcome = "TIMEOUT"
        except Exception as exc:  # noqa: BLE001 - anything here is the bug being hunted
            outcome = f"BUG {type(exc).__name__}: {exc}"
        slowest = max(slowest, time.perf_counter() - t0)
        key = outcome if outcome in ("valid", "layout", "gguf") else "failure"
        outcomes[key] += 1
        by_kind[kind][key] += 1
        if key == "failure":
            failures.append({"case": i, "kind": kind, "outcome": outcome})
            if save_failures is not None:
                save_failures.mkdir(parents=True, exist_ok=True)
                (save_failures / f"case{i:06d}.gguf").write_bytes(data)
        if on_case is not None:
            on_case(i, kind, outcome)
    return {"cases": cases, "seed": seed, "outcomes": dict(outcomes),
            "by_kind": {k: dict(v) for k, v in by_kind.items()}, "failures": failures,
            "slowest_case_s": round(slowest, 4)}


def header_end_of(path: Path) -> int:
    """End of the header, metadata and tensor directory: where tensor data starts."""
    from ds4_mlx.formats.gguf import GGUFFile

    with GGUFFile(path) as f:
        return f.data_offset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, help="valid GGUF to mutate (default: build the small model)")
    ap.add_argument("--per-case-s", type=float, default=10.0, help="time limit of one case")
    ap.add_argument("--save-failures", type=Path, help="write failing inputs here")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="ds4-fuzz-") as tmp:
        tmp = Path(tmp)
        model = args.model or build_small_model(tmp / "small.gguf")
        base = Path(model).read_bytes()
        header_end = header_end_of(Path(model))
        t0 = time.perf_counter()

        def progress(i, kind, outcome):
            if (i + 1) % 1000 == 0:
                print(f"  {i + 1} cases, {time.perf_counter() - t0:.1f} s", file=sys.stderr)

        summary = run_fuzz(base, header_end, args.cases, args.seed, tmp, per_case_s=args.per_case_s,
                           on_case=progress, save_failures=args.save_failures)
        summary["model_bytes"] = len(base)
        summary["header_bytes"] = header_end
        summary["elapsed_s"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"fuzz: {summary['cases']} cases, seed {summary['seed']}, model {summary['model_bytes']:,} bytes "
              f"(header region {summary['header_bytes']:,} bytes), {summary['elapsed_s']} s, "
              f"slowest case {summary['slowest_case_s']} s")
        print(f"outcomes: {summary['outcomes']}")
        for kind, counts in summary["by_kind"].items():
            print(f"  {kind:<12} {counts}")
        for fl in summary["failures"][:20]:
            print(f"FAILURE case {fl['case']} ({fl['kind']}): {fl['outcome']}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
