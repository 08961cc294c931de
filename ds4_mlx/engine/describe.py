"""Notebook descriptions of the model object and sessions (``_repr_html_``): small HTML tables.

Jupyter shows ``_repr_html_`` instead of ``__repr__`` when an object is the value of a cell; these
tables say what a user checks first (which file, what shape, how much context, how much memory).
Every value is escaped: paths and model names come from the user or the GGUF and may hold markup.
"""

from __future__ import annotations

import html
import os

_STYLE = "border-collapse:collapse;font-family:monospace;font-size:0.9em"
_CELL = "padding:1px 8px;text-align:left;border-bottom:1px solid #ddd"


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def file_size(path) -> int | None:
    """Bytes of the file at ``path``; None when it cannot be read (moved or deleted after load)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return mib(n)


def html_table(title: str, rows: list[tuple[str, object]]) -> str:
    """``<table>`` with a bold caption and one (name, value) row each; all text escaped."""
    body = "".join(f"<tr><th style='{_CELL}'>{html.escape(str(k))}</th>"
                   f"<td style='{_CELL}'>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return (f"<table style='{_STYLE}'><caption style='text-align:left;font-weight:bold'>"
            f"{html.escape(title)}</caption>{body}</table>")


def engine_rows(engine) -> list[tuple[str, object]]:
    cfg = engine.config
    return [
        ("file", str(engine.path)),
        ("size", human_bytes(file_size(engine.path))),
        ("name", cfg.name or "-"),
        ("checkpoint", str(engine.checkpoint_info)),
        ("thinking", f"{', '.join(m.value for m in engine.effort_rules.levels)} "
                     f"(default {engine.effort_rules.default.value})"),
        ("layers", cfg.n_layer),
        ("embedding", cfg.n_embd),
        ("heads", f"{cfg.n_head} (head dim {cfg.head_dim})"),
        ("experts", f"{cfg.n_expert} routed, {cfg.n_expert_used} used, {cfg.n_expert_shared} shared, "
                    f"{engine.quant_bits}-bit"),
        ("vocabulary", cfg.n_vocab),
        ("context", f"{cfg.context_length} max, {engine.default_ctx()} default"),
        ("numerics", engine.numerics),
        ("memory plan", engine.memory_plan.verdict() if engine.memory_plan is not None else "not planned"),
        ("load plan", engine.load_plan.describe().removeprefix("load plan: ") if engine.load_plan else "none"),
        ("load time", f"{engine.load_time:.2f} s"),
    ]


def session_rows(session) -> list[tuple[str, object]]:
    n, ctx = session.n_tokens, session.ctx
    return [
        ("model", f"{session.config.name or 'DS4'} ({session.config.n_layer} layers)"),
        ("tokens held", f"{n} of {ctx} ({100 * n / ctx:.1f}%)"),
        ("context", ctx),
        ("prefill chunk", session.chunk),
        ("memory", mib(session.memory_bytes())),
        ("checkpoints", ", ".join(map(str, session.checkpoints())) or "none"),
    ]
