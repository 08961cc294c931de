"""`ds4-mlx chat`: the interactive mode (ds4's REPL), one live session across turns.

The conversation is one growing token list (``chat.template.ChatTranscript``, ds4's ``repl_chat``):
system text, then per turn the user message, the assistant prefix, the generated tokens *verbatim*
(reasoning and its ``</think>`` included, never re-tokenized) and an EOS closing the turn, as ds4
does. Each turn is ``stream_generate`` over that whole list with the live ``Session``: the session
already holds everything up to the previous answer, so only the new text is computed (the stats
line says how many prompt tokens were cached). A turn stopped with Ctrl-C keeps its partial answer
(closed with EOS) as ds4 does; one stopped before its first token is dropped. At the start of each
turn the live state is kept as a snapshot, so a dropped turn costs no re-prefill either.

Input: one line is one message; a line starting with ``\"\"\"`` opens a multi-line message that the
next line ending in ``\"\"\"`` closes (the text in between is sent verbatim, slash lines included);
``//text`` sends ``/text``. On a terminal, history is kept with Python's ``readline`` in
``<cache>/chat_history``, reasoning is drawn faint (ANSI) and Ctrl-C at the prompt clears the line.
With stdin piped (scripts) there is no prompt and no colour: each answer goes to stdout followed by a
newline, everything else (command replies, notices, stats) to stderr. Ctrl-D or ``/quit`` exits 0.

Like ds4's printer, the ``<think>`` / ``</think>`` tags are not printed: reasoning is shown (faint on
a terminal) and a line break separates it from the answer.

``/save NAME`` writes ``NAME.json`` (the transcript, mode, ctx, model id) and ``NAME.session`` (the
session payload, ``engine/payload.py``) in the chat dir; ``/load NAME`` restores both, so the
conversation continues with no re-prefill.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from pathlib import Path

from ds4_mlx.chat.template import DEFAULT_CTX, DEFAULT_SYSTEM, THINK_CLOSE, THINK_OPEN, ChatTranscript, ThinkMode
from ds4_mlx.errors import Ds4Error, MemoryPlanError
from ds4_mlx.frontends.cmd_demo import default_cache_dir  # one cache folder for demo model, chats, history
from ds4_mlx.frontends.args import (MAX_CTX, SEED, TOKENS, add_ctx_option, add_disk_cache_options,
                                    add_model_options, add_sampling_options, add_system_option,
                                    add_think_options, check_ctx, model_options, add_draft_options,
                                    draft_options)

# A cap, not a target: Ctrl-C ends an answer early, and a turn never runs past the context
# (ds4's 50000 is the same idea; generate's 256 is too short for a thinking answer).
DEFAULT_MAX_TOKENS = 4096
PROMPT, CONTINUE = "ds4> ", "...> "
BLOCK = '"""'
MAX_READ_BYTES = 16 << 20       # /read: larger than any context's worth of text
MAX_CHAT_JSON_BYTES = 64 << 20  # a transcript of 1M tokens is ~8 MB of JSON
CHAT_FORMAT, CHAT_VERSION = "ds4-mlx-chat", 1
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
FAINT, RESET = "\x1b[2m", "\x1b[0m"

COMMANDS = ("/help", "/think", "/think-low", "/think-high", "/think-max", "/nothink", "/ctx", "/read", "/save", "/load", "/reset",
            "/quit", "/exit")

HELP = f"""Commands:
  /help          show this help
  /think         think before answering, at the checkpoint's default level (the default;
                 preview: high, 0731: low)
  /think-low     thinking level low (0731: no effort prefix; the preview has no low: high)
  /think-high    thinking level high (0731: the "Absolute maximum" effort prefix)
  /think-max     Think Max (only with ctx >= 393216, else level high)
  /nothink       answer directly, no reasoning
  /ctx N         new session of N tokens of context (the KV state resets; the conversation is
                 prefilled again with the next message, or reset if it no longer fits)
  /read FILE     send the text of FILE (UTF-8) as the next message
  /save NAME     save the conversation and its KV state in the chat dir
  /load NAME     restore a saved conversation and continue it (nothing is prefilled again)
  /reset         start a new conversation (same system prompt and thinking mode)
  /quit, /exit   leave (Ctrl-D too)
Input:
  {BLOCK}            at the start of a line opens a multi-line message; a line ending in {BLOCK}
                 closes it (the lines in between are sent as typed)
  //text         sends "/text" (a message that starts with a slash)
  Ctrl-C         stops the answer (what was written stays in the conversation, as in ds4);
                 at the prompt, clears the line"""


