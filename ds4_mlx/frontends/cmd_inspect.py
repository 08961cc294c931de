"""`ds4-mlx inspect PATH [--json]`: what a GGUF holds and whether ds4-mlx can run it.

Prints the metadata (long arrays such as the 129k-token vocabulary only summarized), the tensor
directory, per-type totals, the model config, the layout verdict, and the routed expert precision.
Exit status: 0 for a valid DS4 Flash file, 1 for a readable file that fails config or layout
validation (the report is still printed), 2 for an unreadable file (GGUFError, printed by cli.py).

``--plan`` prints the memory plan of loading the file instead (``model.memory_plan``: dense
weights per form, routed experts, expert cache, KV at ``--ctx`` per layer type, scratch, total
against this machine's memory or ``--simulate-memory GB``), for the ``--experts`` / ``--numerics``
given; exit status 0 when it fits, 1 when a load would be refused (the verdict says what would fit).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ds4_mlx.formats.config import DEFAULT_CTX
from ds4_mlx.frontends.args import CTX, EXPERT_STRATEGIES, SIMULATE_MEMORY, ExpertsCacheAction, UsageError
from ds4_mlx.frontends.terminal_text import escape_text, human_size

if TYPE_CHECKING:  # the readers (numpy) load in run(): `ds4-mlx --help` builds every command's parser
    from ds4_mlx.formats.gguf import GGUFFile, MetadataField
    from ds4_mlx.formats.layout import LayoutReport

ARRAY_HEAD = 8  # array items shown before eliding
ARRAY_FULL = 16  # arrays up to this length are shown whole
TEXT_STRING_MAX = 120  # longest string shown in text mode
TEXT_NAME_MAX = 160  # longest key or tensor name shown in text mode (longer ones are cut, with a marker)
# Columns are padded to the longest key or name up to this width only: padding every line to one
# hostile 200 KB key made the report of a 480 KB file 2 GB long. Text output stays linear in the file.
KEY_COLUMN_MAX = 48


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="show a GGUF's metadata, tensors, config and layout verdict",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="GGUF file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--no-tensors", action="store_true", help="text mode: omit the per-tensor table")
    plan = p.add_argument_group("memory plan")
    plan.add_argument("--plan", action="store_true",
                      help="print the memory plan of loading the file (weights, expert cache, KV at --ctx, "
                           "scratch vs this machine) instead of the report")
    plan.add_argument("--ctx", action=CTX, default=None, metavar="N",
                      help=f"--plan: the sessions' context (default {DEFAULT_CTX}, capped at the model's)")
    plan.add_argument("--numerics", choices=["default", "ds4-cpu"], default="default", help="--plan: the arithmetic")
    plan.add_argument("--experts", choices=EXPERT_STRATEGIES, default="auto",
                      help="--plan: the routed-expert strategy (auto: device on a GPU, host on the CPU)")
    plan.add_argument("--experts-cache", action=ExpertsCacheAction, default=None, metavar="N|SIZE",
                      help="--plan, --experts device: the bounded expert cache (as the model commands' option; "
                           "default: every expert when they fit, else the largest cache that fits)")
    plan.add_argument("--simulate-memory", action=SIMULATE_MEMORY, default=None, metavar="GB",
                      help="--plan: for a machine of GB GiB instead of this one")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ds4_mlx.formats.gguf import GGUFFile

    if args.plan:
        return run_plan(args)
    for flag, given in (("--ctx", args.ctx is not None), ("--simulate-memory", args.simulate_memory is not None),
                        ("--numerics", args.numerics != "default"), ("--experts", args.experts != "auto"),
                        ("--experts-cache", args.experts_cache is not None)):
        if given:
            raise UsageError(f"{flag} only applies with --plan")
    with GGUFFile(args.path) as f:
        info = inspect_file(f)
    if args.json:
        # ASCII-only: control characters and bidi overrides in keys or strings reach the terminal
        # as \u escapes, never raw; json.loads gives back the same text.
        json.dump(info, sys.stdout, ensure_ascii=True, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(info, show_tensors=not args.no_tensors))
    return 0 if info["verdict"] == "OK" else 1


def run_plan(args: argparse.Namespace) -> int:
    """``inspect --plan``: the memory plan as a table (or ``--json``: its ``to_dict``)."""
    from ds4_mlx.formats.layout import load_model_file
    from ds4_mlx.model import load_plan
    from ds4_mlx.model.loader import plan_load

    lp = load_plan.resolve(args.numerics, None, args.experts)  # what ``ds4_mlx.load`` would resolve here
    if args.experts_cache is not None and lp.experts != "device":
        raise UsageError(f"--experts-cache bounds the device strategy's resident experts; the strategy here is "
                         f"{lp.experts} (--experts {args.experts}): pass --experts device")
    f, cfg, _ = load_model_file(args.path)
    try:
        plan, _ = plan_load(f, cfg, lp, experts_cache=args.experts_cache, ctx=args.ctx,
                            simulate_memory=args.simulate_memory)
    finally:
        f.close()
    if args.json:
        json.dump({**plan.to_dict(), "load_plan": lp.describe()}, sys.stdout, ensure_ascii=True, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(lp.describe() + "\n" + format_plan(plan))
    return 1 if plan.fits is False else 0


def format_plan(plan) -> str:
    """The plan's table: one row per part (what, bytes, detail), the total and the verdict."""
    from ds4_mlx.model.memory_plan import size_text

    w = plan.weights
    rows = plan.rows()
    width = max(len(r.label) for r in rows)
    out = [f"memory plan: {_clean(plan.name)}, {w.strategy} experts, {w.numerics} numerics, {w.backend} backend, "
           f"ctx {plan.ctx}"]
    for r in rows:
        out.append(f"  {r.label:<{width}}  {size_text(r.nbytes):>10}  {r.detail}")
    out.append(f"  {'total':<{width}}  {size_text(plan.total):>10}")
    limit = plan.machine.limit
    out.append(f"  {'available':<{width}}  {size_text(limit) if limit is not None else '?':>10}  {plan.machine.source}")
    out.append(f"verdict: {plan.verdict()}")
    return "\n".join(out) + "\n"


