"""DS4 chat prompts: thinking modes, the CLI token-level template and the server text template.

Two forms exist in ds4 and both are reproduced byte for byte:

* CLI / library form [encode_chat_prompt, ds4_chat_append_message,
  ds4_chat_append_assistant_prefix]: built directly as token ids; system and user text go through
  plain BPE, so special-token strings typed by a user stay ordinary text.
* Server form [ds4_server.c render_chat_prompt_text]: a rendered string (tool prompt, DSML history,
  ``<tool_result>`` blocks).  ds4 tokenizes that string with special-string recognition
  (``Tokenizer.encode_rendered``), so special strings typed in request text become control tokens.
  The renderers here build typed pieces (``chat/pieces.py``): ``render_*`` join them into ds4's
  text byte for byte; ``encode_messages`` / ``encode_tail`` / ``encode_assistant_suffix`` give the
  ids, which equal ds4's whenever the request text holds no special string, and never let request
  text become a control token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ds4_mlx.chat import json_text
from ds4_mlx.chat.dsml import (
    THINK_CLOSE,
    THINK_OPEN,
    json_dumps_compact,
    request_tool_calls,
    tool_call_pieces,
)
from ds4_mlx.chat.effort import (
    ABSOLUTE_MAX_PREFIX,
    PREVIEW_RULES,
    THINK_MAX_MIN_CONTEXT,
    Effort,
    EffortRules,
    ThinkMode,
    as_effort,
)
from ds4_mlx.chat.effort import as_mode as _as_mode
from ds4_mlx.chat.messages import ToolCall
from ds4_mlx.chat.pieces import Piece, PieceTokenizer, ctl, encode_pieces, join, txt
from ds4_mlx.errors import ChatError
from ds4_mlx.formats import config

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

DEFAULT_SYSTEM = "You are a helpful assistant"
DEFAULT_CTX = config.DEFAULT_CTX  # ds4's CLI context; defined with the model config (the memory plan sizes KV at it)
# The preview's Think Max paragraph (ds4's DS4_REASONING_EFFORT_MAX_PREFIX); chat/effort.py has
# every checkpoint's prefixes.
MAX_EFFORT_PREFIX = ABSOLUTE_MAX_PREFIX

TOOLS_PROMPT = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    "You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as raw text and set `string=\"true\"`. "
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters "
    "with XML or HTML entity escapes. "
    "Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, "
    "write that tag as `&lt;/｜DSML｜parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    "`string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_SUFFIX = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls. Use the exact parameter names from the schemas."
)

TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"


# --------------------------------------------------------------------------------------------
# Thinking modes


def resolve_think_mode(mode: ThinkMode | str, ctx: int) -> ThinkMode:
    """Under ds4's (the preview's) rules: MAX becomes HIGH below 393216 tokens of context
    [ds4_think_mode_for_context]. A checkpoint's own rules: ``EffortRules.effort``."""
    return PREVIEW_RULES.effort(mode, ctx).mode


def think_mode_from_effort(name: str) -> ThinkMode:
    """API ``reasoning_effort`` names [parse_reasoning_effort_name]: only HIGH and MAX exist above
    zero, so every lower non-zero effort collapses to HIGH."""
    if name == "max":
        return ThinkMode.MAX
    if name in ("xhigh", "high", "medium", "low", "minimal"):
        return ThinkMode.HIGH
    if name == "none":
        return ThinkMode.NONE
    raise ChatError(f"unknown reasoning_effort {name!r}")


def think_mode_from_enabled(enabled: bool, effort: ThinkMode) -> ThinkMode:
    """Combine an on/off thinking switch with an effort level [think_mode_from_enabled]."""
    if not enabled or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    return ThinkMode.MAX if effort is ThinkMode.MAX else ThinkMode.HIGH


# --------------------------------------------------------------------------------------------
# CLI / library form (token ids)


class ChatTokenizer(Protocol):
    bos_id: int
    eos_id: int
    special_ids: Mapping[str, int]

    def encode(self, text: str) -> list[int]: ...


def _special_id(tokenizer: ChatTokenizer, text: str) -> int:
    try:
        return int(tokenizer.special_ids[text])
    except (KeyError, TypeError):
        raise ChatError(f"tokenizer has no id for special token {text!r}") from None


