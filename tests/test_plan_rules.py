"""Every variation of a load is decided once, in the loader's plan (issue #23): a structural test.

``model/load_plan.py`` resolves numerics, backend, expert strategy, kernels, native, compile,
distributed mode and the tunables from the environment once per load; the loader passes explicit
values down. This test reads the source of ``ds4_mlx/model`` and ``ds4_mlx/engine`` with ``ast``
(so docstrings, comments and strings never count) and fails on three kinds of code:

(a) **An environment read** (``os.environ``, ``os.getenv``, ``os.environb``) outside ``load_plan.py``.
    A variable read below the loader is read at an unknown time (at import, per call, per session),
    so two objects of one load can disagree, ``inspect --plan`` cannot show it, and a bad value fails
    mid-run instead of at load. The plan reads each variable once and names it in its error.

(b) **A device detection** (``mx.default_device``, ``mx.metal.is_available``, ``mx.cuda.is_available``,
    ``metal_kernels.available`` / ``available_dialects``, ``load_plan.detect_backend``) outside
    ``load_plan.py`` (and ``metal_kernels.py``'s own definitions of those two functions). Before the
    plan six places detected the device and disagreed (on MLX's CUDA backend ``linear.py`` decided
    CPU forms while the strategy decided the device): one detector, read once, cannot disagree.
    Likewise a plan is resolved (``load_plan.resolve``, which reads both) by the loaders only
    (``loader.py``, ``drafter_loader.py``); below them it is passed down.

(c) **A flag check of a variation axis** outside ``loader.py``, ``load_plan.py``, ``ops.py`` (the
    numerics, bound once as an ``Ops`` object) and ``memory_plan.py`` (which sizes every form): a
    comparison, or an ``if`` / ``while`` / conditional expression / boolean operand, on ``numerics``,
    ``Numerics.X``, ``.backend``, ``.gpu``, ``routes_on_device``, ``expert_strategy``, a strategy or
    distributed-mode name, ``compilable``; and ``isinstance`` against the distributed model classes
    (``PipelineModel``, ``DistributedModel``, ``ExpertParallel*``). A module that branches on an axis
    is a second place where that axis is decided: code paths multiply per file, and a new backend or
    mode must find them all. Objects built for the axis (an ``Ops``, a weight holding its form, a
    strategy's expert class) dispatch by being what they are instead.

``PENDING`` lists what the forward-path refactor of #23 is still removing from files other helpers
rewrite; an entry that no longer matches fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ds4_mlx"
SCANNED = ("model", "engine")

ENV_ALLOWED = {"model/load_plan.py"}
DETECT_ALLOWED = {"model/load_plan.py"}
# the two functions metal_kernels.py defines (and the tests' shims patch); nothing else calls them
DETECT_DEFINED_IN = {"model/metal_kernels.py": {"available", "available_dialects"}}
RESOLVE_ALLOWED = {"model/load_plan.py", "model/loader.py", "model/drafter_loader.py"}
AXIS_ALLOWED = {"model/loader.py", "model/load_plan.py", "model/ops.py", "model/memory_plan.py"}

# (a) environment reads
ENV_ATTRS = {"environ", "getenv", "environb", "putenv"}
# (b) detections: the attribute chains that read the device
DETECT_CHAINS = {("default_device",), ("metal", "is_available"), ("cuda", "is_available"),
                 ("available_dialects",), ("metal_kernels", "available"), ("detect_backend",)}
# (c) the axes: attribute or variable names whose comparison or truth value is a flag check
AXIS_NAMES = {"numerics", "backend", "gpu", "routes_on_device", "expert_strategy", "strategy",
              "distributed", "compilable"}
DIST_CLASSES = ("PipelineModel", "DistributedModel", "ExpertParallel")

# file -> the exact hits still found ("kind:name" as ``_hits`` reports them), in files other helpers
# of #23 rewrite: removed by the forward-path refactor. Delete an entry when its hit goes (a stale
# entry fails the test); add none.
PENDING: dict[str, set[str]] = {
}


def _chain(node: ast.AST) -> tuple[str, ...]:
    """``a.b.c`` -> ("a", "b", "c"); a call's function chain for ``a.b()``; () otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def _ends_with(chain: tuple[str, ...], suffix: tuple[str, ...]) -> bool:
    return len(chain) >= len(suffix) and chain[-len(suffix):] == suffix