# -- collection ---------------------------------------------------------------------------------


def inspect_file(f: GGUFFile) -> dict[str, Any]:
    """Everything ``inspect`` reports, as a JSON-ready dict with stable keys."""
    from ds4_mlx.errors import LayoutError
    from ds4_mlx.formats.config import ModelConfig
    from ds4_mlx.formats.layout import routed_quant_bits, validate_layout

    tensors = []
    totals: dict[str, dict[str, int]] = {}
    n_params = 0
    for t in f.tensors.values():
        tensors.append({"name": t.name, "type": t.ggml_type.name, "ne": list(t.ne), "shape": list(t.shape),
                        "nbytes": t.nbytes, "offset": t.offset})
        tot = totals.setdefault(t.ggml_type.name, {"count": 0, "nbytes": 0})
        tot["count"] += 1
        tot["nbytes"] += t.nbytes
        n_params += t.n_elements

    config = None
    layout: LayoutReport | None = None
    error = None
    checkpoint = None
    drafter = _drafter(f)
    if drafter is not None:
        error = drafter.pop("error")
    else:
        try:
            checkpoint = _checkpoint(f)
            cfg = ModelConfig.from_gguf(f)
            config = cfg.to_dict()
            layout = validate_layout(f, cfg)
        except LayoutError as exc:
            error = str(exc)

    return {
        "path": f.path,
        "file_size": f.file_size,
        "gguf_version": f.version,
        "alignment": f.alignment,
        "data_offset": f.data_offset,
        "n_kv": len(f.fields),
        "n_tensors": len(f.tensors),
        "metadata": {k: _field_summary(fl) for k, fl in f.fields.items()},
        "tensors": tensors,
        "type_totals": dict(sorted(totals.items(), key=lambda kv: -kv[1]["nbytes"])),
        "tensor_bytes": f.tensor_bytes,
        "n_params": n_params,
        "config": config,
        "checkpoint": checkpoint,
        "drafter": drafter,
        "verdict": "OK" if error is None else "INVALID",
        "error": error,
        "routed_quant_bits": layout.routed_quant_bits if layout else routed_quant_bits(f),
        "layout": layout.to_dict() if layout else None,
        "blas": blas_status(),
        "native_experts": native_status(),
    }


