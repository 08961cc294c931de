"""`ds4-mlx generate`: one prompt in, streamed text out, with ds4's CLI defaults.

Defaults follow ds4's CLI: system "You are a helpful assistant", thinking on, temperature 1,
top-p 1, min-p 0.05, ctx 32768, up to 50000 tokens; `--temp 0` is greedy. `--dump-logprobs`
writes the JSON ds4 writes for its flag of that name (a greedy continuation, no text printed).

`--kv-disk-dir DIR` keeps prompt prefixes on disk (ds4-server's disk KV cache, same file format and
policy; ``engine/disk_cache.py`` holds the rules): a run first looks for the longest stored prefix
of its prompt (by tokens, and by rendered text as ds4 does: the one holding more tokens wins) and
continues from it; a fresh prompt of ``--kv-cache-min-tokens`` .. 30000 tokens is saved at ds4's cold boundary (the chat anchor, else
``n - 32`` rounded down to the alignment, else the whole prompt) before the rest is prefilled; and
the live session is saved as "continued" at every multiple of the continued step (the interval
rounded up to the alignment: 10240 by default) during prefill and generation.
``--kv-cache-save-on-exit`` also stores the final state (ds4-server's shutdown save; off by
default, see ``DiskCache``). The stats line reports the cached tokens.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ds4_mlx.errors import Ds4Error


class CliUsageError(Ds4Error):
    pass


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of a prompt (ds4 CLI semantics).")
    p.add_argument("-m", "--model", required=True, help="DS4 Flash GGUF file")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    p.add_argument("--raw", action="store_true",
                   help="tokenize the prompt as given (special markers recognised, no chat template)")
    p.add_argument("-sys", "--system", default=None,
                   help='system prompt; "" disables it (default: "You are a helpful assistant")')
    think = p.add_mutually_exclusive_group()
    think.add_argument("--think", dest="think", action="store_const", const="high", help="thinking mode (default)")
    think.add_argument("--think-max", dest="think", action="store_const", const="max",
                       help="Think Max when --ctx >= 393216, else normal thinking")
    think.add_argument("--nothink", dest="think", action="store_const", const="none",
                       help="answer directly (assistant turn starts with </think>)")
    p.add_argument("--temp", type=float, default=1.0, help="temperature; 0 = greedy (default 1)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus probability (default 1)")
    p.add_argument("--min-p", type=float, default=0.05, help="min probability relative to the best (default 0.05)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K best (0 = off, max 1024)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: time-based)")
    p.add_argument("-n", "--tokens", type=int, default=50000, help="maximum tokens to generate (default 50000)")
    p.add_argument("--ctx", type=int, default=32768, help="context size in tokens (default 32768)")
    p.add_argument("--numerics", choices=["default", "ds4-cpu"], default="default",
                   help="arithmetic: fast path, or ds4's CPU reference arithmetic")
    p.add_argument("--dump-logprobs", metavar="FILE", help="write greedy top-logprobs JSON (ds4 format), no text")
    p.add_argument("--logprobs-top-k", type=int, default=20, help="alternatives per step in --dump-logprobs")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="prefill chunk; chunk ends fall on absolute multiples of it (default 2048)")
    kv = p.add_argument_group("disk KV cache")
    kv.add_argument("--kv-disk-dir", metavar="DIR", help="reuse and save prompt prefixes in this directory")
    kv.add_argument("--kv-disk-space-mb", type=float, default=4096, metavar="MB",
                    help="size budget of the directory in MiB (default 4096)")
    kv.add_argument("--kv-cache-min-tokens", type=int, default=512, metavar="N",
                    help="shortest prefix worth saving or loading (default 512)")
    kv.add_argument("--kv-cache-boundary-align-tokens", type=int, default=None, metavar="N",
                    help="align cold saves and continued frontiers to this multiple "
                         "(default: the prefill chunk; 0 = off)")
    kv.add_argument("--kv-cache-continued-interval-tokens", type=int, default=10000, metavar="N",
                    help="save the live session every N tokens, rounded up to the alignment "
                         "(default 10000, i.e. 10240; 0 = off)")
    kv.add_argument("--kv-cache-save-on-exit", action="store_true",
                    help="also store the final state (prompt + generated tokens) when the run ends")
    p.set_defaults(func=run, think="high")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliUsageError(f"cannot read --prompt-file {args.prompt_file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CliUsageError(f"--prompt-file {args.prompt_file} is not UTF-8 (byte {exc.start})") from None


def _validate(args) -> None:
    if args.ctx < 2:
        raise CliUsageError(f"--ctx must be at least 2, got {args.ctx}")
    if args.tokens < 0:
        raise CliUsageError(f"-n must be >= 0, got {args.tokens}")
    if args.top_k < 0:
        raise CliUsageError(f"--top-k must be >= 0, got {args.top_k}")
    if args.logprobs_top_k < 1:
        raise CliUsageError(f"--logprobs-top-k must be >= 1, got {args.logprobs_top_k}")
    if args.prefill_chunk < 1:
        raise CliUsageError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.kv_cache_min_tokens < 1:
        raise CliUsageError(f"--kv-cache-min-tokens must be >= 1, got {args.kv_cache_min_tokens}")
    if args.kv_cache_boundary_align_tokens is not None and args.kv_cache_boundary_align_tokens < 0:
        raise CliUsageError(f"--kv-cache-boundary-align-tokens must be >= 0, "
                            f"got {args.kv_cache_boundary_align_tokens}")
    if args.kv_cache_continued_interval_tokens < 0:
        raise CliUsageError(f"--kv-cache-continued-interval-tokens must be >= 0, "
                            f"got {args.kv_cache_continued_interval_tokens}")
    if args.kv_disk_space_mb < 0:
        raise CliUsageError(f"--kv-disk-space-mb must be >= 0, got {args.kv_disk_space_mb}")


def run(args) -> int:
    from ds4_mlx.chat.template import DEFAULT_SYSTEM, ThinkMode
    from ds4_mlx.engine.engine import Engine
    from ds4_mlx.engine.sampling import SamplingParams, XorShiftRng, argmax, sample
    from ds4_mlx.tokenizer.utf8_stream import Utf8StreamDecoder

    _validate(args)
    text = _read_prompt(args)
    engine = Engine.open(args.model, numerics=args.numerics)
    think = {"none": ThinkMode.NONE, "high": ThinkMode.HIGH, "max": ThinkMode.MAX}[args.think]
    system = DEFAULT_SYSTEM if args.system is None else args.system
    prompt = engine.encode_prompt(text, raw=args.raw, system=system, think=think, ctx=args.ctx)
    if len(prompt) >= args.ctx:
        raise CliUsageError(f"prompt has {len(prompt)} tokens, which does not fit --ctx {args.ctx}")

    session = engine.new_session(ctx=args.ctx, chunk=args.prefill_chunk)
    disk = _open_disk_cache(engine, args) if args.kv_disk_dir else None
    t0 = time.perf_counter()
    if disk is not None:
        report = disk.sync(session, prompt)
        _report_sync(report)
        prompt, cached = report.effective_prompt, report.cached_tokens
    else:
        session.sync(prompt)
        cached = 0
    t1 = time.perf_counter()
    room = args.ctx - len(prompt)
    max_tokens = 0 if room <= 1 else min(args.tokens, room - 1)

    if args.dump_logprobs:
        rc = _dump_logprobs(engine, session, prompt, args, max_tokens, disk)
        _close(disk, session, args)
        return rc

    params = SamplingParams(temperature=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    rng = XorShiftRng(args.seed or None)
    decoder = Utf8StreamDecoder(engine.tokenizer)
    out = sys.stdout
    generated = 0
    t2 = time.perf_counter()
    while generated < max_tokens:
        logits = session.logits()
        token = argmax(logits) if params.greedy else sample(logits, params, rng)
        if token == engine.eos_id:
            break
        out.write(decoder.feed(token))
        out.flush()
        generated += 1
        if generated >= max_tokens:
            break
        session.eval(token)
        _after_eval(disk, session)
    out.write(decoder.flush())
    out.write("\n")
    out.flush()
    t3 = time.perf_counter()
    _close(disk, session, args)
    computed = len(prompt) - cached
    prefill_tps = computed / (t1 - t0) if t1 > t0 and computed else 0.0
    gen_tps = generated / (t3 - t2) if t3 > t2 and generated else 0.0
    print(f"ds4-mlx: prompt: {len(prompt)} tokens ({cached} cached), prefill: {prefill_tps:.2f} t/s, "
          f"generation: {gen_tps:.2f} t/s ({generated} tokens)", file=sys.stderr)
    return 0


def _open_disk_cache(engine, args):
    from ds4_mlx.engine.disk_cache import DiskCache, KVStoreOptions

    align = args.kv_cache_boundary_align_tokens
    opts = KVStoreOptions(min_tokens=args.kv_cache_min_tokens,
                          cold_max_tokens=max(30000, args.kv_cache_min_tokens),
                          continued_interval_tokens=args.kv_cache_continued_interval_tokens,
                          boundary_align_tokens=args.prefill_chunk if align is None else align)
    return DiskCache(engine, args.kv_disk_dir, args.kv_disk_space_mb, ctx=args.ctx, options=opts)


def _report_save(res) -> None:
    if res.stored:
        print(f"ds4-mlx: kv cache stored {res.tokens} tokens ({res.reason}) in {res.path}", file=sys.stderr)
    else:  # as ds4: a failed or skipped save is reported, the run goes on
        print(f"ds4-mlx: kv cache store {res.status} ({res.reason}, {res.tokens} tokens): {res.detail}",
              file=sys.stderr)


def _report_sync(report) -> None:
    for why in report.refused:
        print(f"ds4-mlx: kv cache refused {why}", file=sys.stderr)
    if report.hit_path is not None:
        by = report.source.removeprefix("disk-")
        print(f"ds4-mlx: kv cache hit: {report.cached_tokens} tokens ({by}) from {report.hit_path}",
              file=sys.stderr)
    for res in report.saved:
        _report_save(res)


def _after_eval(disk, session) -> None:
    if disk is not None:
        res = disk.after_eval(session)
        if res is not None:
            _report_save(res)


def _close(disk, session, args) -> None:
    if disk is not None and args.kv_cache_save_on_exit:
        res = disk.close(session)
        if res is not None:
            _report_save(res)


def _token_json(tokenizer, token: int) -> dict:
    """ds4's json_write_token: a piece that is not valid UTF-8 on its own (half a character) is
    written byte by byte as U+0000..U+00FF; ``bytes`` is authoritative either way."""
    raw = tokenizer.token_text(token)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return {"id": token, "text": text, "bytes": list(raw)}


def _dump_logprobs(engine, session, prompt, args, max_tokens: int, disk=None) -> int:
    """Same shape and key order as ds4's run_logprob_dump: greedy steps with top-k logprobs."""
    from ds4_mlx.engine.sampling import argmax, top_logprobs

    k = min(args.logprobs_top_k, 128)
    steps = []
    for step in range(max_tokens):
        logits = session.logits()
        scores = top_logprobs(logits, k)
        token = argmax(logits)
        steps.append({
            "step": step,
            "selected": _token_json(engine.tokenizer, token),
            "top_logprobs": [{"token": _token_json(engine.tokenizer, s.id), "logit": s.logit, "logprob": s.logprob}
                             for s in scores],
        })
        if token == engine.eos_id:
            break
        session.eval(token)
        _after_eval(disk, session)
    doc = {"source": "ds4-mlx", "prompt_tokens": len(prompt), "ctx": args.ctx, "top_k": k, "steps": steps}
    try:
        Path(args.dump_logprobs).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise CliUsageError(f"cannot write --dump-logprobs {args.dump_logprobs}: {exc.strerror or exc}") from None
    print(f"ds4-mlx: wrote {len(steps)} steps to {args.dump_logprobs}", file=sys.stderr)
    return 0