def _axis_of(node: ast.AST) -> str | None:
    """The axis ``node`` reads, when it is one: ``x.backend``, ``numerics``, ``Numerics.DS4_CPU``,
    ``getattr(x, "routes_on_device", ...)``."""
    if isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "Numerics":
            return f"Numerics.{node.attr}"
        if node.attr in AXIS_NAMES:
            return node.attr
        # ``self.backend.value == "cuda"``: the value of an axis
        if node.attr == "value":
            return _axis_of(node.value)
    if isinstance(node, ast.Name) and node.id in AXIS_NAMES:
        return node.id
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in AXIS_NAMES):
        return str(node.args[1].value)
    return None


def _tested_axes(test: ast.AST) -> list[str]:
    """Axes a branch's condition reads as a truth value: the test itself, ``not x``, ``a and x``."""
    if isinstance(test, ast.BoolOp):
        return [a for v in test.values for a in _tested_axes(v)]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _tested_axes(test.operand)
    axis = _axis_of(test)
    return [axis] if axis else []


def _is_dist_class(node: ast.AST) -> str | None:
    if isinstance(node, ast.Tuple):
        for e in node.elts:
            found = _is_dist_class(e)
            if found:
                return found
        return None
    chain = _chain(node)
    if chain and chain[-1].startswith(DIST_CLASSES):
        return chain[-1]
    return None


