"""Reasoning effort: the thinking levels each DeepSeek V4 Flash checkpoint was trained with, and the
text each level puts after BOS.

A request asks for a level (``ThinkMode``: none, low, high, max); the checkpoint's ``EffortRules``
turn it into an ``Effort`` (the level in effect and its prefix), once, where the request enters the
library. Everything below (the CLI token template, the server text template, the chat transcript)
only reads the ``Effort``: the differences between checkpoints live in this file alone.

* Preview (May 2026) — ds4's rules [ds4.c DS4_REASONING_EFFORT_MAX_PREFIX, ds4_think_mode_for_context,
  ds4_server.c parse_reasoning_effort_name]: none / high / max, high (no prefix) the default, max
  puts the "Absolute maximum" paragraph after BOS and needs ctx >= 393216 (below it: high). A low
  request is high: the checkpoint has no lower thinking level (ds4 maps "low" and "minimal" to high).
* 0731 — DeepSeek's encoding for the 0731 checkpoint (``encoding/encoding_dsv4.py``:
  REASONING_EFFORT_PROMPTS, DEFAULT_REASONING_EFFORT = "low"): low (no prefix; the default), high
  (the paragraph the preview used for max), max (a new "Beyond maximum" paragraph), injected after
  BOS at the start of a thinking prompt. The 0731 refresh shifted the levels down by one, which is
  why the two checkpoints need their own rules: the preview's max text is 0731's high. ds4 itself
  keeps one rule set for both (it tells the checkpoints apart only by file name); ds4-mlx follows
  the official encoding for 0731 and keeps ds4's context rule for the top level (DeepSeek recommends
  the maximal effort only with a >= 384K-token window).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import MappingProxyType

from ds4_mlx.errors import ChatError
from ds4_mlx.formats.checkpoint import Checkpoint

# The preview's Think Max paragraph; 0731's "high" [encoding_dsv4.py REASONING_EFFORT_PROMPTS["high"]].
ABSOLUTE_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
# 0731's "max" [encoding_dsv4.py REASONING_EFFORT_PROMPTS["max"]]; the dash is U+2014.
BEYOND_MAX_PREFIX = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, "
    "and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and "
    "are certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

THINK_MAX_MIN_CONTEXT = 393216  # DeepSeek recommends the maximal effort only with >= 384K tokens of context


class ThinkMode(enum.Enum):
    """A thinking level as asked for (what it renders to is the checkpoint's business)."""

    NONE = "none"
    LOW = "low"
    HIGH = "high"
    MAX = "max"

    @property
    def enabled(self) -> bool:
        return self is not ThinkMode.NONE


def as_mode(mode) -> ThinkMode:
    if isinstance(mode, ThinkMode):
        return mode
    try:
        return ThinkMode(mode)
    except ValueError:
        raise ChatError(f"unknown thinking mode {mode!r} (expected none, low, high or max)") from None


@dataclass(frozen=True)
class Effort:
    """A thinking level in effect and the text it puts right after BOS ("" for none)."""

    mode: ThinkMode
    prefix: str = ""
    requested: ThinkMode | None = None  # the level asked for, when the context was too small for it

    @property
    def enabled(self) -> bool:
        return self.mode.enabled

    @property
    def value(self) -> str:
        return self.mode.value

    @property
    def downgraded(self) -> bool:
        return self.requested is not None


@dataclass(frozen=True)
class EffortRules:
    """One checkpoint's thinking levels: the default, each level's prefix, the API effort names."""

    checkpoint: Checkpoint
    default: ThinkMode
    prefixes: MappingProxyType  # ThinkMode -> prefix text
    aliases: MappingProxyType  # a level this checkpoint does not have -> the one it renders as
    api_names: MappingProxyType  # reasoning_effort / output_config.effort / reasoning.effort names
    min_context: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # level -> ctx

    @property
    def levels(self) -> tuple[ThinkMode, ...]:
        return tuple(m for m in ThinkMode if m not in self.aliases)

    def banner(self) -> str:
        """What a front end says at start: which checkpoint and how it thinks unless told."""
        return (f"DeepSeek V4 Flash {self.checkpoint.value} checkpoint, thinking levels "
                f"{'/'.join(m.value for m in self.levels)} (default {self.default.value})")

    def effort(self, mode, ctx: int) -> Effort:
        """The ``Effort`` a request for ``mode`` gets at context ``ctx`` (True: the default level)."""
        asked = self.default if mode is True else ThinkMode.NONE if mode is False else as_mode(mode)
        level = self.aliases.get(asked, asked)  # silent: the checkpoint renders the two alike
        need = self.min_context.get(level)
        if need is not None and max(int(ctx), 0) < need:
            # ds4's rule: below the window, ordinary (high) thinking; recorded so callers can say so
            return Effort(ThinkMode.HIGH, self.prefixes.get(ThinkMode.HIGH, ""), level)
        return Effort(level, self.prefixes.get(level, ""))

    def from_name(self, name: str, where: str = "reasoning_effort") -> ThinkMode:
        """An API effort name as this checkpoint reads it; ChatError naming ``where`` otherwise."""
        if not isinstance(name, str) or name not in self.api_names:
            names = ", ".join(self.api_names)
            raise ChatError(f"{where} must be one of {names}, got {name!r}")
        return self.api_names[name]


_M = ThinkMode
RULES: dict[Checkpoint, EffortRules] = {
    Checkpoint.PREVIEW: EffortRules(
        Checkpoint.PREVIEW, default=_M.HIGH,
        prefixes=MappingProxyType({_M.MAX: ABSOLUTE_MAX_PREFIX}),
        aliases=MappingProxyType({_M.LOW: _M.HIGH}),
        # ds4 [parse_reasoning_effort_name]: only high and max exist above zero.
        api_names=MappingProxyType({"none": _M.NONE, "minimal": _M.HIGH, "low": _M.HIGH, "medium": _M.HIGH,
                                    "high": _M.HIGH, "xhigh": _M.HIGH, "max": _M.MAX}),
        min_context=MappingProxyType({_M.MAX: THINK_MAX_MIN_CONTEXT})),
    Checkpoint.F0731: EffortRules(
        Checkpoint.F0731, default=_M.LOW,
        prefixes=MappingProxyType({_M.HIGH: ABSOLUTE_MAX_PREFIX, _M.MAX: BEYOND_MAX_PREFIX}),
        aliases=MappingProxyType({}),
        # The names below low read as low and xhigh as high (as the 0731 encoding's serving patches
        # map them); only "max" asks for the new top level, as in ds4 ("xhigh is not Think Max").
        api_names=MappingProxyType({"none": _M.NONE, "minimal": _M.LOW, "low": _M.LOW, "medium": _M.LOW,
                                    "high": _M.HIGH, "xhigh": _M.HIGH, "max": _M.MAX}),
        min_context=MappingProxyType({_M.MAX: THINK_MAX_MIN_CONTEXT})),
}
PREVIEW_RULES = RULES[Checkpoint.PREVIEW]


def as_effort(think, ctx: int, rules: EffortRules = PREVIEW_RULES) -> Effort:
    """``think`` as an Effort: an Effort as is (already decided by its checkpoint's rules), else a
    level under ``rules`` (the preview's, ds4's, unless a caller that knows the checkpoint says)."""
    if isinstance(think, Effort):
        return think
    return rules.effort(think, ctx)
