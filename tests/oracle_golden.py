"""The oracle's golden data as packed in tests/data (by scripts/pack_oracle_golden.py), and the checks
that compare our outputs with it.

Exact assertions compare sha256 digests of the exact float32 bytes of each logits row / each token's
layer state: equal digests are equal bits. Band assertions compare with reduced-precision copies and
subtract the copy's own error (stored, measured against the float32 original when packing) from the
band: by the triangle inequality rms(ours - ds4) <= rms(ours - copy) + rms(copy - ds4), so passing the
check on the copy implies passing it on ds4's float32 values; it is never looser.
``scripts/pack_oracle_golden.py --verify`` checks these premises against the oracle's float32 originals.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np

from small_model import SMALL_MODEL_ARGS

DATA = Path(__file__).resolve().parent / "data"
ORACLE = DATA / "oracle"
ORACLE_SHA256 = "4f967c3e99f0ec622362d123f1e9495ae3ab29b9c83f943fd78d257f37b73791"

# Arguments of the oracle generator (shared/oracle/make_tiny_gguf.py) for the models the tests build with
# our generator's oracle_bytes mode; tests/data/oracle/generator_sha256.json has the oracle's sha256 of each.
GENERATOR_CASES = {
    "tiny": [],
    "small_model_no_tokenizer": [*SMALL_MODEL_ARGS, "--no-tokenizer"],
    # tests/test_tiny_model.py's SMALL dims
    "small_layout": [
        "--n-layer", "5", "--n-embd", "256", "--n-vocab", "1000", "--n-head", "4", "--head-dim", "192",
        "--n-rot", "64", "--n-out-group", "2", "--q-lora", "64", "--o-lora", "32", "--n-expert", "8",
        "--n-expert-used", "2", "--n-ff-exp", "256", "--n-hash-layer", "2", "--swa", "16",
        "--n-indexer-head", "2", "--indexer-head-dim", "128", "--indexer-top-k", "8", "--n-hc", "4",
        "--sinkhorn-iter", "20", "--seed", "7", "--name", "small-random", "--exp-probs-b-all-layers",
        "--no-tokenizer"],
}


def generator_sha256(name: str) -> str:
    return json.loads((ORACLE / "generator_sha256.json").read_text())[name]


def materialize(dest: Path) -> Path:
    """Copy tests/data to ``dest`` with every text/JSON ``*.xz`` decompressed (numeric ``*.npz.xz``
    are read in place), giving the folder layout of the oracle's: oracle/golden/<case>.json,
    oracle/golden/prompts/, bench-data/. (The oracle's test-vectors/ ship in the package instead,
    ds4_mlx/vectors_data/preview, read through ``ds4_mlx.engine.vectors``.)"""
    for src in sorted(DATA.rglob("*")):
        if not src.is_file() or src.name.endswith(".npz.xz"):
            continue
        dst = dest / src.relative_to(DATA)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.suffix == ".xz":
            dst.with_suffix("").write_bytes(lzma.decompress(src.read_bytes()))
        else:
            shutil.copyfile(src, dst)
    return dest


def _npz_xz(path: Path) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(lzma.decompress(path.read_bytes()))) as z:
        return {k: z[k] for k in z.files}


def row_sha256(a: np.ndarray) -> np.ndarray:
    """uint8 [n, 32]: sha256 of the little-endian float32 bytes of each a[i]."""
    a = np.ascontiguousarray(a, dtype="<f4")
    return np.array([np.frombuffer(hashlib.sha256(r.tobytes()).digest(), np.uint8) for r in a], np.uint8)


def rms(d: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(d, dtype=np.float64))))


@lru_cache(maxsize=None)
def golden_json(case: str) -> dict:
    return json.loads(lzma.decompress((ORACLE / "golden" / f"{case}.json.xz").read_bytes()))


class Logits:
    """ds4's full logits rows of one case: ``steps`` (which teacher-forced steps are rows), ``approx``
    (float16 rows as float32), ``err_rms`` (rms of approx - ds4 per row), ``sha256`` (per row)."""

    def __init__(self, case: str):
        z = _npz_xz(ORACLE / "golden" / f"{case}.logits.npz.xz")
        self.case = case
        self.steps = [int(k) for k in z["steps"]]
        self.approx = z["f16"].astype(np.float32)
        self.err_rms = z["err_rms"]
        self.sha256 = z["sha256"]

    def rms_bound(self, got: np.ndarray, i: int) -> float:
        """An upper bound of rms(got - ds4's row i)."""
        return rms(got - self.approx[i]) + float(self.err_rms[i])

    def rms_lower_bound(self, got: np.ndarray, i: int) -> float:
        """A lower bound of rms(got - ds4's row i)."""
        return max(0.0, rms(got - self.approx[i]) - float(self.err_rms[i]))

    def exact_mismatches(self, rows: dict[int, np.ndarray]) -> list[str]:
        """For {step: our row}: a line per step whose float32 bits differ from ds4's."""
        out = []
        for i, k in enumerate(self.steps):
            if not np.array_equal(row_sha256(rows[k][None])[0], self.sha256[i]):
                d = np.abs(rows[k].astype(np.float64) - self.approx[i])
                out.append(f"{self.case} step {k}: bits differ (max |diff| vs the float16 copy {d.max():.3g})")
        return out


class State:
    """One dumped layer state [T, n_hc, n_embd]: ``approx`` (float32, |error| <= 2^-13 x the rms of its
    (token, stream) row), ``rms`` (exact, of ds4's array), ``err_rms`` (rms of approx - ds4), ``sha256``
    per token row."""

    def __init__(self, z: dict[str, np.ndarray], key: str):
        self.key = key
        self.approx = (z[f"{key}.codes"] * z[f"{key}.step"][..., None]).astype(np.float32)
        self.rms = float(z[f"{key}.rms"])
        self.err_rms = float(z[f"{key}.err_rms"])
        self.sha256 = z[f"{key}.sha256"]

    def rel_bound(self, got: np.ndarray) -> float:
        """An upper bound of rms(got - ds4) / rms(ds4)."""
        return (rms(got - self.approx) + self.err_rms) / self.rms

    def exact_rows(self, got: np.ndarray) -> np.ndarray:
        """bool [T]: which token rows of ``got`` are ds4's exact bits."""
        return np.all(row_sha256(got) == self.sha256, axis=1)


@lru_cache(maxsize=None)
def layer_dump(case: str) -> dict:
    """{"prompt_tokens": int64 [T], "<layer_in|after_attn>_<i>": State}."""
    z = _npz_xz(ORACLE / "golden" / f"{case}.layers.npz.xz")
    keys = sorted({k.split(".")[0] for k in z if "." in k})
    out: dict = {k: State(z, k) for k in keys}
    out["prompt_tokens"] = z["prompt_tokens"].astype(np.int64)
    return out