def _hits(rel: str, tree: ast.AST) -> list[tuple[str, int]]:
    """("kind:name", line) for every forbidden read in the module (see the module docstring)."""
    found: list[tuple[str, int]] = []
    exempt = {id(n) for d in ast.walk(tree) if isinstance(d, ast.FunctionDef)
              and d.name in DETECT_DEFINED_IN.get(rel, set()) for n in ast.walk(d)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_ATTRS and _chain(node)[:1] == ("os",):
            if rel not in ENV_ALLOWED:
                found.append((f"env:os.{node.attr}", node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in ENV_ATTRS for a in node.names):
            if rel not in ENV_ALLOWED:
                found.append(("env:from os import", node.lineno))
        if isinstance(node, ast.Call) and rel not in DETECT_ALLOWED and id(node) not in exempt:
            chain = _chain(node.func)
            for suffix in DETECT_CHAINS:
                if _ends_with(chain, suffix):
                    found.append((f"detect:{'.'.join(suffix)}", node.lineno))
            if _ends_with(chain, ("load_plan", "resolve")) and rel not in RESOLVE_ALLOWED:
                found.append(("detect:load_plan.resolve", node.lineno))
        if rel in AXIS_ALLOWED:
            continue
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                axis = _axis_of(operand)
                if axis:
                    found.append((f"compare:{axis}", node.lineno))
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            for axis in _tested_axes(node.test):
                found.append((f"branch:{axis}", node.lineno))
        if isinstance(node, ast.comprehension):
            for cond in node.ifs:
                for axis in _tested_axes(cond):
                    found.append((f"branch:{axis}", cond.lineno))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
                and len(node.args) == 2):
            cls = _is_dist_class(node.args[1])
            if cls:
                found.append((f"isinstance:{cls}", node.lineno))
    return found


def _scan() -> dict[str, list[tuple[str, int]]]:
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for sub in SCANNED:
        for path in sorted((ROOT / sub).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            out[rel].extend(_hits(rel, tree))
    return out


def test_no_variation_is_decided_below_the_plan():
    """No environment read, device detection or axis flag check outside the plan's files, but for
    the ``PENDING`` entries (files still being rewritten), each of which must still be there."""
    problems = []
    for rel, hits in sorted(_scan().items()):
        pending = PENDING.get(rel, set())
        for kind, line in hits:
            if kind not in pending:
                problems.append(f"ds4_mlx/{rel}:{line}: {kind}")
        stale = pending - {kind for kind, _ in hits}
        if stale:
            problems.append(f"ds4_mlx/{rel}: PENDING entries no longer found (delete them): {sorted(stale)}")
    stale_files = set(PENDING) - set(_scan())
    problems += [f"ds4_mlx/{rel}: PENDING for a file that does not exist" for rel in sorted(stale_files)]
    assert not problems, "decided below the load plan:\n" + "\n".join(problems)


# -- the scanner itself: each pattern caught, the allowed forms not ---------------------------------


def _kinds(src: str, rel: str = "model/x.py") -> list[str]:
    return [k for k, _ in _hits(rel, ast.parse(src))]


@pytest.mark.parametrize("src, kind", [
    ("import os\nx = os.environ.get('A')", "env:os.environ"),
    ("import os\nx = os.getenv('A')", "env:os.getenv"),
    ("import os\nx = 'A' in os.environ", "env:os.environ"),
    ("from os import environ", "env:from os import"),
    ("import mlx.core as mx\nd = mx.default_device()", "detect:default_device"),
    ("import mlx.core as mx\nok = mx.metal.is_available()", "detect:metal.is_available"),
    ("ok = mx.cuda.is_available()", "detect:cuda.is_available"),
    ("from ds4_mlx.model import metal_kernels\nd = metal_kernels.available_dialects()", "detect:available_dialects"),
    ("ok = metal_kernels.available()", "detect:metal_kernels.available"),
    ("b = load_plan.detect_backend()", "detect:detect_backend"),
    ("s = load_plan.resolve(experts='auto').experts", "detect:load_plan.resolve"),
    ("if self.backend.gpu:\n    pass", "branch:gpu"),
    ("y = a if w.backend is Backend.CPU else b", "compare:backend"),
    ("ok = self.backend.value == 'cuda'", "compare:backend"),
    ("if numerics is Numerics.DS4_CPU:\n    pass", "compare:numerics"),
    ("if ops.numerics == 'ds4-cpu':\n    pass", "compare:numerics"),
    ("if moe.routes_on_device and x:\n    pass", "branch:routes_on_device"),
    ("d = bool(getattr(inner, 'routes_on_device', False))\nif getattr(m, 'routes_on_device', 0):\n    pass",
     "branch:routes_on_device"),
    ("if model.expert_strategy == 'device':\n    pass", "compare:expert_strategy"),
    ("if strategy == 'device':\n    pass", "compare:strategy"),
    ("if distributed == 'experts':\n    pass", "compare:distributed"),
    ("while not self.compilable:\n    pass", "branch:compilable"),
    ("if isinstance(m, PipelineModel):\n    pass", "isinstance:PipelineModel"),
    ("ok = isinstance(m, (int, pipeline.DistributedModel))", "isinstance:DistributedModel"),
    ("ok = isinstance(m, ExpertParallelModel)", "isinstance:ExpertParallelModel"),
    ("xs = [w for w in ws if w.gpu]", "branch:gpu"),
])
def test_the_scanner_catches(src, kind):
    assert kind in _kinds(src)


@pytest.mark.parametrize("src", [
    '"""os.environ and mx.default_device() and if self.backend.gpu: named in a docstring"""',
    "# if numerics is Numerics.DS4_CPU: a comment\nx = 1",
    "w = DenseWeight(name, qtype, raw, n_in, backend=plan.backend)",  # passing the plan's value down
    "dialect = self.backend.value",
    "y = ops.linear(w, x)",
    "s = 'DS4_MLX_COMPILE'",
    "ok = isinstance(m, Model)",
    "if self.form == 'affine':\n    pass",  # a weight dispatching on its own form
    "env = environ_of(x)",
    "def available():\n    return bool(mx.metal.is_available())",  # only metal_kernels.py may
])
def test_the_scanner_leaves_alone(src):
    kinds = _kinds(src)
    if "def available" in src:
        assert kinds == ["detect:metal.is_available"]
        assert _kinds(src, "model/metal_kernels.py") == []
        assert _kinds(src + "\nd = metal_kernels.available()", "model/metal_kernels.py") == \
            ["detect:metal_kernels.available"]
    else:
        assert kinds == []


def test_the_plan_files_may_decide():
    src = "import os\nv = os.environ.get('A')\nb = mx.default_device()\nif numerics is Numerics.DEFAULT:\n    pass"
    assert _kinds(src, "model/load_plan.py") == []
    assert sorted(_kinds(src, "model/loader.py")) == ["detect:default_device", "env:os.environ"]
