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


# Code points classified per block: every temporary stays small (a whole-range pass needs ~20 MB
# of arrays and a 4 MB string, which the allocator then keeps for the life of the process).
_BLOCK = 1 << 14


def _hf_ranges() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First and last code point and label of every HF class range, in table order."""
    first, last, label = [], [], []
    for k, name in enumerate(_CLASSES, 1):
        for item in RANGES[name].split():
            a, b = (int(x, 16) for x in item.split("-"))
            first.append(a)
            last.append(b)
            label.append(k)
    return np.array(first), np.array(last), np.array(label, dtype=np.int8)


def _hf_labels(start: int, stop: int, ranges: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """HF's class of each code point in [start, stop) (later classes win, as in table order)."""
    first, last, label = ranges
    labels = np.zeros(stop - start, dtype=np.int8)
    for i in np.flatnonzero((first < stop) & (last >= start)).tolist():
        labels[max(int(first[i]), start) - start : min(int(last[i]) + 1, stop) - start] = label[i]
    return labels


def _regex_labels(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """The code points of [start, stop) but surrogates, and the class the installed ``regex`` gives each."""
    cps = np.arange(start, stop, dtype="<u4")
    lo, hi = _SURROGATES
    cps = cps[(cps < lo) | (cps >= hi)]  # surrogates cannot be matched meaningfully
    text = cps.tobytes().decode("utf-32-le")
    labels = np.zeros(len(cps), dtype=np.int8)
    for k, name in enumerate(_CLASSES, 1):
        for m in regex.finditer(_REGEX_CLASS[name], text):
            labels[m.start() : m.end()] = k
    return cps, labels


def is_literal_in_patterns(cp: int) -> bool:
    """ASCII and the CJK/kana ranges of the second Split step are named literally in the patterns."""
    return cp < 0x80 or 0x4E00 <= cp <= 0x9FA5 or 0x3040 <= cp <= 0x30FF


@functools.lru_cache(maxsize=1)
def deepseek_remap() -> dict[int, str]:
    """``str.translate`` table: code points whose class differs between ``regex`` and HF -> stand-in."""
    ranges = _hf_ranges()
    table: dict[int, str] = {}
    for start in range(0, _N_CODE_POINTS, _BLOCK):
        stop = min(start + _BLOCK, _N_CODE_POINTS)
        cps, ours = _regex_labels(start, stop)
        hf = _hf_labels(start, stop, ranges)[cps - start]
        differ = np.flatnonzero(hf != ours)
        for cp, h, o in zip(cps[differ].tolist(), hf[differ].tolist(), ours[differ].tolist()):
            if is_literal_in_patterns(cp):
                # Cannot be stood in for; never expected (ASCII classes are stable, CJK chars are cut
                # out by the second Split step before any class is consulted, and are not \p{N}
                # anywhere).
                if cp < 0x80 or h == 1 or o == 1:
                    raise RuntimeError(f"U+{cp:04X}: regex and HF disagree on a literal pattern character")
                continue
            table[cp] = _STAND_IN[h]
    return table