def _drafter(f: GGUFFile) -> dict[str, Any] | None:
    """For a speculative-decoding drafter file (``mtp.*`` tensors and no model tensors): its kind,
    the checkpoint it belongs to and its layout checked against the dims its own tensors imply (a
    load checks them against the target's); None for any other file."""
    from ds4_mlx.errors import LayoutError
    from ds4_mlx.formats.drafter_layout import DrafterKind, drafter_kind, validate_drafter_file

    names = f.tensors
    if not any(n.startswith("mtp.") for n in names) or "token_embd.weight" in names or \
            any(n.startswith("blk.") for n in names):
        return None
    out: dict[str, Any] = {"kind": None, "title": None, "belongs_to": None, "dims": None, "n_checked": 0,
                           "error": None}
    try:
        kind = drafter_kind(f)
        out.update(kind=kind.value, title=kind.title,
                   belongs_to="preview" if kind is DrafterKind.MTP else "0731")
        cfg, out["n_checked"] = validate_drafter_file(f, kind)
        out["dims"] = {k: getattr(cfg, k) for k in ("n_embd", "n_hc", "n_head", "head_dim", "q_lora_rank",
                                                    "n_expert", "n_ff_exp", "n_vocab")}
    except LayoutError as exc:
        out["error"] = str(exc)
    return out


def _checkpoint(f: GGUFFile) -> dict[str, Any]:
    """Which checkpoint the file holds and the thinking levels it gets (LayoutError for a variant
    ds4-mlx cannot run)."""
    from ds4_mlx.chat.effort import RULES
    from ds4_mlx.formats.checkpoint import detect_checkpoint

    info = detect_checkpoint(f.metadata, f.path)
    rules = RULES[info.checkpoint]
    return {"name": info.checkpoint.value, "title": info.checkpoint.title, "decided_by": info.source,
            "thinking_levels": [m.value for m in rules.levels], "thinking_default": rules.default.value}


def _field_summary(fl: MetadataField) -> dict[str, Any]:
    from ds4_mlx.formats.gguf import ValueType

    if fl.type != ValueType.ARRAY:
        return {"type": fl.type.name, "value": _json_scalar(fl.value)}
    return {"type": "ARRAY", "element_type": fl.sub_type.name, **_array_summary(fl.value)}


def _array_summary(values: list) -> dict[str, Any]:
    shown = values if len(values) <= ARRAY_FULL else values[:ARRAY_HEAD]
    # a nested array is a list, or (when long) a StringArray / NumericArray read in place
    head = [_array_summary(v) if isinstance(v, Sequence) and not isinstance(v, str) else _json_scalar(v)
            for v in shown]
    return {"count": len(values), "head": head, "truncated": len(shown) < len(values)}


def _json_scalar(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # JSON has no NaN/inf
    return v


def native_status() -> Any:
    """``ds4_mlx.native.status(probe=True)``: whether the host expert path runs native code, and why not."""
    try:
        from ds4_mlx import native

        return native.status(probe=True)
    except Exception as exc:  # a diagnostic must not take inspect down
        return {"error": f"ds4_mlx.native.status() failed: {type(exc).__name__}: {exc}"}


def blas_status() -> Any:
    """``ds4_mlx.blas.status()`` when that module exists; None when it does not."""
    try:
        blas = importlib.import_module("ds4_mlx.blas")
    except ModuleNotFoundError as exc:
        if exc.name == "ds4_mlx.blas":
            return None
        return {"error": f"cannot import ds4_mlx.blas: {exc}"}
    except ImportError as exc:
        return {"error": f"cannot import ds4_mlx.blas: {exc}"}
    status = getattr(blas, "status", None)
    if status is None:
        return None
    try:
        value = status()
    except Exception as exc:  # a diagnostic must not take inspect down
        return {"error": f"ds4_mlx.blas.status() failed: {type(exc).__name__}: {exc}"}
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)


# -- text ---------------------------------------------------------------------------------------


def _clean(text: str) -> str:
    """A free-text line (an error, a warning) with its unprintable characters escaped; backslashes
    are kept (the messages already quote names with repr)."""
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def _marked(shown: str, full_length: int, limit: int) -> str:
    return shown + (f"... ({full_length} chars)" if full_length > limit else "")


def _name(text: str) -> str:
    """A key or tensor name for the text report: its first TEXT_NAME_MAX characters, escaped, and a
    marker with the full length when it is longer."""
    return _marked(escape_text(text[:TEXT_NAME_MAX]), len(text), TEXT_NAME_MAX)


def _text_value(summary: dict[str, Any]) -> str:
    if summary["type"] != "ARRAY":
        v = summary["value"]
        if isinstance(v, str):  # repr escapes unprintables; only the part shown is escaped
            return _marked(repr(v[:TEXT_STRING_MAX]), len(v), TEXT_STRING_MAX)
        return repr(v)
    return _text_array(summary)


def _text_array(a: dict[str, Any]) -> str:
    items = [_text_array(x) if isinstance(x, dict) else _short(x) for x in a["head"]]
    more = f", ... ({a['count'] - len(a['head'])} more)" if a["truncated"] else ""
    return f"[{', '.join(items)}{more}]"