def chat_begin(tokenizer: ChatTokenizer) -> list[int]:
    return [tokenizer.bos_id]


def append_max_effort_prefix(tokenizer: ChatTokenizer, tokens: list[int]) -> None:
    tokens.extend(tokenizer.encode(MAX_EFFORT_PREFIX))


def append_message(tokenizer: ChatTokenizer, tokens: list[int], role: str, content: str) -> None:
    """Library message append [ds4_chat_append_message]; content is plain BPE.

    system/developer: the raw text; assistant: marker, ``</think>`` unless the content itself
    starts with a think tag, then the text; tool/function: a user turn prefixed ``Tool: `` (the
    server uses ``<tool_result>`` instead); any other role: a user turn."""
    if role in ("system", "developer"):
        tokens.extend(tokenizer.encode(content))
    elif role == "assistant":
        tokens.append(_special_id(tokenizer, ASSISTANT))
        if not (content.startswith(THINK_OPEN) or content.startswith(THINK_CLOSE)):
            tokens.append(_special_id(tokenizer, THINK_CLOSE))
        tokens.extend(tokenizer.encode(content))
    else:
        tokens.append(_special_id(tokenizer, USER))
        if role in ("tool", "function"):
            tokens.extend(tokenizer.encode("Tool: "))
        tokens.extend(tokenizer.encode(content))


def append_assistant_prefix(tokenizer: ChatTokenizer, tokens: list[int], think: ThinkMode | str) -> None:
    """``<｜Assistant｜>`` then ``<think>`` (thinking) or ``</think>``
    [ds4_chat_append_assistant_prefix]."""
    tokens.append(_special_id(tokenizer, ASSISTANT))
    tokens.append(_special_id(tokenizer, THINK_OPEN if _as_mode(think).enabled else THINK_CLOSE))


def encode_chat_prompt(tokenizer: ChatTokenizer, user_text: str, system: str | None = DEFAULT_SYSTEM,
                       think: ThinkMode | str | Effort = ThinkMode.HIGH, ctx: int = DEFAULT_CTX) -> list[int]:
    """One-shot CLI prompt [encode_chat_prompt]: BOS, [effort prefix], [system], User, user text,
    Assistant, ``<think>``/``</think>``.  ``system`` empty or None means no system text.  ``think``:
    an Effort (a checkpoint's rules applied), or a level under the preview's rules."""
    effort = as_effort(think, ctx)
    tokens = chat_begin(tokenizer)
    if effort.prefix:
        tokens.extend(tokenizer.encode(effort.prefix))
    if system:
        tokens.extend(tokenizer.encode(system))
    tokens.append(_special_id(tokenizer, USER))
    tokens.extend(tokenizer.encode(user_text))
    append_assistant_prefix(tokenizer, tokens, effort.mode)
    return tokens


def encode_next_turn(tokenizer: ChatTokenizer, user_text: str, think: ThinkMode | str | Effort = ThinkMode.HIGH,
                     ctx: int = DEFAULT_CTX) -> list[int]:
    """Tokens the CLI appends after a generated assistant turn to start the next one: EOS, User,
    user text, Assistant, think tag.  (A change into or out of Think Max also moves the prefix
    after BOS; :class:`ChatTranscript` handles that.)"""
    tokens = [tokenizer.eos_id]
    append_message(tokenizer, tokens, "user", user_text)
    append_assistant_prefix(tokenizer, tokens, as_effort(think, ctx).mode)
    return tokens


