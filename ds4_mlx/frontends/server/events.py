"""Protocol-neutral request and events: the only vocabulary shared by the HTTP side and the
inference backend.  Nothing here knows about JSON shapes of a given API or about tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

# Text and argument fragments are the chat stream parser's own events, passed through as they
# come; only the tool-call start and end differ here (the server gives each call its id).
from ds4_mlx.chat.dsml_stream import ContentDelta as Content
from ds4_mlx.chat.dsml_stream import ReasoningDelta as Reasoning
from ds4_mlx.chat.dsml_stream import ToolCallArgumentsDelta as ToolArgs  # fragments add up to ToolEnd.arguments
from ds4_mlx.chat.effort import Effort, ThinkMode


@dataclass
class ChatRequest:
    """One generation request, already validated.

    ``messages`` are OpenAI-shaped dicts (role, content, reasoning_content, tool_calls, raw_dsml),
    whichever API they came from; ``tools`` the schemas as sent (None when ``tool_choice`` is
    "none", so the tools prompt is omitted as ds4 does).

    ``tool_choice`` is "auto", "none", "required" or ``{"name": N}``.  "required" and a named
    choice are decoding-side constraints (the engine must open the DSML block / the named invoke
    as the first thing after reasoning); the server only carries them to the backend.

    ``raw_output`` (``/v1/completions``): the generated text is returned as is - reasoning and
    ``</think>`` inline, no tool parsing."""

    messages: list[dict]
    tools: list | None = None
    tool_choice: Any = "auto"
    think: Effort = Effort(ThinkMode.HIGH)  # the level in effect (the checkpoint's rules applied)
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.05
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    raw_output: bool = False
    session_id: str | None = None
    model: str = "deepseek-v4-flash"


# -------------------------------------------------------------------------------------------
# Events yielded by a backend, in this order:
#   [Prefill*] Started (Reasoning|Content|ToolStart|ToolArgs|ToolEnd)* Done
# A backend that rejects the request before prefill raises BackendError instead.


@dataclass(frozen=True)
class Prefill:
    """Prefill progress (optional; the server sends keepalives on its own timer anyway)."""

    done: int
    total: int


@dataclass(frozen=True)
class Started:
    """Prefill finished: the prompt size and how much of it came from a cache."""

    prompt_tokens: int
    cached_tokens: int = 0
    cache_source: str = "none"  # live | disk | none


@dataclass(frozen=True)
class ToolStart:
    """The invoke tag of call ``index`` is complete; ``id`` is filled in by the server."""

    index: int
    name: str
    id: str | None = None


@dataclass(frozen=True)
class ToolEnd:
    index: int
    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class Done:
    """End of generation.  ``finish``: stop | length | tool_calls | cancelled | error.
    ``raw_dsml`` is the exact sampled tool-call block (for exact replay), ``error`` a one-line
    reason when ``finish`` is "error"."""

    finish: str
    completion_tokens: int = 0
    raw_dsml: str | None = None
    error: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    reasoning_tokens: int = 0       # of completion_tokens, those generated inside the reasoning
    # the bounded device expert cache (``--experts-cache``), decode hits and misses and the bytes of
    # experts read from the model file (decode, prefill); zero without one
    expert_hits: int = 0
    expert_misses: int = 0
    expert_bytes_read: int = 0
    expert_prefill_bytes_read: int = 0
    drafted_tokens: int = 0         # speculative decoding: draft tokens verified
    accepted_tokens: int = 0        # of them, those the target agreed with


Event = Union[Prefill, Started, Reasoning, Content, ToolStart, ToolArgs, ToolEnd, Done]


class BackendError(Exception):
    """A request the backend refuses before generating (context overflow, bad token...), or an
    internal failure.  ``status`` is the HTTP status; ``code``/``param``/``extra`` go into the
    protocol's error body, ``headers`` into the response; the message is one line and never a
    traceback.  The HTTP side's own errors are the subclass ``http_errors.ApiError``, so both
    reach the client through the same error body."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict | None = None,
                 extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.extra = extra or {}
