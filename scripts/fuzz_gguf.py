#!/usr/bin/env python3
"""Fuzz the GGUF reader, config and layout validation with mutated copies of a small DS4 model.

    python scripts/fuzz_gguf.py --cases 10000 --seed 1 [--model small.gguf] [--save-failures DIR]

Each case mutates a valid file (byte flips, interesting values, insertions, deletions in the
header, metadata and tensor-directory region; truncations anywhere), then opens it, reads every
metadata value and tensor view, builds the config and validates the layout. The only acceptable
outcomes are success, GGUFError, or (for a readable file) LayoutError; anything else, or a case
running past its time limit, is a bug. The summary counts outcomes per mutation kind.

The module also holds the small-model helpers the tests share (build_small_model, patch helpers,
rewrite_gguf); tests load it by path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]

# A small but complete DS4 layout: hash layers 0-2, one ratio-4 (indexer) and one ratio-128 layer;
# 4 MiB, built in ~0.5 s.
SMALL_MODEL_ARGS = [
    "--n-vocab", "512", "--n-layer", "4", "--n-embd", "256", "--n-head", "2", "--head-dim", "192",
    "--n-out-group", "1", "--q-lora", "64", "--o-lora", "32", "--n-expert", "4", "--n-expert-used", "2",
    "--n-ff-exp", "256", "--n-indexer-head", "2", "--indexer-top-k", "4", "--swa", "8",
]

# ds4 looks these up by string; the generator refuses a tokenizer without them.
_REQUIRED_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<think>", "</think>", "｜DSML｜"]


def shared_dir() -> Path:
    env = os.environ.get("DS4_MLX_SHARED")
    return Path(env) if env else REPO.parent / "shared"


def oracle_generator() -> Path:
    p = shared_dir() / "oracle" / "make_tiny_gguf.py"
    if not p.is_file():
        raise FileNotFoundError(f"oracle generator not found at {p} (set DS4_MLX_SHARED)")
    return p


def write_small_tokenizer_json(path: Path, n_vocab: int = 512) -> Path:
    """A synthetic byte-level BPE tokenizer.json with ``n_vocab`` ids, multi-byte UTF-8 tokens
    and merges, so the fuzzed file carries string arrays like the real vocabulary."""
    added = [{"id": i, "content": t, "special": True} for i, t in enumerate(_REQUIRED_TOKENS)]
    vocab: dict[str, int] = {}
    alphabet = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ", "Ċ", "é", "ü", "ß", "中", "文", "Ω", "€", "🙂"]
    i = len(added)
    for ch in alphabet:
        vocab[ch] = i
        i += 1
    merges = []
    pairs = ((a, b) for a in alphabet for b in alphabet)  # 110² pairs, more than any test vocab needs
    while i < n_vocab:
        a, b = next(pairs)
        vocab[a + b] = i
        merges.append(f"{a} {b}")
        i += 1
    tj = {"model": {"type": "BPE", "vocab": vocab, "merges": merges}, "added_tokens": added}
    path.write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return path


def build_small_model(out: Path, *, tokenizer: bool = True, extra_args: list[str] = (),
                      summary_json: Path | None = None) -> Path:
    """Write the small model with the oracle's generator (the same layout code as the tiny model)."""
    out = Path(out)
    cmd = [sys.executable, str(oracle_generator()), "--out", str(out), *SMALL_MODEL_ARGS, *extra_args]
    if tokenizer:
        cmd += ["--tokenizer-json", str(write_small_tokenizer_json(out.with_suffix(".tokenizer.json")))]
    else:
        cmd += ["--no-tokenizer"]
    if summary_json is not None:
        cmd += ["--summary-json", str(summary_json)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


# -- byte patching (locations found by searching the encoded names, independent of our reader) ---


def _enc(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_key_pos(data: bytes, key: str) -> int:
    """Offset of the metadata key's length prefix."""
    pos = data.find(_enc(key))
    if pos < 0:
        raise KeyError(key)
    return pos


def kv_value_pos(data: bytes, key: str) -> int:
    """Offset of the value (after the u32 value type); for arrays, of the element type."""
    return kv_key_pos(data, key) + 8 + len(key.encode()) + 4


def kv_type_pos(data: bytes, key: str) -> int:
    return kv_value_pos(data, key) - 4


def tensor_info_pos(data: bytes, name: str) -> int:
    """Offset of the tensor-info entry (its name's length prefix). Tensor infos follow the
    metadata, so the last occurrence is taken (a metadata string could hold the same bytes)."""
    pos = data.rfind(_enc(name))
    if pos < 0:
        raise KeyError(name)
    return pos


def tensor_info_fields(data: bytes, name: str) -> dict[str, int]:
    """Byte offsets of a tensor info's n_dims, dims, type and offset fields."""
    p = tensor_info_pos(data, name) + 8 + len(name.encode())
    (n_dims,) = struct.unpack_from("<I", data, p)
    return {"n_dims": p, "dims": p + 4, "n": n_dims, "type": p + 4 + 8 * n_dims, "offset": p + 8 + 8 * n_dims}


def patch(data: bytes, pos: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, pos, value)
    return bytes(b)


def rewrite_gguf(src: Path, dst: Path, *, drop: set[str] = frozenset(),
                 replace: dict[str, tuple[Any, Any]] | None = None,
                 add: dict[str, tuple[Any, Any]] | None = None,
                 metadata: dict[str, tuple[Any, Any, Any] | None] | None = None) -> Path:
    """Copy a GGUF through gguf-py's reader and writer with changes.

    ``replace`` / ``add``: tensor name -> (numpy array, GGMLQuantizationType) as GGUFWriter.add_tensor
    takes them (quantized: uint8 rows of bytes); added tensors go last. ``metadata``: key ->
    (value, GGUFValueType, sub_type), or None to delete; changed keys keep their place.
    """
    import gguf
    import numpy as np

    replace = replace or {}
    metadata = metadata or {}
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in metadata:
            spec = metadata[key]
            if spec is not None:
                value, vtype, sub = spec
                w.add_key_value(key, value, vtype, sub_type=sub)
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, spec in metadata.items():
        if spec is not None and key not in r.fields:
            value, vtype, sub = spec
            w.add_key_value(key, value, vtype, sub_type=sub)

    def put(name, arr, qtype):
        plain = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.I32)
        if qtype in plain:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=qtype)

    for t in r.tensors:
        if t.name in drop:
            continue
        if t.name in replace:
            put(t.name, *replace[t.name])
        else:
            put(t.name, np.array(t.data), t.tensor_type)
    for name, (arr, qtype) in (add or {}).items():
        put(name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# -- the fuzz engine -------------------------------------------------------------------------------

INTERESTING_U32 = [0, 1, 2, 3, 4, 7, 8, 9, 12, 13, 0x7F, 0x80, 0xFF, 0x100, 0x7FFF, 0xFFFF, 0x7FFFFFFF,
                   0x80000000, 0xFFFFFFFF]
INTERESTING_U64 = [0, 1, 8, 32, 0x100, 0xFFFFFFFF, 1 << 32, 1 << 40, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000,
                   0xFFFFFFFFFFFFFFFF]
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
