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
  * the golden JSON documents, prompts and test vectors verbatim (xz), the bench-data texts (xz), and the
    three prompt constants the chat-template test checks, cut from spec/ARCHITECTURE.md;
  * the sha256 of the oracle generator's output for the dims the tests build, so our generator's
    ``oracle_bytes`` mode is checked against it.

    python scripts/pack_oracle_golden.py --shared ../shared --out tests/data
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

CASES = ("raw_short", "chat_nothink", "dev_long")
STEP_BITS = 12  # code step = rms(row) * 2^-STEP_BITS


def xz(data: bytes) -> bytes:
    # fixed settings and no timestamps: the same input always gives the same bytes
    return lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)


def save_npz_xz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(xz(buf.getvalue()))


def row_sha256(a: np.ndarray) -> np.ndarray:
    """uint8 [n, 32]: sha256 of the little-endian float32 bytes of each a[i]."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return np.array([np.frombuffer(hashlib.sha256(r.tobytes()).digest(), np.uint8) for r in a], np.uint8)


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


def pack_layers(golden: Path, out: Path, case: str) -> None:
    z = np.load(golden / f"{case}.layers.npz")
    d = {k: z[k] for k in z.files}
    if "layer_in" in d:  # stacked form -> per-layer keys
        for name in ("layer_in", "after_attn"):
            for i in range(d[name].shape[0]):
                d[f"{name}_{i}"] = d[name][i]
            del d[name]
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
    """The escaped constants as tests/test_chat_template.py used to cut them from the spec."""
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
    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo))
    sys.path.insert(0, str(repo / "tests"))
    from oracle_golden import GENERATOR_CASES  # noqa: E402

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in GENERATOR_CASES.items():
            path = Path(tmp) / f"{name}.gguf"
            subprocess.run([sys.executable, str(generator), "--out", str(path), *args], check=True,
                           stdout=subprocess.DEVNULL)
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", required=True, type=Path, help="the shared/ folder (oracle/, test-vectors/, ...)")
    ap.add_argument("--out", required=True, type=Path, help="tests/data")
    args = ap.parse_args(argv)
    src, out = args.shared, args.out
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
            dst = out / "test-vectors" / p.relative_to(tv)
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
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"packed into {out}: {total / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