class ChatTranscript:
    """Multi-turn CLI conversation as one growing token list [ds4_cli.c repl chat].

    Generated tokens (reasoning included) are kept verbatim, and each finished assistant turn is
    closed with EOS, so every new turn extends the previous prompt and the KV cache is reused.  The
    effort prefix (the checkpoint's text for the level in effect, ``rules``) lives right after BOS
    and is inserted, swapped or removed when the effective level changes (which invalidates any
    cache of this transcript)."""

    def __init__(self, tokenizer: ChatTokenizer, system: str | None = DEFAULT_SYSTEM,
                 think: ThinkMode | str = ThinkMode.HIGH, ctx: int = DEFAULT_CTX,
                 rules: EffortRules = PREVIEW_RULES) -> None:
        self.tokenizer = tokenizer
        self.rules = rules
        self.think = rules.default if think is True else _as_mode("none" if think is False else think)
        self.ctx = ctx
        self.tokens = chat_begin(tokenizer)
        self._prefix: list[int] = []
        self._turn_start: int | None = None
        self._apply_prefix(self.effort)
        if system:
            append_message(tokenizer, self.tokens, "system", system)

    @classmethod
    def from_tokens(cls, tokenizer: ChatTokenizer, tokens: Sequence[int], think: ThinkMode | str = ThinkMode.HIGH,
                    ctx: int = DEFAULT_CTX, rules: EffortRules = PREVIEW_RULES) -> "ChatTranscript":
        """Continue a saved transcript (``tokens`` taken from ``.tokens`` between turns, so it starts
        with BOS); an effort prefix of ``rules`` right after BOS is recognised, so later level
        changes can swap or remove it as they would have in the original conversation."""
        tokens = [int(t) for t in tokens]
        if not tokens or tokens[0] != tokenizer.bos_id:
            raise ChatError("a chat transcript must start with the BOS token")
        out = cls(tokenizer, system=None, think=ThinkMode.NONE, ctx=ctx, rules=rules)
        out.think = _as_mode(think)
        for text in sorted(set(rules.prefixes.values()), key=len, reverse=True):
            prefix = tokenizer.encode(text)
            if tokens[1:1 + len(prefix)] == prefix:
                out._prefix = prefix
                break
        out.tokens = tokens
        return out

    @property
    def effort(self) -> Effort:
        return self.rules.effort(self.think, self.ctx)

    @property
    def effective_think(self) -> ThinkMode:
        return self.effort.mode

    def _apply_prefix(self, effort: Effort) -> None:
        want = self.tokenizer.encode(effort.prefix) if effort.prefix else []
        if want != self._prefix:
            self.tokens[1:1 + len(self._prefix)] = want
            self._prefix = want

    def begin_turn(self, user_text: str) -> list[int]:
        """Append the user turn and the assistant prefix; returns the whole prompt to evaluate."""
        effort = self.effort
        self._apply_prefix(effort)
        mode = effort.mode
        self._turn_start = len(self.tokens)
        append_message(self.tokenizer, self.tokens, "user", user_text)
        append_assistant_prefix(self.tokenizer, self.tokens, mode)
        return list(self.tokens)

    def append_generated(self, token_ids: Iterable[int]) -> None:
        self.tokens.extend(int(t) for t in token_ids)

    def end_turn(self) -> None:
        """Close the assistant turn with EOS (the sampled EOS itself is never appended)."""
        self.tokens.append(self.tokenizer.eos_id)
        self._turn_start = None

    def abort_turn(self) -> None:
        """Forget the current turn (interrupted before any token was generated)."""
        if self._turn_start is not None:
            del self.tokens[self._turn_start:]
            self._turn_start = None


# --------------------------------------------------------------------------------------------
# Server form (rendered text)


def content_text(value) -> str:
    """Message content as ds4 reads it [json_content]: a string; or the concatenation of a list's
    strings and ``text`` fields (other parts skipped, no separators); anything else is empty."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""
    out: list[str] = []
    for part in value:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, Mapping) and "text" in part:
            text = part["text"]
            if not isinstance(text, str):
                raise ChatError(f"content part 'text' must be a string, got {type(text).__name__}")
            out.append(text)
    return "".join(out)


def escape_tool_result(text: str) -> str:
    """Tool output is data: only the wrapper's own closing tag is escaped [append_tool_result_text]."""
    return text.replace(TOOL_RESULT_CLOSE, "&lt;" + TOOL_RESULT_CLOSE[1:])


def _decoded_members(raw: str, string_keys: Sequence[str], raw_keys: Mapping[str, str]) -> dict | None:
    """Selected members of a tool object: string-valued keys decoded, ``raw_keys`` (key -> slot;
    aliases share a slot, the later member winning as in ds4) kept as raw JSON text.  None when the
    object does not scan or a string-valued key holds something else (ds4 gives up then)."""
    members, failed = json_text.object_members_raw(raw)
    if failed:
        return None
    out: dict[str, str] = {}
    for key, value in members:
        if key in string_keys:
            decoded = json_text.scan_string(value, 0)
            if decoded is None:
                return None
            out[key] = decoded[0]
        elif key in raw_keys:
            out[raw_keys[key]] = value
    return out


