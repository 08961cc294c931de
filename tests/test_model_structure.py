"""Structure of the forward pass (issue 13): the numerics mode is bound once (``model/ops.py``) and the
architecture code never branches on it nor takes it as a parameter; no import cycle hides behind a
function-level import; ``ModelConfig.coff`` is the only place that derives the compressor width; one
forward path: every module has one ``__call__`` over per-layer cache objects for chunks and decode
steps, and the compiled decode step compiles ``Block``'s own methods instead of re-assembling one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ds4_mlx"

# The architecture: written once against an ``Ops`` object. The weights offer both arithmetics as
# methods (``w(x)`` / ``w.ds4_cpu(x)``) and the ``Ops`` object picks one, so they take no mode either.
ARCHITECTURE = ["attention.py", "compressor.py", "indexer.py", "hyper_connection.py", "moe.py", "transformer.py",
                "compiled_decode.py", "cache.py", "rope.py", "numerics.py",
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


# What only a layer's own code touches: reaching any of it from compiled_decode.py means a block is
# being assembled there by hand again.
BLOCK_INTERNALS = {"hc_attn", "hc_ffn", "pre", "post", "attn_norm", "ffn_norm", "rms_norm", "router_scores",
                   "shared_expert", "combine", "compressor", "index_compressor", "indexer", "sink_softmax",
                   "_project", "_output", "_attend", "_attend_step", "update_raw", "windows", "commit"}


def test_compiled_decode_compiles_block_methods_not_a_copy():
    tree = _tree("model/compiled_decode.py")
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not used & BLOCK_INTERNALS, f"compiled_decode.py reaches into a layer: {sorted(used & BLOCK_INTERNALS)}"
    assert {"attention_part", "ffn_pre", "ffn_post"} <= used
    # a MoE routing on the device compiles the whole layer: Block.__call__ itself
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "block" in calls


def test_block_call_is_its_parts():
    """``Block.__call__`` is ``attention_part`` then ``ffn_part`` (what the compiled step wraps)."""
    block = next(n for n in ast.walk(_tree("model/transformer.py"))
                 if isinstance(n, ast.ClassDef) and n.name == "Block")
    call = next(n for n in block.body if isinstance(n, ast.FunctionDef) and n.name == "__call__")
    used = {n.attr for n in ast.walk(call) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert used == {"attention_part", "ffn_part"}, used


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

