"""The engine facade: one opened model file with its tokenizer, handing out sessions.

Frontends (CLI, server, notebooks) talk to this and to sessions only; they never touch tensors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from ds4_mlx.chat.template import ASSISTANT, DEFAULT_SYSTEM, USER, ThinkMode, encode_chat_prompt
from ds4_mlx.tokenizer import Tokenizer

BOS_TEXT = "<｜begin▁of▁sentence｜>"


@dataclass
class Engine:
    model: object
    tokenizer: Tokenizer
    path: Path
    _model_id: bytes | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path: str | Path, numerics: str = "default") -> "Engine":
        from ds4_mlx import load

        model = load(path, numerics=numerics)
        # the model keeps its GGUFFile open: build the tokenizer from it rather than reopening the file
        tokenizer = Tokenizer.from_gguf(model.source)
        return cls(model=model, tokenizer=tokenizer, path=Path(path))

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def model_id(self) -> bytes:
        """32-byte identity of the GGUF (sha256 of its metadata and tensor table), as stored in
        session payloads and KV cache files."""
        if self._model_id is None:
            from ds4_mlx.engine.payload import model_fingerprint

            self._model_id = model_fingerprint(self.model.source)
        return self._model_id

    @functools.cached_property
    def quant_bits(self) -> int:
        """Routed-expert quant bits as ds4's KV cache header records them (2 or 4)."""
        from ds4_mlx.formats.layout import routed_quant_bits

        return routed_quant_bits(self.model.source) or 2

    @property
    def user_id(self) -> int:
        """Id of the ``<｜User｜>`` marker (-1 if the vocabulary lacks it)."""
        tid = self.tokenizer.token_to_id(USER)
        return -1 if tid is None else tid

    @property
    def assistant_id(self) -> int:
        """Id of the ``<｜Assistant｜>`` marker (-1 if the vocabulary lacks it)."""
        tid = self.tokenizer.token_to_id(ASSISTANT)
        return -1 if tid is None else tid

    def new_session(self, ctx: int = 32768, *, chunk: int | None = None, **options):
        """An engine ``Session`` (sync / snapshots / payloads) of ``ctx`` tokens; ``chunk`` is the
        prefill chunk (ds4's 2048 by default); ``options`` go to ``Session``."""
        from ds4_mlx.engine.session import DEFAULT_CHUNK, Session

        return Session(self.model, ctx, chunk=chunk or DEFAULT_CHUNK, model_id=self._model_id, **options)

    def encode_prompt(self, text: str, *, raw: bool = False, system: str | None = DEFAULT_SYSTEM,
                      think: ThinkMode = ThinkMode.HIGH, ctx: int = 32768) -> list[int]:
        """Tokens for a prompt as ds4's CLI builds them.

        ``raw`` (or text that already starts with the BOS marker, as ds4 detects) tokenizes the text
        as a rendered prompt with the special markers recognised; otherwise the CLI chat template.
        """
        if raw or text.startswith(BOS_TEXT):
            return self.tokenizer.encode_rendered(text)
        return encode_chat_prompt(self.tokenizer, text, system=system or "", think=think, ctx=ctx)
