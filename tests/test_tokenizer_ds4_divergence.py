"""Where ds4.c's hand-written pre-tokenizer and the official one part ways, and which one we follow.

ds4 (spec §11.2) treats every non-ASCII character as a letter. The official regex instead puts
punctuation such as ``»`` with the newlines that follow it (`` ?[\\p{P}\\p{S}]+[\\r\\n]*``), so on the
oracle's ``dev_long`` prompt ds4 gives 733 ids and HF 729. We follow HF (the DeepSeek API's prompt
counts match it, see test_tokenizer_exactness.py); these tests pin down exactly where ds4 differs.
"""

from __future__ import annotations

import difflib
import json

import pytest


def golden(oracle_dir, case: str) -> tuple[dict, str]:
    g = json.loads((oracle_dir / "golden" / f"{case}.json").read_text(encoding="utf-8"))
    text = (oracle_dir / "golden" / "prompts" / f"{case}.txt").read_text(encoding="utf-8")
    assert g["prompt_text"] == text
    return g, text


def test_dev_long_follows_hf_not_ds4(ds4_tokenizer, hf_tokenizer, oracle_dir):
    g, text = golden(oracle_dir, "dev_long")
    ds4 = g["prompt_tokens"]
    ours = ds4_tokenizer.encode_rendered(text)  # the prompt starts with the literal BOS string
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == g["hf_tokenizers_ids_for_rendered_text"]
    assert (len(ds4), len(ours)) == (733, 729)

    # Every difference is one official piece "[.]»" + newlines that ds4 cuts in two or three.
    ops = [op for op in difflib.SequenceMatcher(a=ds4, b=ours, autojunk=False).get_opcodes() if op[0] != "equal"]
    seen = []
    for kind, i1, i2, j1, j2 in ops:
        assert kind == "replace"
        ds4_parts = [ds4_tokenizer.decode([t]) for t in ds4[i1:i2]]
        our_parts = [ds4_tokenizer.decode([t]) for t in ours[j1:j2]]
        assert "".join(ds4_parts) == "".join(our_parts), "same text, different split"
        assert len(our_parts) == 1
        piece = our_parts[0]
        assert piece.rstrip("\n") in (".»", "»") and piece.endswith("\n")
        # ds4 keeps the punctuation apart from the newlines (its rule 4 takes » for a letter)
        assert ds4_parts[-1].strip("\n") == "" and "»" in "".join(ds4_parts[:-1])
        seen.append((ds4_parts, our_parts))
    assert seen == [
        ([".", "»", "\n\n"], [".»\n\n"]),
        (["»", "\n\n"], ["»\n\n"]),
        (["»", "\n"], ["»\n"]),
    ]


@pytest.mark.parametrize("case", ["raw_short", "chat_nothink"])
def test_oracle_cases_where_ds4_agrees(ds4_tokenizer, oracle_dir, case):
    g, text = golden(oracle_dir, case)
    assert g["hf_tokenizers_agree"] is True
    if g["chat"]:
        text = g["chat"]["rendered_text"]
    assert ds4_tokenizer.encode_rendered(text) == g["prompt_tokens"] == g["hf_tokenizers_ids_for_rendered_text"]


def test_pieces_at_the_divergence(ds4_tokenizer):
    """The pre-token pieces behind the dev_long difference, spelled out."""
    assert ds4_tokenizer.pre_tokenize("cosa.»\n\nE poi") == ["cosa", ".»\n\n", "E", " poi"]
    assert ds4_tokenizer.pre_tokenize("«sì»\nfine") == ["«", "sì", "»\n", "fine"]