class ChatCommandError(Ds4Error):
    """A REPL command that cannot run: one line, and the REPL goes on."""


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat (ds4's REPL): one live session across turns",
                       description="Chat with the model; type /help for commands. With stdin piped, "
                                   "each line is a message and each answer one stdout block.")
    add_model_options(p, distributed=True)
    add_draft_options(p)
    add_system_option(p)
    add_think_options(p)
    add_sampling_options(p)
    p.add_argument("--seed", action=SEED, default=0, metavar="N",
                   help="sampling seed of every turn, 0..2^64-1 (default 0: time-based)")
    p.add_argument("-n", "--tokens", action=TOKENS, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"maximum tokens per answer (default {DEFAULT_MAX_TOKENS}; Ctrl-C stops one sooner)")
    add_ctx_option(p, DEFAULT_CTX)
    p.add_argument("--chat-dir", default=None, metavar="DIR",
                   help="where /save and /load keep conversations (default ~/.cache/ds4-mlx/chats)")
    add_disk_cache_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from ds4_mlx.engine.engine import Engine

    engine = Engine.open(args.model, **model_options(args), **draft_options(args))
    if args.ctx > engine.context_length:
        raise ChatCommandError(f"--ctx {args.ctx} is larger than the model's context length {engine.context_length}")
    print(f"ds4-mlx chat: {args.model}: {engine.effort_rules.banner()}", file=sys.stderr, flush=True)
    repl = ChatRepl(engine, args, stdin=sys.stdin, stdout=sys.stdout, stderr=sys.stderr)
    return repl.loop()


def _is_tty(stream) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


# ------------------------------------------------------------------------------------------------
# output


class AnswerPrinter:
    """Streamed answer text to ``out`` as ds4's token printer shows it: think tags dropped, reasoning
    faint when ``faint`` (a terminal), a line break after the reasoning, and a final line break."""

    def __init__(self, out, *, faint: bool, in_think: bool):
        self.out = out
        self.faint = faint
        self.in_think = in_think
        self.pending = ""           # a possible start of a think tag, held until it is decided
        self.colored = False
        self.at_line_start = True

    def feed(self, text: str) -> None:
        self._process(text, final=False)

    def finish(self) -> None:
        self._process("", final=True)
        parts: list[str] = []
        self._end_line(parts)
        self._write("".join(parts))

    def _end_line(self, parts: list[str]) -> None:
        """Leave faint mode and end the line: after the reasoning, and at the end of the answer."""
        if self.colored:
            parts.append(RESET)
            self.colored = False
        if not self.at_line_start:
            parts.append("\n")
            self.at_line_start = True

    def _process(self, text: str, final: bool) -> None:
        buf, self.pending = self.pending + text, ""
        parts: list[str] = []
        i = 0
        while i < len(buf):
            if buf.startswith(THINK_OPEN, i):
                self.in_think = True
                i += len(THINK_OPEN)
                continue
            if buf.startswith(THINK_CLOSE, i):
                self.in_think = False
                self._end_line(parts)
                i += len(THINK_CLOSE)
                continue
            rest = buf[i:]
            if not final and buf[i] == "<" and (THINK_OPEN.startswith(rest) or THINK_CLOSE.startswith(rest)):
                self.pending = rest
                break
            j = buf.find("<", i + 1)
            j = len(buf) if j < 0 else j
            piece = buf[i:j]
            if self.in_think and self.faint and not self.colored:
                parts.append(FAINT)
                self.colored = True
            parts.append(piece)
            self.at_line_start = piece.endswith("\n")
            i = j
        self._write("".join(parts))

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
        self.out.flush()


# ------------------------------------------------------------------------------------------------
# input


class _EndOfInput(Exception):
    pass


