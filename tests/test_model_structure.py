"""Structure of the forward pass (issue 13): the numerics mode is bound once (``model/ops.py``) and the
architecture code never branches on it nor takes it as a parameter; no import cycle hides behind a
function-level import; ``ModelConfig.coff`` is the only place that derives the compressor width; one
forward path: every module has one ``__call__`` over per-layer cache objects for chunks and decode
steps, ``Block.__call__`` is the only way through a layer and only host_step.py takes a block apart
(issue 23)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ds4_mlx"

# The architecture: written once against an ``Ops`` object. The weights offer both arithmetics as
# methods (``w(x)`` / ``w.ds4_cpu(x)``) and the ``Ops`` object picks one, so they take no mode either.
ARCHITECTURE = ["attention.py", "compressor.py", "indexer.py", "hyper_connection.py", "moe.py", "transformer.py",
                "compiled_decode.py", "host_step.py", "cache.py", "rope.py", "numerics.py",
                "linear.py", "experts.py"]


def _tree(rel: str) -> ast.Module:
    return ast.parse((ROOT / rel).read_text(), filename=rel)


@pytest.mark.parametrize("name", ARCHITECTURE)
def test_architecture_has_no_numerics_branches_or_parameters(name):
    tree = _tree(f"model/{name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Numerics":
            pytest.fail(f"model/{name}:{node.lineno}: Numerics.{node.attr} (a numerics branch belongs in ops.py)")
        if isinstance(node, (ast.FunctionDef, ast.Lambda)):
            args = node.args
            names = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
            where = getattr(node, "name", "lambda")
            assert "numerics" not in names, f"model/{name}:{node.lineno}: {where}() takes a numerics parameter"


def test_ops_holds_both_modes():
    from ds4_mlx.model.ops import DS4_CPU_OPS, DEFAULT_OPS, Numerics, ops_for

    assert ops_for("default") is DEFAULT_OPS and ops_for(Numerics.DS4_CPU) is DS4_CPU_OPS
    assert DEFAULT_OPS.compilable and not DS4_CPU_OPS.compilable
    with pytest.raises(ValueError):
        ops_for("fast-math")


def _function_level_imports(rel: str) -> list[str]:
    out = []
    for node in ast.walk(_tree(rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("ds4_mlx"):
                    out.append(f"{rel}:{sub.lineno}: from {sub.module} import … inside {node.name}()")
    return out


def test_no_function_level_imports_in_model_and_quants():
    files = [f"model/{p.name}" for p in sorted((ROOT / "model").glob("*.py"))]
    files += ["formats/quants.py", "formats/quants_mlx.py"]
    found = [hit for rel in files for hit in _function_level_imports(rel)]
    assert not found, "imports that hide a cycle:\n" + "\n".join(found)


def _imports(rel: str) -> set[str]:
    mods = set()
    for node in ast.walk(_tree(rel)):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return mods


def test_import_direction():
    """quants (numpy) <- quants_mlx; linear <- experts; ops imports neither weights module."""
    assert not any("quants_mlx" in m for m in _imports("formats/quants.py"))
    assert not any(m.startswith("ds4_mlx.model.experts") for m in _imports("model/linear.py"))
    ops = _imports("model/ops.py")
    assert not any(m.startswith(("ds4_mlx.model.linear", "ds4_mlx.model.experts")) for m in ops)


def test_coff_is_derived_in_one_place():
    for p in sorted((ROOT / "model").glob("*.py")) + [ROOT / "engine" / "payload.py"]:
        text = p.read_text()
        assert "== 4 else 1" not in text, f"{p.name} re-derives coff; use ModelConfig.coff(il)"


def test_state_layout_is_described_once():
    """The payload walks the model's ``state_layout`` instead of restating the shapes per lane."""
    from ds4_mlx.engine import payload
    from ds4_mlx.model import cache

    fn = next(n for n in ast.walk(_tree("engine/payload.py"))
              if isinstance(n, ast.FunctionDef) and n.name == "expected_arrays")
    used = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    assert not used & {"compress_ratio", "head_dim", "indexer_head_dim", "n_swa"}, used
    assert payload.ArraySpec is cache.StateArray


