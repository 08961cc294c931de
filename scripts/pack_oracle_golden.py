#!/usr/bin/env python3
"""Pack the oracle's golden data (a ``shared/`` folder: oracle/, test-vectors/, bench-data/, spec/) into
the compact form the test suite reads from ``tests/data/`` (see tests/data/README.md), so a clone of the
repository tests itself without that folder. Reproducible: the same inputs give the same files.

What is packed, and why that is enough (the assertions that read each item are in tests/oracle_golden.py):
  * logits rows: the sha256 of each row's exact float32 bytes (bit-exact ``ds4-cpu`` assertions need only
    equality) and the row in float16 plus the rms of that rounding (band checks: ~2e-4 against bands of
    0.06 and more; the tests subtract it from the band, so a pass still implies the float32 check);
  * per-layer states [T, 4, n_embd]: per token row the sha256 of the exact float32 bytes, and the values as
    integer codes of a per-(token, stream) step of 2^-12 x the row's rms (error <= 2^-13 of the row's rms)
    plus the exact rms of each array and of its reconstruction error (again subtracted from the bands);
  * the golden JSON documents, prompts and test vectors verbatim (xz; the vectors into the package's
    ``ds4_mlx/vectors_data/preview``, which ``ds4-mlx vectors`` reads), the bench-data texts (xz), and the
    three prompt constants the chat-template test checks, cut from spec/ARCHITECTURE.md;
  * the sha256 of the oracle generator's output for the dims the tests build, so our generator's
    ``oracle_bytes`` mode is checked against it.

    python scripts/pack_oracle_golden.py --shared ../shared --out tests/data
    python scripts/pack_oracle_golden.py --shared ../shared --verify

``--verify`` is the cross-check a developer runs after packing (the test suite never reads ``shared/``):
it packs again into a temporary folder and requires the same contents as tests/data and
ds4_mlx/vectors_data/preview (every array equal,
every other file byte for byte), and checks through tests/oracle_golden.py's readers what the tests rely
on: each row's digest is the float32 original's, and each stored error bounds the copy's real error.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import oracle_golden  # noqa: E402  (the readers the tests use, and what they share with the packer)
from oracle_golden import GENERATOR_CASES, row_sha256  # noqa: E402

VECTORS = REPO / "ds4_mlx" / "vectors_data" / "preview"  # the preview checkpoint's official API vectors
CASES = ("raw_short", "chat_nothink", "dev_long")
STEP_BITS = 12  # code step = rms(row) * 2^-STEP_BITS


def xz(data: bytes) -> bytes:
    # fixed settings and no timestamps: the same input always gives the same bytes
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)


def save_npz_xz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(xz(buf.getvalue()))


def pack_logits(golden: Path, out: Path, case: str) -> None:
    g = json.loads((golden / f"{case}.json").read_text())
    full = np.load(golden / f"{case}.logits.npy")
    f16 = full.astype(np.float16)
    err = np.sqrt(np.mean(np.square(f16.astype(np.float64) - full), axis=1))
    steps = np.array(g["full_logits"]["steps"], np.int32)
    for i, k in enumerate(steps):  # the argmax the tests read from the float16 rows is ds4's
        assert int(np.argmax(f16[i])) == int(np.argmax(full[i])) == g["steps"][k]["argmax"], (case, k)
        # the tests take ds4's top 3 and its margin from the JSON top-20: the same values as the rows
        top20 = sorted(g["steps"][k]["top20"], key=lambda e: -e["logit"])
        assert [e["id"] for e in top20[:3]] == list(np.argsort(-full[i])[:3]), (case, k)
        assert all(abs(e["logit"] - float(full[i][e["id"]])) < 1e-6 for e in top20), (case, k)
    save_npz_xz(out / f"{case}.logits.npz.xz", {"steps": steps, "f16": f16, "err_rms": err,
                                                "sha256": row_sha256(full)})


def load_layers(golden: Path, case: str) -> dict[str, np.ndarray]:
    """The oracle's layer dump with one key per state (``layer_in_<i>``, ``after_attn_<i>``) and
    ``prompt_tokens``."""
    z = np.load(golden / f"{case}.layers.npz")
    d = {k: z[k] for k in z.files}
    if "layer_in" in d:  # stacked form -> per-layer keys
        for name in ("layer_in", "after_attn"):
            for i in range(d[name].shape[0]):
                d[f"{name}_{i}"] = d[name][i]
            del d[name]
    return d


def pack_layers(golden: Path, out: Path, case: str) -> None:
    d = load_layers(golden, case)
    arrays = {"prompt_tokens": d.pop("prompt_tokens").astype(np.int32)}
    for key, a in sorted(d.items()):
        a64 = a.astype(np.float64)
        step = np.sqrt(np.mean(np.square(a64), axis=-1)) * 2.0 ** -STEP_BITS  # [T, n_hc]
        codes = np.rint(a64 / step[..., None])
        assert np.abs(codes).max() < 2**15, key
        recon = (codes * step[..., None]).astype(np.float32)
        arrays[f"{key}.codes"] = codes.astype(np.int16)
        arrays[f"{key}.step"] = step
        arrays[f"{key}.rms"] = np.array(np.sqrt(np.mean(np.square(a64))))
        arrays[f"{key}.err_rms"] = np.array(np.sqrt(np.mean(np.square(recon.astype(np.float64) - a64))))
        arrays[f"{key}.sha256"] = row_sha256(a)
    save_npz_xz(out / f"{case}.layers.npz.xz", arrays)


def spec_constants(spec: str) -> dict[str, str]:
    """The escaped constants of spec §11.6, cut from the document by their labels."""
    def fenced(label: str) -> str:
        return re.compile(r"```\n(.*?)\n```", re.S).search(spec, spec.index(label)).group(1).replace("\\n", "\n")

    def inline(label: str) -> str:
        at = spec.index(label)
        line = spec[at: spec.index("\n", at)]
        return line[line.index("`") + 1: line.rindex("`")].replace("\\n", "\n")

    return {"MAX_EFFORT_PREFIX": fenced("MAXPREFIX (exact bytes"),
            "TOOLS_PROMPT": fenced("TOOLS_PROMPT (exact bytes"),
            "TOOLS_SUFFIX": inline("TOOLS_SUFFIX: `")}


def generator_digests(generator: Path) -> dict[str, str]:
    """sha256 of the oracle generator's files for the dims the tests build with our generator."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in GENERATOR_CASES.items():
            path = Path(tmp) / f"{name}.gguf"
            subprocess.run([sys.executable, str(generator), "--out", str(path), *args], check=True,
                           stdout=subprocess.DEVNULL)
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def pack(src: Path, out: Path, vectors: Path = VECTORS) -> None:
    """Pack ``src`` into ``out`` (the tests' folder) and its official API vectors into ``vectors`` (the
    package's ``vectors_data/preview``: ``ds4-mlx vectors`` ships them to users, so they live in the package,
    not under tests/)."""
    golden = src / "oracle" / "golden"
    odir = out / "oracle"
    (odir / "golden" / "prompts").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(golden / "manifest.json", odir / "golden" / "manifest.json")
    for p in sorted((golden / "prompts").glob("*.txt")):
        shutil.copyfile(p, odir / "golden" / "prompts" / p.name)
    for case in CASES:
        (odir / "golden" / f"{case}.json.xz").write_bytes(xz((golden / f"{case}.json").read_bytes()))
        pack_logits(golden, odir / "golden", case)
        pack_layers(golden, odir / "golden", case)
    (odir / "generator_sha256.json").write_text(
        json.dumps(generator_digests(src / "oracle" / "make_tiny_gguf.py"), indent=1) + "\n")

    tv = src / "test-vectors"
    for p in sorted(tv.rglob("*")):
        if p.is_file():
            dst = vectors / p.relative_to(tv)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if p.suffix == ".json" and p.stat().st_size > 4096:
                dst.with_name(dst.name + ".xz").write_bytes(xz(p.read_bytes()))
            else:
                shutil.copyfile(p, dst)
    (out / "bench-data").mkdir(parents=True, exist_ok=True)
    for p in sorted((src / "bench-data").glob("*.txt")):
        (out / "bench-data" / (p.name + ".xz")).write_bytes(xz(p.read_bytes()))
    spec = (src / "spec" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    (out / "spec_constants.json").write_text(json.dumps(spec_constants(spec), indent=1, ensure_ascii=False) + "\n",
                                             encoding="utf-8")


# Not the packer's: README.md documents the folder; agent_requests/ holds request bodies recorded from the
# real agent clients (scripts/agent_clients.py), not anything in shared/.
NOT_PACKED = (Path("README.md"), Path("agent_requests"))


def _packed_files(d: Path) -> set[Path]:
    return {p.relative_to(d) for p in d.rglob("*")
            if p.is_file() and not any(p.relative_to(d) == n or n in p.relative_to(d).parents for n in NOT_PACKED)}


def _same_npz_xz(a: Path, b: Path) -> bool:
    """Same arrays (names, dtypes, shapes, bytes): np.savez stamps the time into its zip entries, so
    two packings of the same data differ in bytes but not in content."""
    za, zb = oracle_golden._npz_xz(a), oracle_golden._npz_xz(b)
    return za.keys() == zb.keys() and all(
        za[k].dtype == zb[k].dtype and za[k].shape == zb[k].shape and za[k].tobytes() == zb[k].tobytes() for k in za)


def verify(src: Path) -> list[str]:
    """What differs between tests/data and the oracle's folder ``src``, one line each (empty: all agree)."""
    data = oracle_golden.DATA
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        pack(src, fresh / "data", fresh / "vectors")
        for name, here, there in (("tests/data", data, fresh / "data"),
                                  ("ds4_mlx/vectors_data/preview", VECTORS, fresh / "vectors")):
            ours, theirs = _packed_files(here), _packed_files(there)
            problems += [f"{name}/{p}: not packed from {src}" for p in sorted(ours - theirs)]
            problems += [f"{name}/{p}: packed from {src}, missing" for p in sorted(theirs - ours)]
            for rel in sorted(ours & theirs):
                same = (_same_npz_xz(here / rel, there / rel) if rel.name.endswith(".npz.xz")
                        else (here / rel).read_bytes() == (there / rel).read_bytes())
                if not same:
                    problems.append(f"{name}/{rel}: differs from a fresh packing")

    # what the tests assume of the reduced copies, read the way they read them
    golden = src / "oracle" / "golden"
    slack = 1 + 1e-9
    for case in CASES:
        full = np.load(golden / f"{case}.logits.npy")
        packed = oracle_golden.Logits(case)
        if not np.array_equal(row_sha256(full), packed.sha256):
            problems.append(f"{case} logits: row digests are not the float32 rows'")
        for i in range(len(full)):
            if oracle_golden.rms(packed.approx[i] - full[i]) > packed.err_rms[i] * slack:
                problems.append(f"{case} logits row {i}: the float16 copy's error exceeds its stored err_rms")
        layers = oracle_golden.layer_dump(case)
        for key, a in load_layers(golden, case).items():
            if key == "prompt_tokens":
                if not np.array_equal(layers[key], a):
                    problems.append(f"{case} layers: prompt_tokens differ")
                continue
            st = layers[key]
            if not st.exact_rows(a).all():
                problems.append(f"{case} {key}: row digests are not the float32 rows'")
            a64 = a.astype(np.float64)
            if oracle_golden.rms(st.approx - a64) > st.err_rms * slack or \
                    abs(st.rms - oracle_golden.rms(a64)) > st.rms * 1e-12:
                problems.append(f"{case} {key}: stored rms / err_rms do not bound the copy")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", required=True, type=Path, help="the shared/ folder (oracle/, test-vectors/, ...)")
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", type=Path, help="pack into this folder (tests/data)")
    mode.add_argument("--verify", action="store_true",
                      help="check tests/data against the shared/ folder instead of packing")
    args = ap.parse_args(argv)
    missing = [d for d in ("oracle/golden", "test-vectors", "bench-data", "spec") if not (args.shared / d).is_dir()]
    if missing:
        ap.error(f"--shared {args.shared}: not the oracle's folder (no {', '.join(missing)})")
    if args.verify:
        problems = verify(args.shared)
        for line in problems:
            print(line, file=sys.stderr)
        print(f"tests/data and {VECTORS.relative_to(REPO)} {'differ from' if problems else 'agree with'} {args.shared}")
        return 1 if problems else 0
    pack(args.shared, args.out)
    total = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"packed into {args.out}: {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
