"""DS4 chat layer: prompt templates, thinking modes and DSML tool calls.

Pure text and token-id logic: token ids come from a tokenizer object passed in, so nothing here
imports the model or engine layers."""

from ds4_mlx.chat.dsml import finish_turn, parse_message, render_tool_calls
from ds4_mlx.chat.dsml_stream import DsmlDecodeTracker, DsmlStreamParser, ToolMarkerScanner
from ds4_mlx.chat.messages import ParsedMessage, ToolCall
from ds4_mlx.chat.template import (
    DEFAULT_SYSTEM,
    MAX_EFFORT_PREFIX,
    TOOLS_PROMPT,
    TOOLS_SUFFIX,
    ChatTranscript,
    ThinkMode,
    encode_chat_prompt,
    encode_next_turn,
    render_assistant_suffix,
    render_messages,
    render_tail,
    resolve_think_mode,
)

__all__ = [
    "DEFAULT_SYSTEM", "MAX_EFFORT_PREFIX", "TOOLS_PROMPT", "TOOLS_SUFFIX",
    "ChatTranscript", "DsmlDecodeTracker", "DsmlStreamParser", "ParsedMessage", "ThinkMode",
    "ToolCall", "ToolMarkerScanner", "encode_chat_prompt", "encode_next_turn", "finish_turn",
    "parse_message", "render_assistant_suffix", "render_messages", "render_tail",
    "render_tool_calls", "resolve_think_mode",
]