# -- one forward path ----------------------------------------------------------------------------------


def test_one_call_per_module_no_decode_step():
    """Chunks and decode steps run the same ``__call__``: no second entry point per module, and the
    state has one representation (``model/cache.py``), not a chunk state plus a decode cache."""
    assert not (ROOT / "model" / "state.py").exists() and not (ROOT / "model" / "decode_cache.py").exists()
    for p in sorted((ROOT / "model").glob("*.py")):
        for node in ast.walk(_tree(f"model/{p.name}")):
            if isinstance(node, ast.FunctionDef):
                assert not node.name.endswith("decode_step"), f"model/{p.name}:{node.lineno}: {node.name}()"
            if isinstance(node, ast.ClassDef):
                assert node.name not in ("ModelState", "LayerState", "CompressorState", "DecodeCache"), \
                    f"model/{p.name}:{node.lineno}: class {node.name} (the state lives in cache.py)"


# -- Block.__call__ is the only forward through a layer ---------------------------------------------


def _block_class() -> ast.ClassDef:
    return next(n for n in ast.walk(_tree("model/transformer.py")) if isinstance(n, ast.ClassDef) and n.name == "Block")


def test_block_has_one_forward():
    """A layer has one way through it: ``Block.__call__`` (prefill chunks, decode steps, every
    distributed mode). Before issue 23 it also had attention_part / ffn_part / attention_mix /
    attention_comb / ffn_comb / ffn_pre / ffn_post, fragments a decode step re-assembled."""
    methods = {n.name for n in _block_class().body if isinstance(n, ast.FunctionDef)}
    assert methods == {"__init__", "__call__"}, sorted(methods)


# The pieces of a layer's forward: calling one of them on a block's sub-module (``x.hc_attn.pre(…)``,
# ``x.ffn.router_scores(…)``, ``x.attn(…)``…) is taking a block apart. Only the block itself and
# host_step.py (the host breaks of a host-routed decode step, deletable as a whole) may.
LAYER_PARTS = {"hc_attn", "hc_ffn", "attn", "ffn"}
PART_STEPS = {"pre", "post", "mix", "reduce", "comb", "gains", "router_scores", "shared_expert", "combine",
              "routed_experts", "route", "route_weights", "select"}
TAKES_BLOCKS_APART = {"model/transformer.py", "model/host_step.py"}
# dspark.py computes each stage's context KV rows from the stage's attention mixer and kv projection
# (``DSparkHead.context_kv``: the drafter's own kv path, not a pass through a layer); its stages run
# as ``Block``s.
ALLOWED = {("model/dspark.py", "hc_attn.mix"), ("model/dspark.py", "hc_attn.reduce")}


def _part_calls(rel: str) -> list[str]:
    out = []
    for node in ast.walk(_tree(rel)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        # x.attn(...) / x.ffn(...): a sub-module's forward
        if isinstance(f, ast.Attribute) and f.attr in LAYER_PARTS:
            out.append((node.lineno, f.attr))
        # x.hc_attn.pre(...) etc.
        if isinstance(f, ast.Attribute) and f.attr in PART_STEPS and isinstance(f.value, ast.Attribute) \
                and f.value.attr in LAYER_PARTS:
            out.append((node.lineno, f"{f.value.attr}.{f.attr}"))
    return [f"{rel}:{line}: {what}(…)" for line, what in out if (rel, what) not in ALLOWED]


def test_only_the_block_and_host_step_take_a_block_apart():
    files = [f"{p.parent.name}/{p.name}" for d in ("model", "engine") for p in sorted((ROOT / d).glob("*.py"))]
    found = [hit for rel in files if rel not in TAKES_BLOCKS_APART for hit in _part_calls(rel)]
    assert not found, "a layer taken apart outside Block.__call__ / host_step.py:\n" + "\n".join(found)
    # and the rule sees what it looks for: host_step.py does take blocks apart
    assert _part_calls("model/host_step.py")


def test_compiled_decode_compiles_the_block_itself():
    """Each compiled layer function of ``CompiledDecoder`` is the block's ``__call__``; nothing of the
    host breaks (host reads, the host Sinkhorn, the native library) is in compiled_decode.py."""
    tree = _tree("model/compiled_decode.py")
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "block" in calls
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"to_host", "native", "async_eval", "HostMixer", "sinkhorn_numpy"}, names & {"to_host", "native"}