class LineReader:
    """Messages from stdin: a line, or a \"\"\" block; ``None`` at end of input.

    On a terminal it uses ``input()`` (with ``readline`` when available: editing and history); the
    prompt goes to stdout when that is the terminal too, else to stderr, never into piped output."""

    def __init__(self, stdin, stdout, stderr, *, interactive: bool, history: Path | None):
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr
        self.interactive = interactive
        self.prompt_on_stdout = interactive and _is_tty(stdout) and stdin is sys.stdin
        self.readline = None
        self.history = history
        if interactive and history is not None:
            self._open_history()

    def _open_history(self) -> None:
        try:
            import readline
        except ImportError:  # Python built without it: plain line input, no history
            return
        self.readline = readline
        readline.set_history_length(512)
        try:
            readline.read_history_file(self.history)
        except (OSError, ValueError):
            pass  # no history yet (or unreadable): start empty

    def remember(self) -> None:
        if self.readline is None:
            return
        try:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.history)
        except OSError as exc:
            print(f"ds4-mlx: cannot write the history file {self.history}: {exc.strerror or exc}; "
                  f"history is off", file=self.stderr)
            self.readline = None

    def _line(self, prompt: str) -> str:
        if self.interactive and self.stdin is sys.stdin:
            if not self.prompt_on_stdout:
                self.stderr.write(prompt)
                self.stderr.flush()
                prompt = ""
            try:
                return input(prompt)
            except EOFError:
                raise _EndOfInput from None
        if self.interactive:
            self.stderr.write(prompt)
            self.stderr.flush()
        line = self.stdin.readline()
        if not line:
            raise _EndOfInput
        return line[:-1] if line.endswith("\n") else line

    def read(self) -> tuple[str, bool] | None:
        """(text, is_block): a stripped line, or a block's text verbatim; None at end of input."""
        try:
            first = self._line(PROMPT)
        except _EndOfInput:
            return None
        line = first.strip()
        if not line.startswith(BLOCK):
            return line, False
        body = line[len(BLOCK):]
        if len(body) >= len(BLOCK) and body.endswith(BLOCK):  # """one line"""
            return body[:-len(BLOCK)], True
        lines = [body] if body else []
        while True:
            try:
                nxt = self._line(CONTINUE)
            except _EndOfInput:
                print(f"ds4-mlx: the input ended inside a {BLOCK} block; that message is not sent",
                      file=self.stderr)
                return None
            end = nxt.rstrip()
            if end.endswith(BLOCK):
                if end[:-len(BLOCK)]:
                    lines.append(end[:-len(BLOCK)])
                return "\n".join(lines), True
            lines.append(nxt)


