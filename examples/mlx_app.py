"""Embedding ds4-mlx in an app: generation on a worker thread, a UI loop on the main thread.

MLX streams belong to the thread that creates them: a model loaded on one thread fails on another
("There is no Stream(cpu, 0) in current thread"). So the worker thread *loads* the model and runs
every generation; the UI thread never touches it. They talk through two queues: prompts go in,
plain Python events (``ds4_mlx.GenerationEvent``: text, token ids, stats; no MLX arrays) come out.
The UI loop renders them as they arrive and can cancel an answer (key ``q`` on a terminal, Ctrl-C,
or ``--timeout``) through a ``threading.Event`` that the generation loop checks before every token.

    python examples/mlx_app.py                          # the generated tiny random model (random text)
    python examples/mlx_app.py --model PATH.gguf -p "Hello" -p "And then?" --timeout 30

Each ``-p`` is one user turn of the same conversation; the worker keeps one session, so a later turn
computes only its new tokens (the stats line says how many were cached).
"""

from __future__ import annotations

import argparse
import os
import queue
import select
import sys
import threading
import time
import traceback
from pathlib import Path

import ds4_mlx
from ds4_mlx.engine.engine import end_model_thread
from ds4_mlx.errors import Ds4Error

DIM, RESET = "\x1b[2m", "\x1b[0m"


class Worker(threading.Thread):
    """Owns the model: loads it, then serves prompts one at a time until ``close()``.

    Out on ``events``: ("ready", description), ("event", GenerationEvent) for each event of an answer
    (the last one of an answer has kind "done"), ("error", one line) for a request that failed,
    ("fatal", text) when the worker stopped, ("closed", None) when it has released the model.
    """

    def __init__(self, model_path: str, *, ctx: int, **options):
        super().__init__(name="ds4-mlx-worker", daemon=True)
        self.model_path, self.ctx, self.options = model_path, ctx, options
        self.requests: queue.Queue[str | None] = queue.Queue()
        self.events: queue.Queue[tuple[str, object]] = queue.Queue()
        self.cancel = threading.Event()

    def submit(self, prompt: str) -> None:
        self.cancel.clear()
        self.requests.put(prompt)

    def close(self) -> None:
        self.cancel.set()
        self.requests.put(None)

    def run(self) -> None:
        try:
            self._serve()
        except Ds4Error as exc:
            self.events.put(("fatal", str(exc)))
        except Exception:  # the UI must hear of it, or it would wait forever
            self.events.put(("fatal", traceback.format_exc()))
        finally:
            end_model_thread()  # free the MLX objects and end the streams here, on the thread that made them
            self.events.put(("closed", None))

    def _serve(self) -> None:
        model = ds4_mlx.load(self.model_path)
        session = model.new_session(ctx=self.ctx)
        self.events.put(("ready", repr(model)))
        messages: list[dict] = []
        while (prompt := self.requests.get()) is not None:
            messages.append({"role": "user", "content": prompt})
            result = None
            try:
                for event in ds4_mlx.stream_generate(model, messages, session=session, cancel=self.cancel,
                                                     **self.options):
                    self.events.put(("event", event))
                    result = event.result
            except Ds4Error as exc:  # e.g. the conversation outgrew the context: report, keep serving
                messages.pop()
                self.events.put(("error", str(exc)))
                continue
            messages.append({"role": "assistant", "content": result.content})
        del model, session


class Keys:
    """Single key presses from a terminal without Enter (cbreak mode, restored on exit); nothing
    when stdin is not a terminal."""

    def __init__(self):
        self.fd = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
        self.saved = None

    def __enter__(self):
        if self.fd is not None:
            import termios
            import tty

            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)  # keeps ISIG: Ctrl-C still raises KeyboardInterrupt
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)

    def pressed(self) -> str:
        if self.fd is None or not select.select([self.fd], [], [], 0)[0]:
            return ""
        return os.read(self.fd, 32).decode(errors="replace")