def _short(v: Any) -> str:
    s = repr(v[:41] if isinstance(v, str) else v)
    return s if len(s) <= 40 else s[:40] + "..."


def format_text(info: dict[str, Any], show_tensors: bool = True) -> str:
    out: list[str] = []
    w = out.append
    w(f"file: {_clean(info['path'])} ({info['file_size']:,} bytes, {human_size(info['file_size'])})")
    w(f"gguf: v{info['gguf_version']}, {info['n_kv']} metadata keys, {info['n_tensors']} tensors, "
      f"alignment {info['alignment']}, tensor data at byte {info['data_offset']:,}")
    w("")
    w("metadata:")
    keys = {key: _name(key) for key in info["metadata"]}
    width = min(max((len(k) for k in keys.values()), default=0), KEY_COLUMN_MAX)
    for key, s in info["metadata"].items():
        kind = s["type"] if s["type"] != "ARRAY" else f"{s['element_type']}[{s['count']}]"
        w(f"  {keys[key]:<{width}}  {kind:<14} {_text_value(s)}")
    if show_tensors:
        w("")
        w("tensors:")
        names = [_name(t["name"]) for t in info["tensors"]]
        nw = min(max((len(n) for n in names), default=4), KEY_COLUMN_MAX)
        w(f"  {'name':<{nw}}  {'type':<8} {'ne (GGUF dims)':<24} {'bytes':>14}")
        for name, t in zip(names, info["tensors"]):
            w(f"  {name:<{nw}}  {t['type']:<8} {str(t['ne']):<24} {t['nbytes']:>14,}")
    w("")
    w("tensor types:")
    for name, tot in info["type_totals"].items():
        w(f"  {name:<8} {tot['count']:>5} tensors  {human_size(tot['nbytes']):>12}")
    w(f"  total    {info['n_tensors']:>5} tensors  {human_size(info['tensor_bytes']):>12}  "
      f"({info['n_params'] / 1e9:.3f} B parameters)")
    if info["config"] is not None:
        w("")
        w("config:")
        w("  " + ", ".join(f"{k}={_name(v) if isinstance(v, str) else v}" for k, v in info["config"].items()))
    w("")
    ck = info.get("checkpoint")
    if ck is not None:
        w(f"checkpoint: {ck['title']} ({_clean(ck['decided_by'])}); thinking levels "
          f"{', '.join(ck['thinking_levels'])}, default {ck['thinking_default']}")
    dr = info.get("drafter")
    if dr is not None:
        if dr["kind"] is not None:
            dims = ", ".join(f"{k}={v}" for k, v in (dr["dims"] or {}).items())
            w(f"drafter: {dr['title']} (for a {'Flash 0731' if dr['belongs_to'] == '0731' else 'preview'} "
              f"target{'; ' + dims if dims else ''})")
        if info["verdict"] == "OK":
            w(f"layout: OK ({dr['n_checked']} tensors checked against the file's own dims; loading it "
              f"checks them against the target's)")
        else:
            w(f"layout: INVALID: {_clean(info['error'])}")
    elif info["verdict"] == "OK":
        lay = info["layout"]
        rt = lay["routed_types"]
        w(f"layout: OK ({lay['n_checked']} tensors checked)")
        if len({tuple(t) for t in lay["routed_by_layer"]}) == 1 and rt["gate"] != "MXFP4":
            w(f"routed experts: {info['routed_quant_bits']}-bit (gate/up {rt['gate']}, down {rt['down']})")
        else:  # a mix, or MXFP4: ds4's "bits" (a KV-cache label from layer 0) would misdescribe them
            w(f"routed experts: {lay['routed_mix']} (KV-cache quant bits {info['routed_quant_bits']}, "
              f"from layer 0 as ds4)")
        for line in lay["warnings"]:
            w(f"warning: {_clean(line)}")
    else:
        w(f"layout: INVALID: {_clean(info['error'])}")
        if info["routed_quant_bits"]:
            w(f"routed experts: {info['routed_quant_bits']}-bit (from blk.0.ffn_gate_exps)")
    blas = info["blas"]
    w(f"blas: {json.dumps(blas, ensure_ascii=False) if blas is not None else 'not available (ds4_mlx.blas missing)'}")
    w(f"native experts: {json.dumps(info['native_experts'], ensure_ascii=False)}")
    return "\n".join(out) + "\n"
