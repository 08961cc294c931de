"""Decoding constraints built on ``stream_generate``'s ``logits_processors`` hook.

``ForcedText`` makes the generation spell given tokens at a given point: from the start, or right
after the reasoning closes (``</think>``). The server builds OpenAI's ``tool_choice`` "required"
(the answer opens the DSML tool block) and a named tool (it opens that tool's invoke) on it;
tests use it to drive tool-call output from a random model.

A processor is a pure function of the tokens generated so far: it forces the next token only
while the generated tail after the trigger is still a prefix of the forced tokens, so a sampled
divergence (impossible under the mask, but a processor earlier in the list could cause one)
simply ends the constraint.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ds4_mlx.chat.dsml import FULL, escape_attr
from ds4_mlx.chat.template import THINK_CLOSE
from ds4_mlx.errors import InferenceError


class ForcedText:
    """``fn(generated, logits)``: force ``tokens`` once ``after_think`` (the first ``</think>``
    generated) or from the first token."""

    def __init__(self, tokens: Sequence[int], *, think_close_id: int | None = None):
        self.tokens = [int(t) for t in tokens]
        if not self.tokens:
            raise InferenceError("a forced text needs at least one token")
        self.think_close_id = think_close_id
        self._searched = 0                  # tokens already searched for the first </think>
        self._after_think: int | None = None

    def _start(self, generated: Sequence[int]) -> int | None:
        """Index after the first ``</think>``.  Called once per decoded token, so the search
        resumes where the last call stopped instead of rescanning the whole generation; a list
        shorter than the searched part is a new generation and restarts it."""
        if self.think_close_id is None:
            return 0
        n = len(generated)
        if n < self._searched:
            self._searched, self._after_think = 0, None
        if self._after_think is None:
            for i in range(self._searched, n):
                if generated[i] == self.think_close_id:
                    self._after_think = i + 1
                    break
            self._searched = n
        return self._after_think

    def __call__(self, generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        start = self._start(generated)
        if start is None:
            return logits
        k = len(generated) - start
        if k >= len(self.tokens) or list(generated[start:]) != self.tokens[:k]:
            return logits
        out = np.full_like(logits, -np.inf)
        want = self.tokens[k]
        out[want] = max(float(logits[want]), 0.0)
        return out


def tool_choice_processor(tokenizer, tool_choice, *, thinking: bool) -> ForcedText | None:
    """The constraint for ``tool_choice``: None for "auto"/"none"; "required" forces the DSML
    block open up to the invoke's name attribute; ``{"name": N}`` forces the whole invoke tag of
    N. ``thinking``: the prompt ends inside ``<think>`` (force after the reasoning closes)."""
    if tool_choice in (None, "auto", "none"):
        return None
    head = "\n\n" + FULL.tool_calls_start + "\n" + f'{FULL.invoke_start} name="'
    if tool_choice == "required":
        text = head
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("name"), str) and tool_choice["name"]:
        text = head + escape_attr(tool_choice["name"]) + '">\n'
    else:
        raise InferenceError(f"tool_choice must be 'auto', 'none', 'required' or {{'name': N}}, got {tool_choice!r}")
    # the markup's ｜DSML｜ is the control token, as the model samples it; the name is plain BPE
    prefix = tokenizer.encode_rendered(head)
    rest = text[len(head):]
    ids = prefix + (tokenizer.encode(rest) if rest else [])
    close = tokenizer.token_to_id(THINK_CLOSE) if thinking else None
    return ForcedText(ids, think_close_id=close)