def wait_ready(worker: Worker) -> bool:
    """Block until the worker has loaded the model; False (after printing why) when it could not."""
    tag, item = worker.events.get()
    if tag == "ready":
        print(f"[model] {item}", file=sys.stderr)
        return True
    print(f"mlx_app: {item}".rstrip(), file=sys.stderr)
    return False


def answer(worker: Worker, prompt: str, timeout: float | None, color: bool) -> str | None:
    """Send one prompt and render its events until "done"; returns the finish reason (None: failed)."""
    worker.submit(prompt)
    deadline = None if timeout is None else time.monotonic() + timeout
    dim = False
    with Keys() as keys:
        while True:
            try:
                if "q" in keys.pressed() or (deadline is not None and time.monotonic() > deadline):
                    worker.cancel.set()
                tag, item = worker.events.get(timeout=0.05)
            except queue.Empty:
                continue
            except KeyboardInterrupt:
                worker.cancel.set()  # stop this answer; its "done" event still comes, with the stats
                continue
            if tag in ("error", "fatal"):
                print(f"\nmlx_app: {item}".rstrip(), file=sys.stderr)
                return None
            if tag != "event":
                continue
            event = item
            if event.kind in ("reasoning", "content", "tool_call"):
                if color and (event.kind == "reasoning") != dim:
                    dim = not dim
                    sys.stdout.write(DIM if dim else RESET)
                sys.stdout.write(event.text)
                sys.stdout.flush()
            elif event.kind == "notice":
                print(f"\n[notice] {event.text}", file=sys.stderr)
            elif event.kind == "done":
                print(RESET if dim else "")
                print(f"[{event.finish_reason}] {event.stats.summary()}", flush=True)
                return event.finish_reason


def model_path(spec: str) -> str:
    """``tiny``: the random-weight model ``ds4-mlx demo`` generates (once) into its cache folder."""
    if spec != "tiny":
        return spec
    from ds4_mlx.frontends.cmd_demo import default_cache_dir, ensure_demo_model

    return str(ensure_demo_model(default_cache_dir()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Stream ds4-mlx generations from a worker thread into a terminal UI.")
    ap.add_argument("--model", default="tiny",
                    help="GGUF path, hf:REPO/FILE, or 'tiny' (default): the generated random-weight demo model")
    ap.add_argument("-p", "--prompt", action="append",
                    help="a user turn (repeat for a conversation; default: one demo question)")
    ap.add_argument("-n", "--tokens", type=int, default=32, help="maximum tokens per answer (default 32)")
    ap.add_argument("--ctx", type=int, default=4096, help="session context in tokens (default 4096)")
    ap.add_argument("--temp", type=float, default=0.0, help="temperature (default 0: greedy)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--think", action="store_true", help="let the model think first (default: answer directly)")
    ap.add_argument("--timeout", type=float, default=None, help="cancel an answer after this many seconds")
    args = ap.parse_args(argv)
    if args.tokens < 0 or args.ctx < 2 or (args.timeout is not None and args.timeout < 0):
        ap.error("--tokens, --ctx and --timeout must be positive")
    try:
        path = model_path(args.model)
    except Ds4Error as exc:
        print(f"mlx_app: {exc}", file=sys.stderr)
        return 1
    if not path.startswith("hf:") and not Path(path).is_file():
        print(f"mlx_app: no model file at {path}", file=sys.stderr)
        return 1

    worker = Worker(path, ctx=args.ctx, max_tokens=args.tokens, temperature=args.temp, seed=args.seed,
                    think=args.think)
    worker.start()
    code = 0
    try:
        if not wait_ready(worker):
            return 1
        for prompt in args.prompt or ["Write one sentence about the sea."]:
            print(f"> {prompt}", flush=True)
            if answer(worker, prompt, args.timeout, sys.stdout.isatty()) is None:
                code = 1
    finally:
        worker.close()
        worker.join(timeout=60)  # it stops at the next token: cancel is set
    return code


if __name__ == "__main__":
    sys.exit(main())
