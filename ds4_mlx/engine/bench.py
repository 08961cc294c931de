"""The context-frontier throughput sweep of ds4's ``ds4-bench``, as a library (no printing).

One fixed token sequence is walked to context frontiers ``start, start + step, ..., max`` (the last
frontier is always ``max``). At each frontier the session computes only the newest interval (the
tokens between the previous frontier and this one: the *prefill* window), snapshots itself, greedily
generates ``gen_tokens`` tokens with EOS excluded so every row decodes the same count (the
*generation* window), restores the snapshot and moves on. Snapshot and restore stay outside both
timing windows, as in ds4. Numbers are therefore "instantaneous": the cost of prefilling 2048 more
tokens, or of decoding one more, *at* that context size.

Row fields (and CSV columns) follow ds4-bench's CSV so files compare across machines, with two
memory columns added:

* ``kvcache_bytes``: bytes of the snapshot taken at the frontier (``Snapshot.nbytes()``: the model
  state, i.e. raw windows, frontiers and compressed rows, plus the logits). ds4 reports its
  serialized snapshot length; ours omits the payload's small header and token list.
* ``rss_peak_bytes``: the process's resident-set high-water mark so far (``getrusage`` ru_maxrss,
  converted to bytes: Linux reports KiB, macOS bytes). It never decreases, and it counts the mapped
  GGUF pages the run touched.
* ``mlx_peak_bytes``: MLX's allocator peak during this row only (``mx.get_peak_memory()``, reset at
  the start of each row): the arrays the model computed with, without the mapped weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ds4_mlx.engine.generate import peak_rss_bytes
from ds4_mlx.engine.sampling import argmax
from ds4_mlx.errors import Ds4Error

# ds4-bench's CSV header, then our two memory columns.
CSV_COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes",
               "rss_peak_bytes", "mlx_peak_bytes")


class BenchError(Ds4Error):
    """Sweep parameters that cannot be run: bad frontiers, too few tokens, a context beyond the model's."""


@dataclass(frozen=True)
class BenchRow:
    ctx_tokens: int        # the frontier: tokens in the context when generation starts
    prefill_tokens: int    # tokens computed in the prefill window (frontier - previous frontier)
    prefill_tps: float     # prefill_tokens / prefill seconds
    gen_tokens: int
    gen_tps: float         # gen_tokens / generation seconds (0 when gen_tokens is 0)
    kvcache_bytes: int
    rss_peak_bytes: int
    mlx_peak_bytes: int
    prefill_s: float = 0.0
    gen_s: float = 0.0
    generated: tuple[int, ...] = field(default=(), repr=False)  # the greedy tokens, EOS excluded

    def csv_values(self) -> list[str]:
        """The row as ds4-bench prints it: rates with two decimals, integers as they are."""
        return [str(self.ctx_tokens), str(self.prefill_tokens), f"{self.prefill_tps:.2f}", str(self.gen_tokens),
                f"{self.gen_tps:.2f}", str(self.kvcache_bytes), str(self.rss_peak_bytes), str(self.mlx_peak_bytes)]


def frontiers(start: int, step: int, maximum: int) -> list[int]:
    """``start, start + step, ...`` below ``maximum``, then ``maximum`` itself (ds4's linear steps)."""
    check_sweep(start, step, maximum, 0)
    out = list(range(start, maximum, step))
    out.append(maximum)
    return out