def _write_private(path: Path, write) -> None:
    """``write(fh)`` into a new file that then replaces ``path``: readable by the user only (a saved
    chat is their conversation), never through a symlink.  The temp name is unique (pid and random
    bytes) and opened with O_EXCL|O_NOFOLLOW, so a link planted at a name known in advance is
    refused instead of written through; ``os.replace`` then swaps the name itself, so a link at
    ``path`` is replaced, not followed, and a crash leaves the old save whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------------------------------------
# the REPL


class ChatRepl:
    def __init__(self, engine, args, *, stdin, stdout, stderr):
        self.engine = engine
        self.args = args
        self.out, self.err = stdout, stderr
        self.interactive = _is_tty(stdin)
        self.color = _is_tty(stdout) and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"
        self.system = DEFAULT_SYSTEM if args.system is None else args.system
        self.chat_dir = Path(args.chat_dir) if args.chat_dir else default_cache_dir() / "chats"
        self.session = self._new_session(args.ctx)
        self.transcript = ChatTranscript(engine.tokenizer, system=self.system, think=args.think, ctx=args.ctx,
                                         rules=engine.effort_rules)
        self.disk = self._open_disk_cache(args.ctx) if args.kv_disk_dir else None
        self.reader = LineReader(stdin, stdout, stderr, interactive=self.interactive,
                                 history=default_cache_dir() / "chat_history")

    # -- plumbing --------------------------------------------------------------------------------------

    def say(self, line: str) -> None:
        """A reply or notice: stderr, so piped stdout holds only the answers."""
        print(f"ds4-mlx: {line}", file=self.err, flush=True)

    def _new_session(self, ctx: int):
        # One kept snapshot is all a chat uses: the state at the start of the current turn.
        return self.engine.new_session(ctx=ctx, kept_checkpoints=1)

    def _open_disk_cache(self, ctx: int):
        from ds4_mlx.engine.disk_cache import DiskCache

        return DiskCache(self.engine, self.args.kv_disk_dir, self.args.kv_disk_space_mb, ctx=ctx)

    @property
    def think(self) -> ThinkMode:
        return self.transcript.think

    # -- loop ------------------------------------------------------------------------------------------

    def loop(self) -> int:
        if self.interactive:
            self.say(f"chat with {self.engine.path.name}: ctx {self.session.ctx}, thinking "
                     f"{self.transcript.effective_think.value}. /help for commands, {BLOCK} for "
                     f"multi-line, Ctrl-D to quit.")
        while True:
            try:
                got = self.reader.read()
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                print(file=self.err, flush=True)  # Ctrl-C at the prompt: drop the line, new prompt
                continue
            if got is None:
                if self.interactive:
                    print(file=self.err, flush=True)
                return 0
            text, is_block = got
            if not text.strip():
                continue
            self.reader.remember()
            try:
                if not self.handle(text, is_block):
                    return 0
            except KeyboardInterrupt:
                if not self.interactive:
                    raise
                self.say("interrupted")
            except Ds4Error as exc:
                self.say(str(exc))

    def handle(self, text: str, is_block: bool = False) -> bool:
        """Run one input; False when the REPL should end."""
        if is_block or not text.startswith("/"):
            self.turn(text)
            return True
        if text.startswith("//"):
            self.turn(text[1:])
            return True
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/quit", "/exit"):
            return False
        handler = {
            "/help": self.cmd_help, "/think": self.cmd_think, "/think-low": self.cmd_think_low,
            "/think-high": self.cmd_think_high, "/think-max": self.cmd_think_max,
            "/nothink": self.cmd_nothink, "/ctx": self.cmd_ctx, "/read": self.cmd_read,
            "/save": self.cmd_save, "/load": self.cmd_load, "/reset": self.cmd_reset,
        }.get(name)
        if handler is None:
            raise ChatCommandError(f"unknown command {name!r}; commands: {' '.join(COMMANDS)}")
        handler(arg)
        return True

    # -- a turn ----------------------------------------------------------------------------------------

    def turn(self, text: str) -> None:
        from ds4_mlx.frontends.cli import cancel_on_sigint

        with cancel_on_sigint() as cancel:
            self._turn(text, cancel)

    def _turn(self, text: str, cancel) -> None:
        from ds4_mlx.engine.generate import stream_generate
        from ds4_mlx.frontends.cmd_generate import _PrefillBar

        tr, session, args = self.transcript, self.session, self.args
        if session.pos:
            session.snapshot(keep=True)  # a dropped turn goes back here instead of re-prefilling
        ids = tr.begin_turn(text)
        if len(ids) >= session.ctx:
            tr.abort_turn()
            raise ChatCommandError(f"the conversation with this message is {len(ids)} tokens and ctx is "
                                   f"{session.ctx}: /reset, or /ctx with a larger size")
        mode = tr.effective_think
        printer = AnswerPrinter(self.out, faint=self.color, in_think=mode.enabled)
        bar = _PrefillBar(self.err)
        held: list[str] = []
        done = None
        try:
            for ev in stream_generate(self.engine, ids, max_tokens=args.tokens, temperature=args.temp,
                                      top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                                      seed=args.seed or None, think=mode, session=session,
                                      kv_cache=self.disk, progress=bar.update, cancel=cancel):
                if ev.kind in ("reasoning", "content", "tool_call"):
                    bar.close()
                    printer.feed(ev.text)
                elif ev.kind in ("cache", "notice"):
                    if printer.at_line_start:
                        self.say(ev.text)
                    else:
                        held.append(ev.text)
                elif ev.kind == "done":
                    done = ev
        except Ds4Error:
            tr.abort_turn()
            raise
        finally:
            bar.close()
            printer.finish()
            for line in held:
                self.say(line)
        result = done.result
        if done.finish_reason == "cancelled" and not result.tokens:
            tr.abort_turn()
            self.say("stopped before the answer began: the message is not part of the conversation")
        else:
            tr.append_generated(result.tokens)
            tr.end_turn()
            if done.finish_reason == "cancelled":
                self.say("stopped: the partial answer stays in the conversation")
        self.say(done.stats.summary())

    # -- commands --------------------------------------------------------------------------------------

    @staticmethod
    def _no_arg(name: str, arg: str) -> None:
        if arg:
            raise ChatCommandError(f"{name} takes no argument, got {arg!r}")

    def cmd_help(self, arg: str) -> None:
        self._no_arg("/help", arg)
        print(HELP, file=self.out, flush=True)

    def _set_think(self, name: str, arg: str, mode: ThinkMode) -> None:
        self._no_arg(name, arg)
        self.transcript.think = mode
        eff = self.transcript.effort
        if eff.downgraded:
            self.say(f"thinking mode: {eff.value} (Think Max needs ctx >= 393216, ctx is {self.session.ctx})")
        else:
            self.say(f"thinking mode: {eff.value}")

    def cmd_think(self, arg: str) -> None:
        self._set_think("/think", arg, self.engine.effort_rules.default)

    def cmd_think_low(self, arg: str) -> None:
        self._set_think("/think-low", arg, ThinkMode.LOW)

    def cmd_think_high(self, arg: str) -> None:
        self._set_think("/think-high", arg, ThinkMode.HIGH)

    def cmd_think_max(self, arg: str) -> None:
        self._set_think("/think-max", arg, ThinkMode.MAX)

    def cmd_nothink(self, arg: str) -> None:
        self._set_think("/nothink", arg, ThinkMode.NONE)

    def cmd_ctx(self, arg: str) -> None:
        if not arg:
            raise ChatCommandError(f"/ctx needs a size in tokens, 2..{min(MAX_CTX, self.engine.context_length)}")
        try:
            ctx = check_ctx(arg, "/ctx")
        except ValueError as exc:
            raise ChatCommandError(str(exc)) from None
        if ctx > self.engine.context_length:
            raise ChatCommandError(f"/ctx {ctx} is larger than the model's context length {self.engine.context_length}")
        if self.engine.memory_plan is not None:  # the load was planned for --ctx: a larger KV must fit too
            try:
                self.engine.memory_plan.check_ctx(ctx, "/ctx")
            except MemoryPlanError as exc:
                raise ChatCommandError(str(exc)) from None
        disk = self._open_disk_cache(ctx) if self.args.kv_disk_dir else None
        self.session = self._new_session(ctx)
        self.disk = disk
        self.transcript.ctx = ctx
        n = len(self.transcript.tokens)
        if n >= ctx - 1:
            self._reset_transcript()
            self.say(f"ctx {ctx}: new session; the conversation ({n} tokens) does not fit and was reset")
        else:
            self.say(f"ctx {ctx}: new session; the conversation ({n} tokens) is prefilled again with the next message")
        if self.transcript.think is ThinkMode.MAX:
            self.say(f"thinking mode: {self.transcript.effort.value}")

    def cmd_read(self, arg: str) -> None:
        if not arg:
            raise ChatCommandError("/read needs a file name")
        path = Path(os.path.expanduser(arg))
        if path.is_dir():
            raise ChatCommandError(f"/read {arg}: is a directory")
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_READ_BYTES + 1)
        except OSError as exc:
            raise ChatCommandError(f"/read {arg}: {exc.strerror or exc}") from None
        if len(data) > MAX_READ_BYTES:
            raise ChatCommandError(f"/read {arg}: larger than {MAX_READ_BYTES >> 20} MiB")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ChatCommandError(f"/read {arg}: not UTF-8 text (byte {exc.start})") from None
        if not text.strip():
            raise ChatCommandError(f"/read {arg}: the file is empty")
        self.turn(text)

    def _reset_transcript(self) -> None:
        self.transcript = ChatTranscript(self.engine.tokenizer, system=self.system, think=self.transcript.think,
                                         ctx=self.session.ctx, rules=self.engine.effort_rules)

    def cmd_reset(self, arg: str) -> None:
        self._no_arg("/reset", arg)
        self.session.reset()
        self.session.drop_checkpoints()
        self._reset_transcript()
        self.say("new conversation")

    # -- save / load -----------------------------------------------------------------------------------

    def _paths(self, cmd: str, name: str) -> tuple[Path, Path]:
        if not name:
            raise ChatCommandError(f"{cmd} needs a name")
        if not NAME_RE.match(name):
            raise ChatCommandError(f"{cmd}: a name is 1..100 letters, digits, '.', '_' or '-', not starting "
                                   f"with '.' or '-', got {name!r}")
        return self.chat_dir / f"{name}.json", self.chat_dir / f"{name}.session"

    def cmd_save(self, arg: str) -> None:
        meta_path, payload_path = self._paths("/save", arg)
        session, tokens = self.session, list(self.transcript.tokens)
        common = session.common_prefix(tokens)
        if common < session.pos:
            # The live state ran past the conversation (a turn stopped during its prefill): go back
            # to the shared prefix (the turn-start snapshot makes this a restore).
            session.rewind(common)
        try:
            self.chat_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new folder: the user's only
            if session.pos:
                _write_private(payload_path, session.save_payload)
            elif payload_path.is_symlink() or payload_path.exists():
                payload_path.unlink()  # an older save's state must not pair with this transcript
            doc = {"format": CHAT_FORMAT, "version": CHAT_VERSION, "model_id": self.engine.model_id.hex(),
                   "ctx": session.ctx, "think": self.transcript.think.value, "system": self.system,
                   "session_tokens": session.pos, "tokens": tokens}
            _write_private(meta_path, lambda fh: fh.write(json.dumps(doc).encode("utf-8")))
        except OSError as exc:
            raise ChatCommandError(f"/save {arg}: {exc.strerror or exc}") from None
        self.say(f"saved {arg}: {len(tokens)} tokens of conversation ({session.pos} in the KV state) "
                 f"in {meta_path}")

    def _read_meta(self, name: str, path: Path) -> dict:
        try:
            with open(path, "rb") as fh:
                raw = fh.read(MAX_CHAT_JSON_BYTES + 1)
        except FileNotFoundError:
            raise ChatCommandError(f"/load: no saved chat {name!r} in {self.chat_dir}") from None
        except OSError as exc:
            raise ChatCommandError(f"/load {name}: {exc.strerror or exc}") from None
        if len(raw) > MAX_CHAT_JSON_BYTES:
            raise ChatCommandError(f"/load {name}: {path} is larger than {MAX_CHAT_JSON_BYTES >> 20} MiB")
        try:
            doc = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ChatCommandError(f"/load {name}: {path} is not valid JSON ({exc})") from None
        bad = f"/load {name}: {path} is not a saved chat"
        if not isinstance(doc, dict) or doc.get("format") != CHAT_FORMAT:
            raise ChatCommandError(bad)
        if doc.get("version") != CHAT_VERSION:
            raise ChatCommandError(f"{bad} of version {CHAT_VERSION} (it says {doc.get('version')!r})")
        if doc.get("model_id") != self.engine.model_id.hex():
            raise ChatCommandError(f"/load {name}: saved with another model")
        ctx, n_kv, tokens = doc.get("ctx"), doc.get("session_tokens"), doc.get("tokens")
        if not _is_int(ctx) or not 2 <= ctx <= self.engine.context_length:
            raise ChatCommandError(f"{bad}: ctx {ctx!r} is not in 2..{self.engine.context_length}")
        n_vocab = self.engine.config.n_vocab
        if (not isinstance(tokens, list) or not tokens or len(tokens) >= ctx
                or not all(_is_int(t) and 0 <= t < n_vocab for t in tokens)):
            raise ChatCommandError(f"{bad}: 'tokens' must be 1..{ctx - 1} token ids below {n_vocab}")
        if not _is_int(n_kv) or not 0 <= n_kv <= len(tokens):
            raise ChatCommandError(f"{bad}: 'session_tokens' must be in 0..{len(tokens)}")
        if doc.get("think") not in [m.value for m in ThinkMode]:
            raise ChatCommandError(f"{bad}: 'think' must be none, low, high or max")
        if doc.get("system") is not None and not isinstance(doc["system"], str):
            raise ChatCommandError(f"{bad}: 'system' must be a string")
        return doc

    def cmd_load(self, arg: str) -> None:
        meta_path, payload_path = self._paths("/load", arg)
        doc = self._read_meta(arg, meta_path)
        ctx, tokens, n_kv = doc["ctx"], doc["tokens"], doc["session_tokens"]
        transcript = ChatTranscript.from_tokens(self.engine.tokenizer, tokens, doc["think"], ctx,
                                                rules=self.engine.effort_rules)
        # A fresh session, so a payload that fails to load leaves the current chat as it was.
        session = self._new_session(ctx)
        if n_kv:
            n = session.load_payload_file(payload_path)
            if session.tokens != tokens[:n]:
                raise ChatCommandError(f"/load {arg}: {payload_path.name} does not hold this conversation's tokens")
        disk = self._open_disk_cache(ctx) if self.args.kv_disk_dir and ctx != self.session.ctx else self.disk
        self.session, self.transcript, self.disk = session, transcript, disk
        self.system = doc.get("system") or ""
        self.say(f"loaded {arg}: {len(tokens)} tokens of conversation ({session.pos} in the KV state), "
                 f"ctx {ctx}, thinking {transcript.effective_think.value}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