def _openai_function(raw: str) -> str | None:
    """Inner object of ``{"type":"function","function":{...}}`` [openai_function_schema_from_tool]."""
    members, _ = json_text.object_members_raw(raw)
    for key, value in members:
        if key == "function":
            return value
    return None


_EMPTY_PARAMETERS = '{"type":"object","properties":{}}'


def _namespace_functions(raw: str) -> list[str]:
    """Responses ``{"type":"namespace","name":N,"tools":[...]}`` flattened to one function schema
    per tool, named N+tool [append_responses_namespace_tool_schemas]."""
    top = _decoded_members(raw, ("type", "name"), {"tools": "tools"})
    if not top or top.get("type") != "namespace" or "name" not in top or "tools" not in top:
        return []
    namespace = top["name"]
    items, _ = json_text.array_items_raw(top["tools"])
    lines = []
    for item in items:
        fn = _decoded_members(item, ("type", "name", "description"),
                              {"parameters": "parameters", "input_schema": "parameters"})
        if fn is None or fn.get("type", "function") != "function" or not fn.get("name"):
            continue
        lines.append('{"name":' + json_text.escape(namespace + fn["name"])
                     + ',"description":' + json_text.escape(fn.get("description", ""))
                     + ',"parameters":' + fn.get("parameters", _EMPTY_PARAMETERS) + "}")
    return lines


def _tool_search(raw: str) -> str | None:
    """Responses ``{"type":"tool_search",...}`` as a callable schema [responses_special_schema_from_tool]."""
    fields = _decoded_members(raw, ("type", "description"), {"parameters": "parameters"})
    if fields is None or fields.get("type") != "tool_search":
        return None
    return ('{"name":"tool_search","description":'
            + json_text.escape(fields.get("description", "Search available tools."))
            + ',"parameters":' + fields.get("parameters", _EMPTY_PARAMETERS) + "}")


def render_tool_schemas(tools) -> str:
    """The schema lines of the tools prompt [parse_tools_value]: one JSON object per line, OpenAI
    wrappers unwrapped to the inner function object, Anthropic-style and other objects kept as sent.

    ``tools`` is the raw JSON text of the request's array, or a list whose items are raw JSON text
    (kept byte for byte) or decoded objects (re-serialised compactly: the client's own spelling is
    unknown once decoded)."""
    if tools is None:
        return ""
    if isinstance(tools, str):
        items, ok = json_text.array_items_raw(tools)
        if not ok:
            raise ChatError("tools must be a JSON array of tool objects")
    elif isinstance(tools, (list, tuple)):
        items = []
        for t in tools:
            if isinstance(t, str):
                rv = json_text.raw_value(t, 0)
                if rv is None:
                    raise ChatError(f"tool is not valid JSON: {t[:80]!r}")
                items.append(rv[0])
            elif isinstance(t, Mapping):
                items.append(json_dumps_compact(t))
            else:
                raise ChatError(f"tool must be an object or JSON text, got {type(t).__name__}")
    else:
        raise ChatError(f"tools must be a list, got {type(tools).__name__}")
    lines: list[str] = []
    for raw in items:
        fn = _openai_function(raw)
        if fn is not None:
            lines.append(fn)
            continue
        ns = _namespace_functions(raw)
        if ns:
            lines.extend(ns)
            continue
        special = _tool_search(raw)
        lines.append(special if special is not None else raw)
    return "\n".join(line for line in lines if line)


def tools_prompt(schemas: str) -> str:
    """The tools section of the system text, or "" without schemas [append_tools_prompt_text]."""
    return join(_tools_prompt_pieces(schemas))


def _tools_prompt_pieces(schemas: str) -> list[Piece]:
    # The schemas are the client's JSON: text, even where they spell a marker.
    return [ctl(TOOLS_PROMPT), txt(schemas), ctl(TOOLS_SUFFIX)] if schemas else []


@dataclass(frozen=True)
class _Msg:
    role: str
    content: str
    reasoning: str
    calls: tuple[tuple[str, str], ...]
    raw_dsml: str | None


