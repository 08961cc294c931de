"""Make the ``regex`` package classify every character the way HF's Oniguruma does.

HF ``tokenizers`` runs the DeepSeek regexes with Oniguruma's Unicode tables (frozen in
``unicode_classes``, see class_probe.py), the ``regex`` package with its own, newer ones. Spelling
those frozen classes out as explicit ranges inside the patterns is exact but ~7-60x slower in
``regex``. Instead, before matching, each code point on which the two disagree is replaced by a
stand-in that both see in the class HF gives the original (length-preserving ``str.translate``, so
match spans apply to the original text unchanged). Today that is ~17,800 code points assigned after
Unicode 14.0, all "no class" for HF.

Stand-ins are non-ASCII and outside the CJK/kana ranges, which the patterns name literally: the
substitution never touches a character that a pattern spells out.
"""

from __future__ import annotations

import functools

import numpy as np
import regex

from ds4_mlx.tokenizer.unicode_classes import RANGES

_CLASSES = ("N", "LM", "PS", "WS")  # label k+1; 0 = in none of them
_REGEX_CLASS = {
    "N": r"\p{N}+",
    "LM": r"[\p{L}\p{M}]+",
    "PS": r"[\p{P}\p{S}]+",
    "WS": r"\s+",
}
# One stand-in per class (label order): no class, N, L/M, P/S, whitespace. These have had the same
# category since Unicode 1.1 (U+E000 is private use, in none of the classes).
_STAND_IN = ("\ue000", "\u00b2", "\u00e9", "\u00a1", "\u00a0")
_N_CODE_POINTS = 0x110000
_SURROGATES = (0xD800, 0xE000)


def _hf_labels() -> np.ndarray:
    labels = np.zeros(_N_CODE_POINTS, dtype=np.int8)
    for k, name in enumerate(_CLASSES, 1):
        for item in RANGES[name].split():
            a, b = (int(x, 16) for x in item.split("-"))
            labels[a : b + 1] = k
    return labels


def _regex_labels() -> np.ndarray:
    """Class of every code point according to the installed ``regex`` package."""
    lo, hi = _SURROGATES
    # Surrogates cannot be matched meaningfully; leave them out and shift indices past the gap.
    cps = np.concatenate([np.arange(lo), np.arange(hi, _N_CODE_POINTS)]).astype("<u4")
    everything = cps.tobytes().decode("utf-32-le")
    labels = np.zeros(_N_CODE_POINTS, dtype=np.int8)
    for k, name in enumerate(_CLASSES, 1):
        for m in regex.finditer(_REGEX_CLASS[name], everything):
            a, b = m.span()
            # a run never straddles the gap: U+D7FF and U+E000 are in no class
            shift = 0 if a < lo else hi - lo
            labels[a + shift : b + shift] = k
    return labels


def is_literal_in_patterns(cp: int) -> bool:
    """ASCII and the CJK/kana ranges of the second Split step are named literally in the patterns."""
    return cp < 0x80 or 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x30FF


@functools.lru_cache(maxsize=1)
def deepseek_remap() -> dict[int, str]:
    """``str.translate`` table: code points whose class differs between ``regex`` and HF -> stand-in."""
    hf = _hf_labels()
    ours = _regex_labels()
    lo, hi = _SURROGATES
    table: dict[int, str] = {}
    for cp in np.nonzero(hf != ours)[0].tolist():
        if lo <= cp < hi:
            continue
        if is_literal_in_patterns(cp):
            # Cannot be stood in for; never expected (ASCII classes are stable, CJK chars are cut out
            # by the second Split step before any class is consulted, and are not \p{N} anywhere).
            if cp < 0x80 or hf[cp] == 1 or ours[cp] == 1:
                raise RuntimeError(f"U+{cp:04X}: regex and HF disagree on a literal pattern character")
            continue
        table[cp] = _STAND_IN[hf[cp]]
    return table