def test_the_host_machinery_is_one_file():
    """The host Sinkhorn, the host routing and the cut decode step live in host_step.py alone."""
    for p in sorted((ROOT / "model").glob("*.py")):
        if p.name == "host_step.py":
            continue
        tree = _tree(f"model/{p.name}")
        defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defs & {"sinkhorn_numpy", "comb_on_host", "HostMixer", "HostRouting", "HostStepDecoder"}, \
            f"model/{p.name} defines host-step machinery: {defs}"
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        assert "hc_sinkhorn" not in calls, f"model/{p.name} balances a mixer on the host"


def test_distributed_modes_wrap_the_model():
    """A distributed mode is a wrapper around the rank's ``Model`` (composition: a stage runs the same
    blocks through the model's own forward), not a subclass overriding its forward through hooks
    (before issue 23: ``DistributedModel(Model)`` overriding ``forward_chunk``/``_chunk_logits``/``step``)."""
    subclasses = []
    for p in sorted((ROOT / "model").glob("*.py")):
        for node in ast.walk(_tree(f"model/{p.name}")):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if "Model" in bases:
                    subclasses.append(f"model/{p.name}: class {node.name}(Model)")
    assert not subclasses, subclasses
    from ds4_mlx.model.distributed import DistributedModel
    from ds4_mlx.model.expert_parallel import ExpertParallelModel
    from ds4_mlx.model.pipeline import PipelineModel
    from ds4_mlx.model.transformer import Model

    for cls in (DistributedModel, PipelineModel, ExpertParallelModel):
        assert not issubclass(cls, Model), cls
        # and the stage's forward is the wrapped model's: it never runs blocks of its own
        src = ast.unparse(next(n for n in ast.walk(_tree(f"model/{cls.__module__.rsplit('.', 1)[1]}.py"))
                               if isinstance(n, ast.ClassDef) and n.name == cls.__name__))
        assert "for block in" not in src and "block(" not in src, cls


# -- one session layer (issue 23) ----------------------------------------------------------------------

# The session and the files split off it: the only engine code that runs the network over a history.
SESSION_FILES = {"session.py"}
FORWARD_CALLS = {"forward_chunk", "_forward_chunk", "forward_verify", "step", "decoder"}


def test_one_session_layer():
    """Bringing a state to a token history is one layer: ``engine/session.py``'s ``Session`` (its one
    chunk loop and prefill-or-decode choice). No model-level runner sits under it (``model/runner.py``,
    a ``Model.new_session`` factory), and no other engine or frontend module calls the network's
    forward itself (a second chunk loop)."""
    assert not (ROOT / "model" / "runner.py").exists()
    for p in sorted((ROOT / "model").glob("*.py")):
        for node in ast.walk(_tree(f"model/{p.name}")):
            if isinstance(node, ast.FunctionDef):
                assert node.name != "new_session", f"model/{p.name}:{node.lineno}: the network is not a session factory"
    files = [f"engine/{p.name}" for p in sorted((ROOT / "engine").glob("*.py")) if p.name not in SESSION_FILES]
    files += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "frontends").rglob("*.py"))]
    for rel in files:
        for node in ast.walk(_tree(rel)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in FORWARD_CALLS):
                pytest.fail(f"{rel}:{node.lineno}: .{node.func.attr}() runs the network outside the session")