def _normalize(message, index: int) -> _Msg:
    if not isinstance(message, Mapping):
        raise ChatError(f"messages[{index}] must be an object, got {type(message).__name__}")
    role = message.get("role", "user")
    if not isinstance(role, str):
        raise ChatError(f"messages[{index}].role must be a string")
    raw_dsml = message.get("raw_dsml")
    if raw_dsml is not None and not isinstance(raw_dsml, str):
        raise ChatError(f"messages[{index}].raw_dsml must be a string")
    try:
        calls = tuple(request_tool_calls(message.get("tool_calls")))
    except ChatError as e:
        raise ChatError(f"messages[{index}]: {e}") from None
    return _Msg(role, content_text(message.get("content")),
                content_text(message.get("reasoning_content")), calls, raw_dsml)


def _is_system(role: str) -> bool:
    return role in ("system", "developer")


def _uses_tool_context(msgs: Sequence[_Msg], schemas: str) -> bool:
    """Reasoning of earlier turns is replayed when tools are involved [chat_history_uses_tool_context]."""
    if schemas:
        return True
    return any((m.role == "assistant" and m.calls) or m.role in ("tool", "function") for m in msgs)


def _render_turns(msgs: Sequence[_Msg], start: int, think: bool, keep_reasoning) -> list[Piece]:
    out: list[Piece] = []
    pending_assistant = False
    pending_tool_result = False
    for i in range(start, len(msgs)):
        m = msgs[i]
        if _is_system(m.role):
            continue
        if m.role == "user":
            out += [ctl(USER), txt(m.content)]
            pending_assistant, pending_tool_result = True, False
        elif m.role in ("tool", "function"):
            if not pending_tool_result:
                out.append(ctl(USER))
            # The tool_result tags are not special tokens (plain text in the vocabulary); what keeps
            # the output inside its wrapper is the escaped closing tag, which a plain-text result
            # can neither spell nor complete (the tag holds a single '<').
            out += [ctl(TOOL_RESULT_OPEN), txt(escape_tool_result(m.content)), ctl(TOOL_RESULT_CLOSE)]
            pending_assistant = pending_tool_result = True
        elif m.role == "assistant":
            if pending_assistant:
                out.append(ctl(ASSISTANT))
                if think and keep_reasoning(i):
                    out += [ctl(THINK_OPEN), txt(m.reasoning), ctl(THINK_CLOSE)]
                else:
                    out.append(ctl(THINK_CLOSE))
            out.append(txt(m.content))
            out += tool_call_pieces([ToolCall(n, a) for n, a in m.calls], m.raw_dsml)
            out.append(ctl(EOS))
            pending_assistant = pending_tool_result = False
        # other roles are ignored, as in ds4
    if pending_assistant:
        out += [ctl(ASSISTANT), ctl(THINK_OPEN if think else THINK_CLOSE)]
    return out


def message_pieces(messages: Sequence[Mapping], tools=None, think: ThinkMode | str | Effort = ThinkMode.HIGH,
                   ctx: int = DEFAULT_CTX) -> list[Piece]:
    """:func:`render_messages` as typed pieces (markup vs request text)."""
    mode = as_effort(think, ctx)
    msgs = [_normalize(m, i) for i, m in enumerate(messages)]
    schemas = render_tool_schemas(tools)
    tool_context = _uses_tool_context(msgs, schemas)
    # Tool schemas come first so a dynamic tail in the client's system text does not sit in the
    # middle of the large, cacheable schema block.
    out = [ctl(BOS), ctl(mode.prefix)]
    out += _tools_prompt_pieces(schemas)
    has_system = bool(schemas)
    for m in msgs:
        if _is_system(m.role):
            if has_system:
                out.append(ctl("\n\n"))
            out.append(txt(m.content))
            has_system = has_system or bool(m.content)
    last_user = max((i for i, m in enumerate(msgs) if m.role in ("user", "tool", "function")), default=-1)
    out += _render_turns(msgs, 0, mode.enabled, lambda i: tool_context or i > last_user)
    return out


