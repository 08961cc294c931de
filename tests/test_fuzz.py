"""Seeded fuzzing of the reader, config and layout checks (scripts/fuzz_gguf.py runs it at scale).

Every mutated file must open (and then validate or raise LayoutError) or raise GGUFError; any other
exception, or a case running past its time limit, fails.
"""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path

import pytest

from small_model import kv_value_pos, patch

REPO = Path(__file__).resolve().parents[1]
CASES = 400
PER_CASE_S = 5.0


def _tools():
    """The fuzz engine of scripts/fuzz_gguf.py (a script, so loaded by path)."""
    name = "ds4_fuzz_gguf"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "fuzz_gguf.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.mark.parametrize("seed", [1, 2])
def test_fuzz_cases_fail_only_with_our_errors(small_model_path, tmp_path, seed):
    tools = _tools()
    base = small_model_path.read_bytes()
    header_end = tools.header_end_of(small_model_path)
    summary = tools.run_fuzz(base, header_end, CASES // 2, seed, tmp_path, per_case_s=PER_CASE_S)
    assert summary["failures"] == [], summary["failures"][:5]
    assert sum(summary["outcomes"].values()) == CASES // 2
    # the cases reach every outcome class and every mutation kind (a fuzz that only ever hits
    # the magic check would prove nothing)
    assert summary["outcomes"].get("gguf", 0) > 0 and summary["outcomes"].get("valid", 0) > 0
    assert all(sum(c.values()) > 0 for c in summary["by_kind"].values())


def test_fuzz_reaches_layout_errors(small_model_path, tmp_path):
    """Value mutations in the metadata must be able to produce a readable-but-invalid file."""
    tools = _tools()
    base = small_model_path.read_bytes()
    data = patch(base, kv_value_pos(base, "deepseek4.attention.sliding_window"), "<I", 0)
    p = tmp_path / "x.gguf"
    p.write_bytes(data)
    assert tools.exercise(p) == "layout"
    p.write_bytes(base)
    assert tools.exercise(p) == "valid"
    p.write_bytes(base[:100])
    assert tools.exercise(p) == "gguf"


def test_mutations_are_seeded_and_change_the_file(small_model_path):
    tools = _tools()
    base = small_model_path.read_bytes()
    end = tools.header_end_of(small_model_path)
    r1, r2 = random.Random(7), random.Random(7)
    assert [tools.mutate(base, end, r1) for _ in range(20)] == [tools.mutate(base, end, r2) for _ in range(20)]
    rng = random.Random(3)
    changed = 0
    for _ in range(100):
        data, kind = tools.mutate(base, end, rng)
        assert kind in tools.KINDS
        if kind in ("insert", "delete", "truncate"):
            assert len(data) != len(base)
        else:
            assert len(data) == len(base)
        changed += data != base  # an "interesting" value may equal the bytes it overwrites
    assert changed >= 90


def test_time_limit_stops_a_runaway_case():
    tools = _tools()
    t0 = time.perf_counter()
    with pytest.raises(tools.CaseTimeout):
        with tools.time_limit(0.2):
            while True:
                pass
    assert time.perf_counter() - t0 < 2.0


def test_exercise_lets_foreign_exceptions_through(tmp_path, monkeypatch):
    """The harness must report a bug, not swallow it: an unexpected exception propagates."""
    tools = _tools()
    import ds4_mlx.formats.gguf as g

    def boom(self, *a, **k):
        raise KeyError("simulated bug")

    monkeypatch.setattr(g.GGUFFile, "_parse", boom)
    p = tmp_path / "y.gguf"
    p.write_bytes(b"GGUF")
    summary = tools.run_fuzz(b"GGUF" + bytes(60), 64, 3, 0, tmp_path, per_case_s=PER_CASE_S)
    assert summary["outcomes"] == {"failure": 3}
    assert all("KeyError" in f["outcome"] for f in summary["failures"])
