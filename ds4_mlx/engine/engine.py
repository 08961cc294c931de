"""The public model object (``ds4_mlx.load``): one opened GGUF with its tokenizer, handing out sessions.

Frontends (CLI, server, notebooks) talk to this, to sessions and to ``engine.generate``; they never
touch tensors. The network itself (``model/transformer.Model``) is ``.network``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ds4_mlx.chat.template import (
    ASSISTANT,
    BOS,
    DEFAULT_CTX,
    DEFAULT_SYSTEM,
    THINK_CLOSE,
    THINK_OPEN,
    USER,
    ThinkMode,
    encode_chat_prompt,
    message_pieces,
)
from ds4_mlx.chat.effort import RULES, Effort
from ds4_mlx.chat.pieces import Piece, ctl, encode_pieces, join
from ds4_mlx.errors import ChatError, InferenceError
from ds4_mlx.formats.checkpoint import CheckpointInfo, detect_checkpoint, parse_checkpoint
from ds4_mlx.formats.gguf import GGUFFile
from ds4_mlx.tokenizer import Tokenizer


def resolve_model_path(path_or_repo: str | os.PathLike) -> Path:
    """A local path as is; ``hf:REPO/FILE`` through ``ds4_mlx.hub.resolve_model`` (imported only
    then: a local model never loads the hub client)."""
    spec = os.fspath(path_or_repo)
    if not spec.startswith("hf:"):
        return Path(spec)
    from ds4_mlx.hub import resolve_model

    return Path(resolve_model(spec))


def as_think_mode(think, default: ThinkMode = ThinkMode.HIGH) -> ThinkMode:
    """``think`` as a ThinkMode: a ThinkMode, "none" / "low" / "high" / "max", or a bool (True =
    ``default``, the checkpoint's default level)."""
    if isinstance(think, ThinkMode):
        return think
    if isinstance(think, Effort):  # already decided by a checkpoint's rules (the server's requests)
        return think.mode
    if isinstance(think, bool):
        return default if think else ThinkMode.NONE
    if isinstance(think, str):
        try:
            return ThinkMode(think)
        except ValueError:
            pass
    raise ChatError(f"think must be True/False or one of 'none', 'low', 'high', 'max', got {think!r}")


class Engine:
    """A loaded DS4 Flash model: ``network`` (the transformer), ``tokenizer``, ``config``, ``path``.

    Build it with ``ds4_mlx.load(path)``; ``new_session(ctx)`` gives a ``Session``;
    ``apply_chat_template`` builds prompts; ``ds4_mlx.generate`` / ``stream_generate`` run it.
    """

    def __init__(self, network, tokenizer: Tokenizer, path: str | os.PathLike, *, load_time: float = 0.0,
                 model_id: bytes | None = None, checkpoint: CheckpointInfo | None = None):
        self.network = network
        self.tokenizer = tokenizer
        self.path = Path(path)
        # Which checkpoint (preview / 0731) and so which thinking levels: decided once, at open.
        self.checkpoint_info = checkpoint or detect_checkpoint(network.source.metadata, self.path)
        self.effort_rules = RULES[self.checkpoint_info.checkpoint]
        self.load_time = load_time  # seconds spent in open (mmap, tables, tokenizer)
        self._model_id = model_id
        # speculative decoding (``engine/speculative.py``): the drafter generation uses by default
        # and its most drafts per verify step; set by ``open(draft=...)`` or ``set_drafter``
        self.drafter = None
        self.draft_k: int | None = None

    @classmethod
    def open(cls, path: str | os.PathLike, numerics: str = "default", *, checkpoint=None, draft=None,
             draft_k: int | None = None, **kwargs) -> "Engine":
        """Open a GGUF (or an ``hf:REPO/FILE`` spec); ``kwargs`` go to ``model.loader.load``.
        ``checkpoint``: "preview" / "0731" for a file whose name and metadata do not say
        (``formats.checkpoint``); None decides from the file. ``draft``: a ``Drafter`` or a draft
        model's path (``speculative.load_drafter``) for speculative decoding, ``draft_k`` its most
        drafts per verify step (``set_drafter``).

        With ``distributed`` ("pipeline" / "experts") only rank 0 returns: every other rank follows
        rank 0's commands here and exits (``SystemExit(0)``) when rank 0 ends, so one script runs on
        every rank."""
        from ds4_mlx.model.loader import load as load_network

        t0 = time.perf_counter()
        path = resolve_model_path(path)
        if checkpoint is not None:
            parse_checkpoint(checkpoint)  # a bad value fails before the file is read
        if draft_k is not None or draft is not None:  # as above: bad draft options fail before the load
            from ds4_mlx.engine.speculative import check_draft_k, check_draft_path

            if draft_k is not None:
                check_draft_k(draft_k)
            check_draft_path(draft)
        with GGUFFile(path) as header:  # the header only (mmap): a variant we cannot run is refused first
            info = detect_checkpoint(header.metadata, path, checkpoint)
        network = load_network(path, numerics=numerics, **kwargs)  # ctx / simulate_memory: its memory plan
        if getattr(network, "rank", 0) != 0:
            # A rank other than 0 (``model.distributed``): it serves its part for rank 0, which owns
            # tokenizer, sessions and output, and ends the process when rank 0 stops.
            network.follow()
            raise SystemExit(0)
        # the network keeps its GGUFFile open: build the tokenizer from it rather than reopening the file
        tokenizer = Tokenizer.from_gguf(network.source)
        engine = cls(network, tokenizer, path, load_time=time.perf_counter() - t0, checkpoint=info)
        if draft is not None or draft_k is not None:
            engine.set_drafter(draft, draft_k)
        return engine

    def set_drafter(self, draft, draft_k: int | None = None) -> None:
        """Speculate with ``draft`` (a ``Drafter``, a draft model's path, or None: stop) by default in
        every generation of this model; ``draft_k``: the most drafts per verify step (default 4).
        Checked here: a file that cannot be loaded or a model that cannot verify is an error now."""
        from ds4_mlx.engine.speculative import check_draft_k, check_speculation, resolve_drafter

        if draft_k is not None:
            check_draft_k(draft_k)
        drafter = resolve_drafter(draft, self)
        if drafter is not None:
            check_speculation(self.network)
        self.drafter, self.draft_k = drafter, draft_k

    # -- identity ------------------------------------------------------------------------------------

    @property
    def config(self):
        return self.network.config

    @property
    def checkpoint(self) -> str:
        """"preview" or "0731": the checkpoint whose chat rules (thinking levels) this model follows."""
        return self.checkpoint_info.checkpoint.value

    def effort(self, think=True, ctx: int | None = None) -> Effort:
        """The thinking level in effect for ``think`` (True: this checkpoint's default; False/"none",
        "low", "high", "max") at context ``ctx``, with the text it puts after BOS."""
        if isinstance(think, Effort):
            return think
        return self.effort_rules.effort(as_think_mode(think, self.effort_rules.default),
                                        self.default_ctx() if ctx is None else ctx)

    @property
    def numerics(self) -> str:
        return self.network.numerics.value

    @property
    def experts(self) -> str:
        """The routed-expert strategy the model was loaded with: "device" or "host"."""
        return self.network.expert_strategy

    @property
    def context_length(self) -> int:
        return self.network.config.context_length

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def model_id(self) -> bytes:
        """32-byte identity of the GGUF (sha256 of its metadata and tensor table), as stored in
        session payloads and KV cache files."""
        if self._model_id is None:
            from ds4_mlx.engine.payload import model_fingerprint

            self._model_id = model_fingerprint(self.network.source)
        return self._model_id

    @functools.cached_property
    def quant_bits(self) -> int:
        """Routed-expert quant bits as ds4's KV cache header records them (2 or 4)."""
        from ds4_mlx.formats.layout import routed_quant_bits

        return routed_quant_bits(self.network.source) or 2

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

    def __repr__(self) -> str:
        from ds4_mlx.engine.describe import file_size, human_bytes

        cfg = self.config
        return (f"Engine(path={str(self.path)!r}, checkpoint={self.checkpoint!r}, "
                f"size={human_bytes(file_size(self.path))}, layers={cfg.n_layer}, "
                f"experts={cfg.n_expert}/{cfg.n_expert_used} ({self.experts}), numerics={self.numerics!r}, "
                f"vocab={cfg.n_vocab}, context_max={cfg.context_length})")

    def _repr_html_(self) -> str:
        """The notebook view: a table of the file, shape, context and numerics."""
        from ds4_mlx.engine.describe import engine_rows, html_table

        return html_table("ds4_mlx Engine", engine_rows(self))

    # -- sessions ------------------------------------------------------------------------------------

    def default_ctx(self) -> int:
        """The context the model was loaded for (``ds4_mlx.load(..., ctx=N)``: what its memory plan
        sized the KV for), else ds4's CLI context (32768); at most the model's context length."""
        plan = getattr(self.network, "memory_plan", None)
        return plan.ctx if plan is not None else min(DEFAULT_CTX, self.context_length)

    @property
    def memory_plan(self):
        """The load's ``model.memory_plan.MemoryPlan`` (None for a distributed rank's share)."""
        return getattr(self.network, "memory_plan", None)

    @property
    def load_plan(self):
        """The load's ``model.load_plan.LoadPlan``: backend, expert strategy, weight forms, kernels."""
        return getattr(self.network, "load_plan", None)

    def new_session(self, ctx: int | None = None, *, chunk: int | None = None, **options):
        """A ``Session`` of ``ctx`` tokens (default ``default_ctx()``); ``chunk`` is the prefill chunk
        (ds4's 2048 by default); ``options`` go to ``Session`` (checkpoint pools; ``compile`` and
        ``resume_prefill_min``, by default this load's, ``load_plan``). The one way to get a session:
        the network itself is not a session factory."""
        from ds4_mlx.engine.session import DEFAULT_CHUNK, Session

        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise InferenceError(f"prefill chunk must be an integer >= 1, got {chunk!r}")
        return Session(self, self.default_ctx() if ctx is None else ctx, chunk=chunk or DEFAULT_CHUNK, **options)

    # -- prompts -------------------------------------------------------------------------------------

    def encode_prompt(self, text: str, *, raw: bool = False, system: str | None = DEFAULT_SYSTEM,
                      think=True, ctx: int = DEFAULT_CTX) -> list[int]:
        """Tokens for a prompt as ds4's CLI builds them (``think``: see :meth:`effort`).

        ``raw`` (or text that already starts with the BOS marker, as ds4 detects) tokenizes the text
        as a rendered prompt with the special markers recognised; otherwise the CLI chat template.
        """
        if raw or text.startswith(BOS):
            return self.tokenizer.encode_rendered(text)
        return encode_chat_prompt(self.tokenizer, text, system=system or "", think=self.effort(think, ctx), ctx=ctx)

    def apply_chat_template(self, messages, tools=None, *, think=True,
                            system: str | None = DEFAULT_SYSTEM, add_generation_prompt: bool = True,
                            tokenize: bool = True, ctx: int = DEFAULT_CTX) -> list[int] | str:
        """The prompt for a conversation, as token ids (or text with ``tokenize=False``).

        ``messages``: a string, rendered as ds4's CLI chat prompt exactly like ``ds4-mlx generate -p``
        (the user text is plain BPE: special markers in it are not recognised); or a list of
        OpenAI-style messages (``role``, ``content``, ``reasoning_content``, ``tool_calls``),
        rendered as ds4-server renders a chat request (``render_messages``).  ``system`` is used
        when the messages carry no system/developer message (None or "" for none): ds4-server adds
        no default system text, ds4's CLI does, and this follows the CLI so that a single user
        message gives the same ids as the same string.  In both forms one of ds4's special strings
        (``<｜User｜>``...) typed inside a message is plain text, never a control token (the ids
        ``ds4-mlx serve`` and ``tokenize --messages`` give for the same messages).  One case still
        differs: with Think Max a system text that starts with whitespace is BPE'd together with the Max prefix's final
        blank line in the messages form, separately in the string form.  ``think``: True (this
        checkpoint's default level)/False/"none"/"low"/"high"/"max", rendered with the checkpoint's
        rules (``chat/effort.py``); the top level applies only when ``ctx`` >= 393216 (ds4's rule).  ``tools``: OpenAI tool
        schemas (a string prompt then goes through the messages form).
        ``add_generation_prompt=False`` leaves off the trailing ``<｜Assistant｜><think>``.
        """
        mode = self.effort(think, ctx)
        if system is not None and not isinstance(system, str):
            raise ChatError(f"system must be a string or None, got {type(system).__name__}")
        if isinstance(messages, str):
            if tools is None:
                ids = encode_chat_prompt(self.tokenizer, messages, system=system or "", think=mode, ctx=ctx)
                if not add_generation_prompt:
                    ids = ids[:-2]
                return ids if tokenize else self.tokenizer.decode(ids)
            messages = [{"role": "user", "content": messages}]
        if isinstance(messages, Mapping) or not isinstance(messages, Sequence) or not messages:
            raise ChatError("messages must be a string or a non-empty list of {'role', 'content'} objects")
        msgs = list(messages)
        has_system = any(isinstance(m, Mapping) and m.get("role") in ("system", "developer") for m in msgs)
        if system and not has_system:
            msgs.insert(0, {"role": "system", "content": system})
        # Typed pieces, not the rendered string re-scanned: a special string typed in a message
        # (``<｜User｜>``...) stays text, as ``serve`` and ``tokenize --messages`` encode it.
        pieces = message_pieces(msgs, tools=tools, think=mode, ctx=ctx)
        if not add_generation_prompt:
            text = join(pieces)
            for tail in (ASSISTANT + THINK_OPEN, ASSISTANT + THINK_CLOSE):
                if text.endswith(tail):
                    pieces = _drop_markup_tail(pieces, len(tail))
                    break
        return encode_pieces(self.tokenizer, pieces) if tokenize else join(pieces)


def _drop_markup_tail(pieces: list[Piece], n_chars: int) -> list[Piece]:
    """``pieces`` less their last ``n_chars`` characters, which must be template markup (the
    generation prompt)."""
    out = list(pieces)
    while n_chars > 0:
        last = out.pop()
        if not last.control:
            raise ChatError("internal: the generation prompt is not template markup")
        if len(last.text) > n_chars:
            out.append(ctl(last.text[:-n_chars]))
            break
        n_chars -= len(last.text)
    return out


def end_model_thread() -> None:
    """Call last on a thread that loaded and ran a model, after dropping it: frees the MLX objects
    that became unreachable and ends this thread's MLX streams.

    MLX streams belong to the thread that created them. Left to interpreter exit, the objects are
    freed on the main thread and the dead thread's stream is torn down late, which aborts the
    process now and then ("terminate called without an active exception")."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.synchronize()
    mx.clear_streams()
