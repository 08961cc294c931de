"""The examples run as shipped: the quickstart notebook top to bottom (nbclient, a kernel on this very
Python), the threaded app as a subprocess, and the notebook views (``_repr_html_``) of model and session."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ds4_mlx

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
KERNEL = "ds4-mlx-tests"


def _kernel_env(model_path: Path) -> dict[str, str]:
    """The kernel imports this checkout's ds4_mlx and opens the test model."""
    env = {"DS4_MLX_MODEL": str(model_path), "MPLBACKEND": "module://matplotlib_inline.backend_inline"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return env


def _kernel_manager(tmp_path: Path, model_path: Path):
    """A kernel spec written for ``sys.executable`` into a private folder, so the notebook runs on this
    venv's Python whatever other ``python3`` kernels the machine (or the user's ~/.local) has."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "ds4-mlx tests", "language": "python", "env": _kernel_env(model_path),
    }))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def run_notebook(path: Path, tmp_path: Path, model_path: Path):
    """Execute the notebook in ``path``'s folder; returns the executed notebook (raises on a cell error)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path, model_path), timeout=600,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def _text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            out.append(o["text"])
        elif "data" in o:
            out.append(o["data"].get("text/plain", ""))
    return "".join(out)


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory, tiny_model_path):
    return run_notebook(EXAMPLES / "quickstart.ipynb", tmp_path_factory.mktemp("nb"), tiny_model_path)


def test_quickstart_committed_without_outputs():
    """Outputs stay out of git (small diffs, no stale results)."""
    nb = json.loads((EXAMPLES / "quickstart.ipynb").read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None, cell["source"][:2]


def test_quickstart_runs_top_to_bottom(quickstart):
    code = [c for c in quickstart.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, errors
    assert all(c.execution_count for c in code), "a code cell did not run"
    joined = "\n".join(_text(c) for c in code)
    # the model object's notebook view, and streamed text followed by the stats line
    assert any("text/html" in o.get("data", {}) and "ds4_mlx Engine" in o["data"]["text/html"]
               for o in code[0].outputs)
    assert "-- finish: length; prompt:" in joined
    assert "reasoning:" in joined and "content:" in joined


def test_quickstart_second_turn_reuses_the_session(quickstart):
    cell = next(c for c in quickstart.cells if c.cell_type == "code" and "cached tokens:" in _text(c))
    m = re.search(r"prompt tokens: (\d+), cached tokens: (\d+)", _text(cell))
    prompt, cached = int(m.group(1)), int(m.group(2))
    assert 0 < cached < prompt
    html = [o["data"]["text/html"] for o in cell.outputs if "text/html" in o.get("data", {})]
    assert html and "ds4_mlx Session" in html[0] and "tokens held" in html[0]


def test_quickstart_logprobs_and_plot(quickstart):
    code = [c for c in quickstart.cells if c.cell_type == "code"]
    lp_cell = next(c for c in code if "logprobs=5" in c.source)
    rows = _text(lp_cell).strip().splitlines()
    assert len(rows) == 6 and all(" | " in r for r in rows)
    score_cell = next(c for c in code if "largest difference" in c.source)
    diff = float(_text(score_cell).split(":")[-1])
    assert diff < 1e-3, "rescoring should reproduce the streamed logprobs"
    plot_cell = next(c for c in code if "plt.show()" in c.source)
    assert any("image/png" in o.get("data", {}) for o in plot_cell.outputs), "no plot image"


# ------------------------------------------------------------------------------------------------
# examples/mlx_app.py: the worker-thread app

APP = EXAMPLES / "mlx_app.py"


def run_app(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    full_env.update(env or {})
    return subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, env=full_env,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.fixture
def tiny_cache(tmp_path, tiny_model_path) -> dict[str, str]:
    """XDG_CACHE_HOME holding the test model where ``--model tiny`` looks (no 240 MiB model built here)."""
    (tmp_path / "ds4-mlx").mkdir()
    (tmp_path / "ds4-mlx" / "ds4-tiny-demo.gguf").symlink_to(tiny_model_path)
    return {"XDG_CACHE_HOME": str(tmp_path)}


def test_app_streams_two_turns_from_its_worker(tiny_cache):
    proc = run_app("--model", "tiny", "-n", "8", "-p", "Hello", "-p", "And then?", env=tiny_cache)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "ds4-tiny-demo.gguf" in proc.stderr  # the [model] line
    stats = re.findall(r"^\[length\] prompt: (\d+) tokens \((\d+) cached\).*\(8 tokens\)", proc.stdout, re.M)
    assert len(stats) == 2, proc.stdout
    assert stats[0][1] == "0" and 0 < int(stats[1][1]) < int(stats[1][0]), stats  # turn 2 reuses the session
    assert proc.stdout.count("> ") >= 2


def test_app_timeout_cancels(tiny_model_path):
    proc = run_app("--model", str(tiny_model_path), "-n", "100000", "--timeout", "0")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\[cancelled\] prompt: \d+ tokens", proc.stdout, re.M), proc.stdout


def test_app_q_key_cancels_on_a_terminal(tiny_model_path):
    pexpect = pytest.importorskip("pexpect")
    from pty_spawn import finish, spawn  # a terminal without forking this (threaded) test process

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    child = spawn([sys.executable, str(APP), "--model", str(tiny_model_path), "-n", "100000", "--think"], env=env)
    try:
        child.expect(r"\x1b\[2m")  # the first reasoning piece, dimmed: generation is under way
        child.send("q")
        child.expect(r"\[cancelled\] prompt: \d+ tokens")
        child.expect(pexpect.EOF)
    finally:
        status = finish(child)  # kills a stuck session: the test fails instead of hanging
    assert status == 0


def test_app_bad_input_gets_one_line(tmp_path, tiny_model_path):
    proc = run_app("--model", str(tmp_path / "missing.gguf"))
    assert proc.returncode == 1 and proc.stderr.strip() == f"mlx_app: no model file at {tmp_path / 'missing.gguf'}"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 60)
    proc = run_app("--model", str(junk))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("mlx_app: "), proc.stderr
    # a prompt that does not fit: the worker reports it and the app fails cleanly
    proc = run_app("--model", str(tiny_model_path), "--ctx", "8")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "does not fit ctx 8" in proc.stderr


# ------------------------------------------------------------------------------------------------
# notebook views


def test_repr_and_html_views(tmp_path, tiny_model_path):
    hostile = tmp_path / "<b>x&y<b>.gguf"
    hostile.symlink_to(tiny_model_path)
    model = ds4_mlx.load(hostile)
    r = repr(model)
    assert "layers=6" in r and "size=240.0 MiB" in r and "experts=16/4" in r and "context_max=1048576" in r
    page = model._repr_html_()
    assert "<b>x" not in page and "&lt;b&gt;x&amp;y&lt;b&gt;.gguf" in page  # escaped, not markup
    for row in ("layers", "experts", "vocabulary", "context", "numerics", "size"):
        assert f">{row}</th>" in page, row
    assert "16 routed, 4 used, 1 shared" in page and "240.0 MiB" in page

    session = model.new_session(ctx=64)
    assert "ds4_mlx Session" in session._repr_html_() and "0 of 64 (0.0%)" in session._repr_html_()
    ds4_mlx.generate(model, "Hi", max_tokens=2, temperature=0, think=False, session=session)
    n = session.n_tokens
    page = session._repr_html_()
    assert f"{n} of 64" in page and f"{session.memory_bytes() / 2**20:.1f} MiB" in page and n > 0
    assert f"tokens={n}" in repr(session) and "ctx=64" in repr(session)