def check_sweep(ctx_start: int, ctx_step: int, ctx_max: int, gen_tokens: int,
                context_length: int | None = None) -> None:
    """Raise ``BenchError`` naming the first parameter that cannot be swept."""
    for name, value in (("ctx_start", ctx_start), ("ctx_step", ctx_step), ("ctx_max", ctx_max),
                        ("gen_tokens", gen_tokens)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise BenchError(f"{name} must be an integer, got {value!r}")
    if ctx_start < 1:
        raise BenchError(f"ctx_start must be >= 1, got {ctx_start}")
    if ctx_step < 1:
        raise BenchError(f"ctx_step must be >= 1, got {ctx_step}")
    if ctx_max < ctx_start:
        raise BenchError(f"ctx_max ({ctx_max}) must be >= ctx_start ({ctx_start})")
    if gen_tokens < 0:
        raise BenchError(f"gen_tokens must be >= 0, got {gen_tokens}")
    if context_length is not None and ctx_max + gen_tokens > context_length:
        raise BenchError(f"ctx_max + gen_tokens = {ctx_max + gen_tokens} exceeds the model's context of "
                         f"{context_length} tokens")


def backend_name(engine) -> str:
    """What the loaded ``engine`` computes on, for labels: e.g. "mlx gpu (metal)" or "mlx cpu", from
    its load plan (``LoadPlan.device_text``), the one place the machine was read."""
    return engine.load_plan.device_text()


def _greedy_no_eos(session, eos_id: int | None) -> int:
    """ds4-bench's ``argmax_excluding(eos)``: the best token, or the best other one when that is EOS."""
    logits = session.logits()
    tok = argmax(logits)
    if eos_id is None or tok != eos_id:
        return tok
    logits = np.array(logits, dtype=np.float32)  # a copy: the caller's array stays as it was
    logits[eos_id] = -np.inf
    return argmax(logits)


def run_sweep(engine, tokens: Sequence[int], *, ctx_start: int = 2048, ctx_step: int = 2048,
              ctx_max: int = 32768, gen_tokens: int = 128,
              on_row: Callable[[BenchRow], None] | None = None,
              clock: Callable[[], float] = time.perf_counter) -> list[BenchRow]:
    """Run the sweep on ``engine`` (an opened ``Engine``: ``new_session``, ``eos_id``, ``context_length``)
    over the first ``ctx_max`` of ``tokens``; ``on_row`` sees each row as soon as it is measured.

    The session is allocated ``ctx_max + gen_tokens + 1`` tokens, as ds4-bench does.
    """
    context_length = engine.context_length
    check_sweep(ctx_start, ctx_step, ctx_max, gen_tokens, context_length)
    tokens = [int(t) for t in tokens[:ctx_max]]
    if len(tokens) < ctx_max:
        raise BenchError(f"the token sequence has {len(tokens)} tokens; the sweep needs at least ctx_max={ctx_max}")
    eos_id = getattr(engine, "eos_id", None)
    session = engine.new_session(ctx=ctx_max + gen_tokens + 1)
    rows: list[BenchRow] = []
    previous = 0
    for frontier in frontiers(ctx_start, ctx_step, ctx_max):
        live = session.tokens
        if live != tokens[:previous]:
            # Without this the timed window would silently include a rebuild of the whole prefix.
            raise BenchError(f"the session holds {len(live)} tokens after restoring the snapshot at "
                             f"{previous}, not the {previous}-token prefix: restore is broken")
        mx.reset_peak_memory()

        t0 = clock()
        session.sync(tokens[:frontier])
        nxt = _greedy_no_eos(session, eos_id)  # reads the logits: the prefill's lazy tail is computed in the window
        prefill_s = clock() - t0

        snap = session.snapshot()
        kv_bytes = snap.nbytes()

        generated = []
        t0 = clock()
        for i in range(gen_tokens):
            generated.append(nxt)
            session.eval(nxt)
            nxt = _greedy_no_eos(session, eos_id)  # as ds4's decode, which also produces the logits
        gen_s = clock() - t0

        session.restore(snap)
        del snap

        interval = frontier - previous
        row = BenchRow(
            ctx_tokens=frontier, prefill_tokens=interval,
            prefill_tps=interval / prefill_s if prefill_s > 0 else 0.0,
            gen_tokens=gen_tokens, gen_tps=gen_tokens / gen_s if gen_s > 0 and gen_tokens else 0.0,
            kvcache_bytes=int(kv_bytes), rss_peak_bytes=peak_rss_bytes(), mlx_peak_bytes=int(mx.get_peak_memory()),
            prefill_s=prefill_s, gen_s=gen_s, generated=tuple(generated))
        rows.append(row)
        if on_row is not None:
            on_row(row)
        previous = frontier
    return rows
