"""`ds4-mlx tokenize -m MODEL (--text T | --file F) [--chat] ... [--json]`: show a tokenization.

Only the GGUF's tokenizer metadata is read; no weights are touched.

Without ``--chat`` the text is tokenized as a rendered prompt: ds4's 7 special strings (BOS, EOS,
``<｜User｜>``, ``<｜Assistant｜>``, ``<think>``, ``</think>``, ``｜DSML｜``) become their ids, the rest
is BPE (like ds4 ``--dump-tokens``). With ``--chat`` the text is the user message of ds4's CLI chat
template (BOS, system text, User, text, Assistant, think tag).

Output: one ``ID<TAB>PIECE`` line per token, PIECE being the Python repr of the token's text (a
``str``, or ``bytes`` when the token is not valid UTF-8 on its own, e.g. half an emoji).
``--json`` prints ``{"ids": [...], "pieces": [...]}`` instead, pieces as text with bytes that are not
valid UTF-8 written ``\\xNN``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ds4_mlx.chat.template import DEFAULT_CTX, DEFAULT_SYSTEM, encode_chat_prompt
from ds4_mlx.errors import TokenizerError
from ds4_mlx.frontends.args import CTX, add_think_options, read_text_file

APIS = ("chat", "completions", "messages", "responses")  # the server's parse.PARSERS (loaded in run())

if TYPE_CHECKING:  # the reader (numpy, regex) loads in run(): `ds4-mlx --help` builds every parser
    from ds4_mlx.tokenizer import Tokenizer


def register(subparsers) -> None:
    p = subparsers.add_parser("tokenize", help="show token ids and pieces of a text",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", required=True, help="DS4 Flash GGUF file (only its tokenizer is read)")
    p.add_argument("--checkpoint", choices=["preview", "0731"], default=None,
                   help="the file's checkpoint, when its name and metadata do not say (its thinking levels)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize")
    src.add_argument("--file", help="read the text from this file (UTF-8)")
    src.add_argument("--messages", metavar="REQUEST.json",
                     help="a request body (messages, tools, tool_choice, thinking controls; the API "
                          "--api names): print the ids `ds4-mlx serve` would prefill for it")
    p.add_argument("--api", choices=APIS, default="chat",
                   help="--messages: the body's API: chat (OpenAI chat completions, default), "
                        "messages (Anthropic), responses (OpenAI Responses), completions")
    p.add_argument("--chat", action="store_true", help="wrap the text in ds4's CLI chat template")
    p.add_argument("-sys", "--system", default=None,
                   help=f'--chat: system text (default "{DEFAULT_SYSTEM}"; "" for none)')
    add_think_options(p, help_prefix="--chat: ")
    p.add_argument("--ctx", action=CTX, default=DEFAULT_CTX, metavar="N",
                   help=f"--chat: context size deciding Think Max (default {DEFAULT_CTX})")
    p.add_argument("--json", action="store_true", help='print {"ids": [...], "pieces": [...]}')
    p.set_defaults(func=run)


def _read_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    return read_text_file(args.file, "--file")


def _read_request(path: str):
    try:
        with open(path, "rb") as fh:
            return json.loads(fh.read())
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise TokenizerError(f"{path}: not a JSON request body ({str(exc).splitlines()[0]})") from None


def tokenize_request(tok: Tokenizer, args: argparse.Namespace, rules=None) -> list[int]:
    """The server's renderer (one function shared with ``serve``), then its tokenization; an
    Anthropic / Responses / completions body goes through the server's own parser first (the
    conversion of its transcript to messages is part of what the server prefills)."""
    from ds4_mlx.chat.effort import PREVIEW_RULES
    from ds4_mlx.chat.request import encode_request, openai_body_ids

    rules = rules or PREVIEW_RULES
    body = _read_request(args.messages)
    # an explicit --nothink / --think-LEVEL overrides; otherwise the body's own thinking controls decide
    think = None if args.think is True else args.think
    if args.api == "chat":
        ids, _ = openai_body_ids(tok, body, ctx=args.ctx, think=think, rules=rules)
        return ids
    from ds4_mlx.frontends.server import parse
    from ds4_mlx.frontends.server.http_errors import ApiError

    try:
        req = parse.PARSERS[args.api](body, parse.Limits(ctx=args.ctx, effort_rules=rules), {}).request
    except ApiError as exc:
        raise TokenizerError(f"{args.messages}: {exc.message}") from None
    mode = rules.effort(think, args.ctx) if think is not None else req.think
    return encode_request(tok, req.messages, req.tools, req.tool_choice, mode, args.ctx)


def tokenize_args(tok: Tokenizer, text: str, args: argparse.Namespace, rules=None) -> list[int]:
    from ds4_mlx.chat.effort import PREVIEW_RULES

    if not args.chat:
        return tok.encode_rendered(text)
    system = DEFAULT_SYSTEM if args.system is None else args.system
    effort = (rules or PREVIEW_RULES).effort(args.think, args.ctx)
    return encode_chat_prompt(tok, text, system=system, think=effort, ctx=args.ctx)


def piece_repr(data: bytes) -> str:
    try:
        return repr(data.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(data)


def run(args: argparse.Namespace) -> int:
    from ds4_mlx.chat.effort import RULES
    from ds4_mlx.formats.checkpoint import detect_checkpoint
    from ds4_mlx.formats.gguf import GGUFFile
    from ds4_mlx.tokenizer import Tokenizer

    text = None if args.messages is not None else _read_text(args)
    with GGUFFile(args.model) as f:
        tok = Tokenizer.from_gguf(f)
        # the checkpoint's thinking levels, as a loaded model would read them
        info = detect_checkpoint(f.metadata, args.model, getattr(args, "checkpoint", None))
    rules = RULES[info.checkpoint]
    ids = tokenize_request(tok, args, rules) if text is None else tokenize_args(tok, text, args, rules)
    out = sys.stdout
    if args.json:
        pieces = [tok.token_text(i).decode("utf-8", errors="backslashreplace") for i in ids]
        json.dump({"ids": ids, "pieces": pieces}, out, ensure_ascii=False)
        out.write("\n")
    else:
        for i in ids:
            out.write(f"{i}\t{piece_repr(tok.token_text(i))}\n")
    return 0
