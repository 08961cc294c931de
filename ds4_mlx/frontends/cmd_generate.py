"""`ds4-mlx generate`: one prompt in, streamed text out, with ds4's CLI defaults.

Defaults follow ds4's CLI: system "You are a helpful assistant", thinking on, temperature 1,
top-p 1, min-p 0.05, ctx 32768; `--temp 0` is greedy. Except `-n`: 256 tokens (mlx-lm's default,
ds4's is 50000). `--dump-logprobs` writes the JSON ds4 writes for its flag of that name (a greedy
continuation, no text printed).

`--kv-disk-dir DIR` keeps prompt prefixes on disk (ds4-server's disk KV cache, same file format and
policy; ``engine/disk_cache.py`` holds the rules): a run first looks for the longest stored prefix
of its prompt (by tokens, and by rendered text as ds4 does: the one holding more tokens wins) and
continues from it; a fresh prompt of ``--kv-cache-min-tokens`` .. 30000 tokens is saved at ds4's cold boundary (the chat anchor, else
``n - 32`` rounded down to the alignment, else the whole prompt) before the rest is prefilled; and
the live session is saved as "continued" at every multiple of the continued step (the interval
rounded up to the alignment: 10240 by default) during prefill and generation.
``--kv-cache-save-on-exit`` also stores the final state (ds4-server's shutdown save; off by
default, see ``DiskCache``). The stats line reports the cached tokens.

The run is ``ds4_mlx.stream_generate`` (``engine/generate.py``, the package's only decode loop);
this module only prints its events: text to stdout, cache reports and notices to stderr on lines of
their own, then the stats line (prompt, cached, prefill and generation speed, load time, time to
first token, peak memory). Ctrl-C stops within a token: the stats line is still printed, exit 130.
A prefill that runs over a second draws a progress bar when stderr is a terminal.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ds4_mlx.chat.template import DEFAULT_CTX
from ds4_mlx.frontends.args import (SEED, TOKENS, UsageError, add_ctx_option, add_disk_cache_options,
                                    add_model_options, add_sampling_options, add_system_option, add_think_options,
                                    model_options, ranged, read_text_file, was_given, add_draft_options,
                                    draft_options)

# mlx-lm's default, and the library's generate(max_tokens=...): the CLI and the API agree. ds4's
# 50000 suits long reasoning but makes a forgotten -n run for hours on a slow machine.
DEFAULT_MAX_TOKENS = 256
# ds4 stores at most 128 alternatives per step in its dump (it clamps; we refuse).
MAX_LOGPROBS_TOP_K = 128


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of a prompt (ds4 CLI semantics).")
    add_model_options(p, distributed=True)
    add_draft_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from FILE (UTF-8); - reads stdin")
    p.add_argument("--raw", action="store_true",
                   help="tokenize the prompt as given (special markers recognised, no chat template)")
    add_system_option(p)
    add_think_options(p)
    add_sampling_options(p)
    p.add_argument("--seed", action=SEED, default=0, metavar="N",
                   help="sampling seed, 0..2^64-1 (default 0: time-based)")
    p.add_argument("-n", "--tokens", action=TOKENS, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"maximum tokens to generate (default {DEFAULT_MAX_TOKENS}, as mlx-lm and "
                        f"the Python API; ds4's is 50000: raise it for long reasoning, e.g. -n 32768)")
    add_ctx_option(p, DEFAULT_CTX)
    p.add_argument("--dump-logprobs", metavar="FILE",
                   help="write greedy top-logprobs JSON (ds4 format), no text; --temp is ignored")
    p.add_argument("--logprobs-top-k", action=ranged(int, 1, MAX_LOGPROBS_TOP_K,
                                                     why=f"ds4's dump stores at most {MAX_LOGPROBS_TOP_K}"),
                   default=20, metavar="K", help=f"alternatives per step in --dump-logprobs, "
                                                 f"1..{MAX_LOGPROBS_TOP_K} (default 20)")
    p.add_argument("--prefill-chunk", action=ranged(int, 1, why="a number of tokens per prefill step"),
                   default=2048, metavar="N",
                   help="prefill chunk; chunk ends fall on absolute multiples of it (default 2048)")
    kv = add_disk_cache_options(p)
    kv.add_argument("--kv-cache-min-tokens", action=ranged(int, 1, why="a prefix length in tokens"),
                    default=512, metavar="N", help="shortest prefix worth saving or loading (default 512)")
    kv.add_argument("--kv-cache-boundary-align-tokens", action=ranged(int, 0, why="0 = off, else a multiple"),
                    default=None, metavar="N",
                    help="align cold saves and continued frontiers to this multiple "
                         "(default: the prefill chunk; 0 = off)")
    kv.add_argument("--kv-cache-continued-interval-tokens", action=ranged(int, 0, why="0 = off, else an interval"),
                    default=10000, metavar="N",
                    help="save the live session every N tokens, rounded up to the alignment "
                         "(default 10000, i.e. 10240; 0 = off)")
    kv.add_argument("--kv-cache-save-on-exit", action="store_true",
                    help="also store the final state (prompt + generated tokens) when the run ends")
    p.set_defaults(func=run)


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    return read_text_file(args.prompt_file, "--prompt-file", stdin=True)


def _check_dump_path(path: str) -> None:
    """Fail before the model loads, not after a long run, when the dump cannot be written:
    open for append (an existing file is not truncated) and remove what this check created."""
    if not path:
        raise UsageError("--dump-logprobs needs a file name, got an empty string")
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"--dump-logprobs {path} is a directory, not a file")
    parent = target.parent
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise UsageError(f"--dump-logprobs {path}: {parent} {what}")
    existed = target.exists()
    try:
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise UsageError(f"cannot write --dump-logprobs {path}: {exc.strerror or exc}") from None
    if not existed:
        try:
            target.unlink()
        except OSError:
            pass  # created but not removable: the dump overwrites it later anyway


def _validate(args) -> None:
    """Checks that need more than one option or the file system; value ranges are checked while
    parsing (``frontends/args.py``)."""
    if args.dump_logprobs is not None:
        _check_dump_path(args.dump_logprobs)
        if args.temp != 0 and was_given(args, "temp"):
            print(f"ds4-mlx: --dump-logprobs decodes greedily: --temp {args.temp:g} is ignored", file=sys.stderr)


def run(args) -> int:
    from ds4_mlx.frontends.cli import cancel_on_sigint

    _validate(args)
    text = _read_prompt(args)
    with cancel_on_sigint() as cancel:
        return _run(args, text, cancel)


def _run(args, text: str, cancel) -> int:
    from ds4_mlx.chat.template import DEFAULT_SYSTEM
    from ds4_mlx.engine.engine import Engine
    from ds4_mlx.engine.generate import stream_generate
    from ds4_mlx.frontends.cli import EXIT_INTERRUPTED

    engine = Engine.open(args.model, **model_options(args), **draft_options(args))
    if cancel.is_set():  # Ctrl-C while the model was loading: nothing generated, no stats to print
        print("ds4-mlx: interrupted while loading the model", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.ctx > engine.context_length:
        raise UsageError(f"--ctx {args.ctx} is larger than the model's context length {engine.context_length}")
    session = engine.new_session(ctx=args.ctx, chunk=args.prefill_chunk)
    disk = _open_disk_cache(engine, args) if args.kv_disk_dir else None
    dump = bool(args.dump_logprobs)
    out = _Output(sys.stdout, sys.stderr)
    bar = _PrefillBar(sys.stderr)
    kwargs = dict(max_tokens=args.tokens, temperature=0.0 if dump else args.temp, top_p=args.top_p,
                  min_p=args.min_p, top_k=args.top_k, seed=args.seed or None, think=args.think,
                  system=DEFAULT_SYSTEM if args.system is None else args.system, raw=args.raw,
                  session=session, kv_cache=disk, kv_cache_save_on_exit=args.kv_cache_save_on_exit,
                  logprobs=args.logprobs_top_k if dump else 0, progress=bar.update, cancel=cancel)
    steps: list[dict] = []
    done = None
    try:
        for ev in stream_generate(engine, text, **kwargs):
            if ev.kind in ("reasoning", "content", "tool_call"):
                bar.close()
                if dump:
                    if ev.token is not None:
                        steps.append(_step_json(engine.tokenizer, len(steps), ev.token, ev.top_logprobs))
                else:
                    out.text(ev.text)
            elif ev.kind in ("cache", "notice"):
                out.notice(ev.text)
            elif ev.kind == "done":
                done = ev
    finally:
        bar.close()
    if dump:
        if done.token is not None:  # the EOS step: ds4 writes it too
            steps.append(_step_json(engine.tokenizer, len(steps), done.token, done.top_logprobs))
        _write_dump(args, done.result.stats.prompt_tokens, steps)
    else:
        out.text("\n")
    out.end()
    print(f"ds4-mlx: {done.stats.summary()}", file=sys.stderr)
    return EXIT_INTERRUPTED if done.finish_reason == "cancelled" else 0


class _Output:
    """Generated text to stdout; one-line notices to stderr, never in the middle of a text line
    (a notice that arrives mid-line waits for the line to end)."""

    def __init__(self, out, err):
        self.out, self.err = out, err
        self.at_line_start = True
        self.held: list[str] = []

    def text(self, piece: str) -> None:
        if not piece:
            return
        cut = piece.rfind("\n") + 1
        if self.held and cut:  # release held notices right after the piece's last line break
            self.out.write(piece[:cut])
            self.out.flush()
            self._release()
            piece = piece[cut:]
            self.at_line_start = True
        if piece:
            self.out.write(piece)
            self.at_line_start = piece.endswith("\n")
        self.out.flush()

    def notice(self, line: str) -> None:
        self.held.append(line)
        if self.at_line_start:
            self._release()

    def _release(self) -> None:
        for line in self.held:
            print(f"ds4-mlx: {line}", file=self.err, flush=True)
        self.held.clear()

    def end(self) -> None:
        self._release()


class _PrefillBar:
    """A tqdm bar on a terminal for prefills that take over a second; nothing when piped."""

    DELAY_S = 1.0

    def __init__(self, stream):
        self.stream = stream
        self.tty = hasattr(stream, "isatty") and stream.isatty()
        self.bar = None
        self.t0 = time.perf_counter()  # the prefill starts right after the bar is made

    def update(self, done: int, total: int, tps: float) -> None:
        if not self.tty:
            return
        if self.bar is not None and (total != self.bar.total or done < self.bar.n):
            self.close()  # a new prefill segment (the disk cache syncs in several)
        if self.bar is None:
            if time.perf_counter() - self.t0 < self.DELAY_S or done >= total:
                return
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="tok", desc="prefill", file=self.stream, leave=False,
                            dynamic_ncols=True)
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _open_disk_cache(engine, args):
    from ds4_mlx.engine.disk_cache import DiskCache, KVStoreOptions

    align = args.kv_cache_boundary_align_tokens
    opts = KVStoreOptions(min_tokens=args.kv_cache_min_tokens,
                          cold_max_tokens=max(30000, args.kv_cache_min_tokens),
                          continued_interval_tokens=args.kv_cache_continued_interval_tokens,
                          boundary_align_tokens=args.prefill_chunk if align is None else align)
    return DiskCache(engine, args.kv_disk_dir, args.kv_disk_space_mb, ctx=args.ctx, options=opts)


def _token_json(tokenizer, token: int) -> dict:
    """ds4's json_write_token: a piece that is not valid UTF-8 on its own (half a character) is
    written byte by byte as U+0000..U+00FF; ``bytes`` is authoritative either way."""
    raw = tokenizer.token_text(token)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return {"id": token, "text": text, "bytes": list(raw)}


def _step_json(tokenizer, step: int, token: int, top) -> dict:
    """One step of ds4's run_logprob_dump, from the API's logprobs (same key order)."""
    return {
        "step": step,
        "selected": _token_json(tokenizer, token),
        "top_logprobs": [{"token": _token_json(tokenizer, s.id), "logit": s.logit, "logprob": s.logprob}
                         for s in top],
    }


def _write_dump(args, prompt_tokens: int, steps: list[dict]) -> None:
    doc = {"source": "ds4-mlx", "prompt_tokens": prompt_tokens, "ctx": args.ctx, "top_k": args.logprobs_top_k,
           "steps": steps}
    try:
        Path(args.dump_logprobs).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --dump-logprobs {args.dump_logprobs}: {exc.strerror or exc}") from None
    print(f"ds4-mlx: wrote {len(steps)} steps to {args.dump_logprobs}", file=sys.stderr)
