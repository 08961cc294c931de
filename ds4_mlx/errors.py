"""Error types shared by every layer.

Every failure caused by bad input (a file, a tensor, a metadata field, a request) is raised as a
subclass of ``Ds4Error`` with a message that names what is wrong and where, so frontends can print
it as one line instead of a traceback.
"""

from __future__ import annotations


class Ds4Error(Exception):
    """Base class of every error ds4-mlx raises on purpose."""


class GGUFError(Ds4Error):
    """The file is not a readable GGUF v3 container (header, metadata, tensor directory, offsets)."""

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None):
        where = []
        if path is not None:
            where.append(str(path))
        if offset is not None:
            where.append(f"byte offset {offset}")
        super().__init__(f"{': '.join(where)}: {message}" if where else message)
        self.path = path
        self.offset = offset


class LayoutError(Ds4Error):
    """The GGUF is readable but is not a DS4 Flash model: config or tensor layout mismatch."""


class QuantError(Ds4Error):
    """Bad arguments to a block (de)quantizer: unknown type, partial block, wrong byte count."""


class TokenizerError(Ds4Error):
    """Tokenizer tables missing or inconsistent in the GGUF metadata."""


class ChatError(Ds4Error):
    """A chat request cannot be rendered: malformed message, tool call or thinking-mode name."""


class KVStoreError(Ds4Error):
    """A disk KV cache file or directory is unusable (corrupt, incompatible, unwritable) or a store
    request is malformed (bad reason, tokens, model id)."""


class InferenceError(Ds4Error):
    """Input that does not fit the model at inference time: a token id outside the vocabulary, a
    context overflow, a serialized state with missing arrays or wrong shapes."""


class NonFiniteError(InferenceError):
    """The forward pass produced NaN or Inf (typically non-finite weights in the file): generation
    stops instead of emitting tokens sampled from garbage, and no such state is ever stored."""


class PayloadError(Ds4Error):
    """A session payload that cannot be loaded here: damaged, truncated, or made for another
    model, a larger context or another prefill chunk."""


class HubError(Ds4Error):
    """A model file cannot be fetched from the Hugging Face hub (offline, unreachable, no access, not
    found, no disk space) or a fetched file is not the DS4 GGUF it should be."""


class DistributedError(InferenceError):
    """A distributed run that cannot go on: no launcher started the ranks, more ranks than layers,
    a rank that never joined or was lost, a state the other ranks do not hold."""


class MemoryPlanError(Ds4Error):
    """A load whose memory plan (weights, expert cache, KV at the context, scratch) does not fit
    the machine's memory (``model.memory_plan``), refused before any weight is read; or a bad
    simulated memory size. The message names the numbers and what would fit."""


class DraftError(InferenceError):
    """Speculative decoding that cannot run: a drafter file that is missing or unusable, a bad draft
    length, a drafter that proposes ids outside the vocabulary, a model that cannot verify drafts."""


class DrafterError(LayoutError, DraftError):
    """A speculative-decoding drafter GGUF (the preview's MTP head, 0731's DSpark file) that is not a
    drafter, is damaged, or does not belong to the loaded model (another checkpoint, other dims): a
    file problem (``LayoutError``) that also stops speculation (``DraftError``)."""
