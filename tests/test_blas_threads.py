"""The suite's BLAS-order-sensitive tests again with 2 and 4 OpenBLAS threads and another kernel family.

Under pytest-xdist every worker runs one OpenBLAS thread (tests/conftest.py), so the default run checks
the single-thread kernels; a thread split changes which kernel sums what (issue #20: assertions that held
for one machine's split failed on another's). These are the tests that compare BLAS products: the NN/NT
forms and row slices of dense weights, the head's row ranges, the expert strategies, the expert-parallel
shares. Each runs in a fresh interpreter (OpenBLAS reads the variable when it loads)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORDER_SENSITIVE = [
    "tests/test_linear.py",
    "tests/test_pipeline_split.py::test_row_ranges_of_the_head_give_the_whole_heads_logits",
    "tests/test_expert_strategies.py::test_device_strategy_decodes_like_host",
    "tests/test_expert_strategies.py::test_strategies_share_the_prefill_arithmetic_with_native_off",
    "tests/test_expert_parallel.py::test_the_ranks_shares_add_up_to_the_whole_tensor_bit_for_bit",
]


X86_LINUX = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


@pytest.mark.slow
@pytest.mark.parametrize("threads,coretype", [
    (2, None), (4, None),
    # another kernel family: Sandybridge's AVX kernels (no FMA) run on every x86_64 with AVX, where the
    # default picks Haswell/Zen/SkylakeX ones (Debian's OpenBLAS is built for every family at once).
    # A machine that sets OPENBLAS_CORETYPE itself does so because other kernels misbehave on its CPU:
    # that setting is left alone.
    pytest.param(2, "Sandybridge", marks=pytest.mark.skipif(
        not X86_LINUX or "OPENBLAS_CORETYPE" in os.environ,
        reason="needs OpenBLAS's x86_64 kernels and a machine that does not pin OPENBLAS_CORETYPE")),
])
def test_order_sensitive_tests_pass_with_other_blas_splits(tiny_model_path, threads, coretype, tmp_path):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), DS4_MLX_TINY_MODEL=str(tiny_model_path))
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    env.pop("PYTEST_XDIST_WORKER", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                        "--basetemp", str(tmp_path / "t"), *ORDER_SENSITIVE],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = "\n".join(r.stdout.splitlines()[-30:])
    assert r.returncode == 0, f"OPENBLAS_NUM_THREADS={threads} OPENBLAS_CORETYPE={coretype}:\n{tail}\n{r.stderr[-2000:]}"
    assert " passed" in tail and "failed" not in tail, tail
