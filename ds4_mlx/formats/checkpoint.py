"""Which DeepSeek V4 Flash checkpoint a GGUF holds: the May 2026 preview or the 0731 refresh.

The two share every shape, tensor name and quant recipe, so nothing structural tells them apart.
ds4 decides the way it can (its sources, Aug-Sep 2026):

* ``deepseek4.checkpoint_variant`` names a variant explicitly; ds4 knows one value, "vision-exp"
  (Vision Experimental: a different language checkpoint that needs its vision encoder) and refuses
  any other [config_validate_deepseek4_model]. ds4-mlx has no vision path, so it refuses it too.
* Otherwise the file name: ds4's own rule for its fixtures is "a GGUF whose name contains 0731 must
  use flash-0731; the older undated GGUF uses flash-pre-0731" (tests/test-vectors/README.md), and
  every 0731 file it publishes is named ``...-0731.gguf``. ds4's quantizer copies a template's
  metadata into the files it writes, so the metadata of a 0731 file need not mention 0731 at all.
* ``general.name`` containing the token 0731 counts too: a converter that records the checkpoint
  puts it there, and it survives a rename.

A file renamed to hide both is read as the preview; ``checkpoint=`` (``--checkpoint``) says which
it is. The result records how it was decided, for ``inspect`` and the banners.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from ds4_mlx.errors import LayoutError

VARIANT_KEY = "deepseek4.checkpoint_variant"
_TOKEN_0731 = re.compile(r"(?<![0-9])0731(?![0-9])")


class Checkpoint(enum.Enum):
    PREVIEW = "preview"
    F0731 = "0731"

    @property
    def title(self) -> str:
        return "DeepSeek V4 Flash 0731" if self is Checkpoint.F0731 else "DeepSeek V4 Flash preview (May 2026)"


@dataclass(frozen=True)
class CheckpointInfo:
    checkpoint: Checkpoint
    source: str  # how it was decided, one phrase: "file name", "general.name", "set by the caller", ...

    def __str__(self) -> str:
        return f"{self.checkpoint.title} ({self.source})"


def parse_checkpoint(value) -> Checkpoint:
    """A ``checkpoint=`` / ``--checkpoint`` value: "preview" or "0731" (or a Checkpoint)."""
    if isinstance(value, Checkpoint):
        return value
    try:
        return Checkpoint(str(value).strip().lower())
    except ValueError:
        raise LayoutError(f"unknown checkpoint {value!r}: expected 'preview' or '0731'") from None


def detect_checkpoint(metadata: Mapping, path: str | os.PathLike, override=None) -> CheckpointInfo:
    """The checkpoint of the GGUF at ``path`` with header ``metadata`` (see the module docstring);
    ``override`` ("preview" / "0731") wins over the file name and ``general.name``, never over a
    variant the file declares. Raises LayoutError for a variant ds4-mlx cannot run."""
    variant = metadata.get(VARIANT_KEY)
    if variant is not None:
        where = f"{os.fspath(path)}: metadata '{VARIANT_KEY}' is {str(variant)[:80]!r}"
        if variant == "vision-exp":
            raise LayoutError(f"{where}: DeepSeek V4 Flash Vision Experimental is a different checkpoint "
                              f"that needs its vision encoder; ds4-mlx runs the text checkpoints (preview, 0731)")
        raise LayoutError(f"{where}: not a checkpoint variant ds4 knows")
    if override is not None:
        return CheckpointInfo(parse_checkpoint(override), "set by the caller")
    name = metadata.get("general.name")
    if isinstance(name, str) and _TOKEN_0731.search(name):
        return CheckpointInfo(Checkpoint.F0731, "general.name")
    if _TOKEN_0731.search(os.path.basename(os.fspath(path))):
        return CheckpointInfo(Checkpoint.F0731, "file name")
    return CheckpointInfo(Checkpoint.PREVIEW, "no 0731 in the file name or general.name")