def render_messages(messages: Sequence[Mapping], tools=None, think: ThinkMode | str = ThinkMode.HIGH,
                    ctx: int = DEFAULT_CTX) -> str:
    """The server prompt text for a chat request [render_chat_prompt_text].

    ``messages`` are OpenAI-shaped dicts: ``role``, ``content`` (string or list of parts),
    ``reasoning_content``, ``tool_calls`` (``[{"function": {"name", "arguments"}}]``); an assistant
    message may also carry ``raw_dsml``, the exact sampled DSML of its calls, which then replaces
    the canonical rendering (ds4's tool-memory replay).  ``tools`` as in :func:`render_tool_schemas`
    (pass None when ``tool_choice`` is "none": ds4 then omits the tools prompt).

    Layout: BOS, [Think Max prefix], tools prompt + system/developer texts joined by blank lines,
    then the turns.  An assistant turn after a user/tool turn opens with ``<｜Assistant｜>`` and, in
    thinking mode, its reasoning in ``<think>…</think>`` if tools are in play or it follows the last
    user/tool message, else just ``</think>`` (old reasoning is dropped).  Consecutive tool results
    share one ``<｜User｜>``.  A trailing user/tool turn gets the assistant prefix."""
    return join(message_pieces(messages, tools, think, ctx))


def encode_messages(tokenizer: PieceTokenizer, messages: Sequence[Mapping], tools=None,
                    think: ThinkMode | str = ThinkMode.HIGH, ctx: int = DEFAULT_CTX) -> list[int]:
    """The prompt ids of :func:`render_messages`, injection-safe: template markers are control
    tokens, request text is plain BPE (a ``<｜Assistant｜>`` typed by a user is text).  Equal to
    ``tokenizer.encode_rendered(render_messages(...))`` when no request text holds a special
    string."""
    return encode_pieces(tokenizer, message_pieces(messages, tools, think, ctx))


def tail_pieces(messages: Sequence[Mapping], start: int, think: ThinkMode | str = ThinkMode.HIGH,
                ctx: int = DEFAULT_CTX) -> list[Piece]:
    """:func:`render_tail` as typed pieces."""
    mode = as_effort(think, ctx)
    msgs = [_normalize(m, i) for i, m in enumerate(messages)]
    return [ctl(EOS)] + _render_turns(msgs, start, mode.enabled, lambda i: True)


def render_tail(messages: Sequence[Mapping], start: int, think: ThinkMode | str = ThinkMode.HIGH,
                ctx: int = DEFAULT_CTX) -> str:
    """Text to append to a live session whose KV already holds the turns before ``start``
    (typically tool results after a tool-call turn) [render_live_tool_tail]: EOS closing the live
    assistant turn, the new turns, the assistant prefix.  Reasoning is always replayed here."""
    return join(tail_pieces(messages, start, think, ctx))


def encode_tail(tokenizer: PieceTokenizer, messages: Sequence[Mapping], start: int,
                think: ThinkMode | str = ThinkMode.HIGH, ctx: int = DEFAULT_CTX) -> list[int]:
    """Injection-safe ids of :func:`render_tail` (see :func:`encode_messages`)."""
    return encode_pieces(tokenizer, tail_pieces(messages, start, think, ctx))


def assistant_suffix_pieces(content: str, reasoning: str | None, tool_calls: Iterable,
                            think: ThinkMode | str, raw_dsml: str | None = None) -> list[Piece]:
    """:func:`render_assistant_suffix` as typed pieces."""
    head = [txt(reasoning or ""), ctl(THINK_CLOSE)] if as_effort(think, 0).enabled else []
    return head + [txt(content)] + tool_call_pieces(tool_calls, raw_dsml) + [ctl(EOS)]


def render_assistant_suffix(content: str, reasoning: str | None, tool_calls: Iterable,
                            think: ThinkMode | str, raw_dsml: str | None = None) -> str:
    """What follows the prompt's assistant prefix once a turn is done, as the next request will
    render it: [reasoning ``</think>``] content, DSML, EOS [build_tool_checkpoint_suffix]."""
    return join(assistant_suffix_pieces(content, reasoning, tool_calls, think, raw_dsml))


def encode_assistant_suffix(tokenizer: PieceTokenizer, content: str, reasoning: str | None,
                            tool_calls: Iterable, think: ThinkMode | str,
                            raw_dsml: str | None = None) -> list[int]:
    """Injection-safe ids of :func:`render_assistant_suffix` (see :func:`encode_messages`)."""
    return encode_pieces(tokenizer, assistant_suffix_pieces(content, reasoning, tool_calls, think,
                                                            raw_dsml))
