"""The frozen character classes (unicode_classes.py) are HF's, on every code point.

HF's Oniguruma and the ``regex`` package use different Unicode versions; class_remap.py makes
``regex`` see each character in HF's class. The slow test sweeps all 1.1M code points through both
pre-tokenizers (``python -m ds4_mlx.tokenizer.class_probe`` re-derives the tables from HF).
"""

from __future__ import annotations

import bisect

import pytest
import regex

from ds4_mlx.tokenizer.class_probe import CLASSES
from ds4_mlx.tokenizer.class_remap import _STAND_IN, deepseek_remap, is_literal_in_patterns
from ds4_mlx.tokenizer.pretokenizer import DEEPSEEK_V4_PATTERNS, PreTokenizer
from ds4_mlx.tokenizer.unicode_classes import RANGES

import tokenizers as hf_tokenizers  # noqa: E402  (the oracle: a dev dependency, so never a skip)


@pytest.fixture(scope="module")
def hf(tokenizer_json_path):
    return hf_tokenizers.Tokenizer.from_file(str(tokenizer_json_path))


def _starts() -> tuple[list[int], list[tuple[int, str]]]:
    ranges = sorted((int(a, 16), int(b, 16), name) for name in CLASSES
                    for a, b in (item.split("-") for item in RANGES[name].split()))
    return [a for a, _, _ in ranges], [(b, name) for _, b, name in ranges]


_STARTS, _ENDS = _starts()


def frozen_class(cp: int) -> str | None:
    k = bisect.bisect_right(_STARTS, cp) - 1
    if k >= 0 and cp <= _ENDS[k][0]:
        return _ENDS[k][1]
    return None


def regex_class(ch: str) -> str | None:
    for name, pat in (("N", r"\p{N}"), ("LM", r"[\p{L}\p{M}]"), ("PS", r"[\p{P}\p{S}]"), ("WS", r"\s")):
        if regex.fullmatch(pat, ch):
            return name
    return None


def test_tables_are_disjoint_and_sane():
    seen: dict[int, str] = {}
    for name in CLASSES:
        for item in RANGES[name].split():
            a, b = (int(x, 16) for x in item.split("-"))
            assert a <= b
            for cp in (a, b):
                assert seen.setdefault(cp, name) == name
    assert frozen_class(ord("a")) == "LM" and frozen_class(ord("7")) == "N"
    assert frozen_class(ord("!")) == "PS" and frozen_class(ord("\t")) == "WS"
    assert frozen_class(0x1C) is None and frozen_class(0x200D) is None  # not \s / a format char
    assert frozen_class(0x0558) is None  # assigned after Unicode 14: unassigned for HF


def test_remap_puts_every_character_in_hfs_class():
    remap = deepseek_remap()
    assert len(remap) > 1000  # today ~17,800 newer code points
    for stand_in, name in zip(_STAND_IN, (None, *CLASSES)):
        assert regex_class(stand_in) == name
    for cp, stand_in in remap.items():
        assert not is_literal_in_patterns(cp)
        assert regex_class(stand_in) == frozen_class(cp)


@pytest.mark.slow
def test_every_code_point_splits_like_hf(hf):
    pre = PreTokenizer(DEEPSEEK_V4_PATTERNS)
    # c next to a letter on both sides, before punctuation, a newline, spaces, itself and a digit:
    # the neighbourhoods that tell the classes apart (see class_probe.py)
    context = "a{c}a{c}! {c}\n {c}{c}1"
    cps = [cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF]
    step = 16384
    for k in range(0, len(cps), step):
        text = "一".join(context.format(c=chr(cp)) for cp in cps[k : k + step])
        theirs = [span for _, span in hf.pre_tokenizer.pre_tokenize_str(text)]
        ours = pre.split_spans(text)
        if ours != theirs:
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            a, b = ours[i], theirs[i]
            pytest.fail(f"first difference near {text[min(a[0], b[0]):max(a[1], b[1])]!r}: ours {a} vs HF {b} "
                        "(HF's Unicode tables changed? regenerate unicode_classes.py with class_probe.py)")
