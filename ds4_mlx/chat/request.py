"""API request -> prompt ids: the one renderer shared by ``ds4-mlx serve`` and
``ds4-mlx tokenize --messages`` so both prefill exactly the same ids (:func:`encode_request`,
:func:`openai_body_ids`; injection-safe: request text never becomes a control token).  The text
form (:func:`render_request`) is ds4's rendered string, for text-prefix cache keys and tests.

Also the thinking controls of the request bodies [ds4_server.c parse_thinking_controls]:
``thinking`` ({"type":"enabled"|"disabled"} or a bool), ``think`` (bool), ``reasoning_effort``,
``output_config.effort`` / ``reasoning.effort``, and the model aliases ``deepseek-chat`` (off) and
``deepseek-reasoner`` (on) when no explicit control is present.  The effort names and the default
level are the loaded checkpoint's (``chat/effort.py``): pass its ``EffortRules``; the preview's
(ds4's) are the default.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ds4_mlx.chat.effort import PREVIEW_RULES, Effort, EffortRules
from ds4_mlx.chat.pieces import PieceTokenizer
from ds4_mlx.chat.template import ThinkMode, encode_messages, render_messages
from ds4_mlx.errors import ChatError

# Thinking off / on (at the checkpoint's default level) when a request has no explicit control.
MODEL_ALIASES = {"deepseek-chat": False, "deepseek-reasoner": True}


def _effort(value, where: str, rules: EffortRules) -> ThinkMode:
    if not isinstance(value, str):
        raise ChatError(f"{where} must be a string")
    return rules.from_name(value, where)


def requested_think_mode(body: Mapping, rules: EffortRules = PREVIEW_RULES) -> ThinkMode:
    """The thinking level a request asks for under ``rules``, before the context check (the top
    level needs 393216 tokens of context; ``rules.effort`` applies that)."""
    enabled: bool | None = None
    effort: ThinkMode | None = None
    thinking = body.get("thinking")
    if isinstance(thinking, bool):
        enabled = thinking
    elif isinstance(thinking, Mapping):
        kind = thinking.get("type")
        if kind in ("enabled", "adaptive"):
            enabled = True
        elif kind == "disabled":
            enabled = False
        elif kind is not None:
            raise ChatError(f"thinking.type must be enabled or disabled, got {kind!r}")
    elif thinking is not None:
        raise ChatError("thinking must be an object or a boolean")
    think = body.get("think")
    if think is not None:
        if not isinstance(think, bool):
            raise ChatError("think must be a boolean")
        enabled = think
    if body.get("reasoning_effort") is not None:
        effort = _effort(body["reasoning_effort"], "reasoning_effort", rules)
    for key in ("output_config", "reasoning"):
        sub = body.get(key)
        if sub is None:
            continue
        if not isinstance(sub, Mapping):
            raise ChatError(f"{key} must be an object")
        if sub.get("effort") is not None:
            effort = _effort(sub["effort"], f"{key}.effort", rules)
    if enabled is None and effort is None:
        model = body.get("model")
        enabled = MODEL_ALIASES.get(model, True) if isinstance(model, str) else True
    if enabled is False or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    return rules.default if effort is None else effort


def render_request(messages: Sequence[Mapping], tools=None, tool_choice="auto",
                   think: ThinkMode | str = ThinkMode.HIGH, ctx: int = 32768) -> str:
    """The rendered prompt text for a chat request (ds4's string, byte for byte); ``tool_choice``
    "none" drops the tools prompt as ds4 does.  For the ids use :func:`encode_request`, not
    ``Tokenizer.encode_rendered`` of this text (that lets request text inject control tokens)."""
    if tool_choice == "none":
        tools = None
    return render_messages(messages, tools=tools or None, think=think, ctx=ctx)


def encode_request(tokenizer: PieceTokenizer, messages: Sequence[Mapping], tools=None,
                   tool_choice="auto", think: ThinkMode | str = ThinkMode.HIGH,
                   ctx: int = 32768) -> list[int]:
    """The prompt ids of :func:`render_request`: template markers as control tokens, request
    text as plain BPE.  Equal to ``encode_rendered(render_request(...))`` when no request text
    holds a special string."""
    if tool_choice == "none":
        tools = None
    return encode_messages(tokenizer, messages, tools=tools or None, think=think, ctx=ctx)


def _openai_body_args(body: Mapping, ctx: int, think, rules: EffortRules):
    if not isinstance(body, Mapping):
        raise ChatError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatError("missing messages (a non-empty array)")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatError("tools must be an array")
    mode = think if isinstance(think, Effort) else \
        rules.effort(requested_think_mode(body, rules) if think is None else think, ctx)
    return messages, tools, body.get("tool_choice", "auto"), mode


def openai_body_prompt(body: Mapping, *, ctx: int = 32768, think: ThinkMode | str | Effort | None = None,
                       rules: EffortRules = PREVIEW_RULES) -> tuple[str, Effort]:
    """Rendered prompt text and effective thinking mode for an OpenAI chat-completions body
    (``messages``, ``tools``, ``tool_choice`` and the thinking controls); ``think`` overrides the
    body's controls."""
    messages, tools, choice, mode = _openai_body_args(body, ctx, think, rules)
    return render_request(messages, tools, choice, mode, ctx), mode


def openai_body_ids(tokenizer: PieceTokenizer, body: Mapping, *, ctx: int = 32768,
                    think: ThinkMode | str | Effort | None = None,
                    rules: EffortRules = PREVIEW_RULES) -> tuple[list[int], Effort]:
    """The ids ``ds4-mlx serve`` prefills for an OpenAI chat-completions body (see
    :func:`openai_body_prompt`), and the effective thinking mode."""
    messages, tools, choice, mode = _openai_body_args(body, ctx, think, rules)
    return encode_request(tokenizer, messages, tools, choice, mode, ctx), mode
