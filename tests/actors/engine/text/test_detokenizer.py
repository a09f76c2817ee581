"""The embedded default tokenizer, its loader, and the incremental detokenizer with stop strings."""

from __future__ import annotations

import random

import pytest

from actors.engine.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from actors.engine.text.tokenizer import DEFAULT_TOKENIZER_DIR, eos_token_ids, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_TOKENIZER_DIR)


def ids_of(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def feed_one_by_one(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add_tokens([i]).new_text for i in ids]


# ---------------------------------------------------------------- the default tokenizer


def test_default_tokenizer_layout(tok):
    assert tok.is_fast
    assert len(tok) == 2048
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>",
             "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    assert tok.convert_ids_to_tokens(list(range(7))) == names
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    assert sorted(tok.all_special_ids) == list(range(7))
    # bos is prepended on encode, like Llama-3; no eos appended.
    assert tok.encode("Hi") == [0, 46, 79]
    assert tok("Hi")["input_ids"] == [0, 46, 79]
    assert tok.decode([0, 46, 79]) == "<|begin_of_text|>Hi"
    assert tok.decode([0, 46, 79, 6, 1], skip_special_tokens=True) == "Hi"


def test_round_trips_arbitrary_unicode(tok):
    rng = random.Random(7)
    samples = [
        "", " ", "  leading and trailing  ", "tabs\tand\r\nnewlines\n\n",
        "🙂👍🏽🇫🇷 👨‍👩‍👧", "日本語のテキスト，中文。한국어", "naïve café a\u0301 ǅ ß ﬁ",
        "\x00\x01\x7f control", "\U0010ffff\ue000 private use", "<|user|> looks special",
    ]
    for _ in range(50):
        # Any code point except surrogates, which UTF-8 cannot carry.
        samples.append("".join(
            chr(c) for c in (rng.randrange(0x110000) for _ in range(rng.randrange(1, 12)))
            if not 0xD800 <= c < 0xE000
        ))
    for text in samples:
        assert tok.decode(ids_of(tok, text)) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace("<|user|>", "")
    # Marker text in user input is the marker token (as with Llama-3); the frontend must escape it.
    assert ids_of(tok, "<|user|> looks special")[0] == 4


def test_chat_template_renders_and_encodes(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    )
    ids = ids_of(tok, text)  # the template renders bos itself
    assert ids[:2] == [0, 3] and ids[-2:] == [5, 205]
    assert [i for i in ids if i < 7] == [0, 3, 6, 4, 6, 5]
    rendered = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if not isinstance(rendered, list):  # transformers 5 returns a BatchEncoding
        rendered = rendered["input_ids"]
    assert rendered == ids

    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|assistant|>\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|begin_of_text|><|user|>\nHi<|end|>\n"


def test_load_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_eos_token_ids(tok):
    assert eos_token_ids(tok) == frozenset({1})
    assert eos_token_ids(tok, {"eos_token_id": 6}) == frozenset({1, 6})
    assert eos_token_ids(tok, {"eos_token_id": [1, 6, 5]}) == frozenset({1, 5, 6})
    assert eos_token_ids(tok, {"bos_token_id": 0}) == frozenset({1})
    with pytest.raises(ValueError, match="eos_token_id"):
        eos_token_ids(tok, {"eos_token_id": "6"})


# ---------------------------------------------------------------- incremental detokenizer


def test_multibyte_characters_split_across_tokens(tok):
    ids = ids_of(tok, "\n🙂 ok 你好")
    # The emoji is four byte tokens, each CJK character three.
    assert tok.convert_ids_to_tokens(ids) == [
        "Ċ", "ð", "Ł", "Ļ", "Ĥ", "Ġo", "k", "Ġ", "ä", "½", "ł", "å", "¥", "½"]
    detok = IncrementalDetokenizer(tok, ids_of(tok, "Say hi"))
    chunks = feed_one_by_one(detok, ids)
    assert chunks == ["\n", "", "", "", "🙂", " o", "k", " ", "", "", "你", "", "", "好"]
    assert detok.flush() == ""
    assert detok.output_text == "\n🙂 ok 你好"


def test_incomplete_character_at_finish_comes_out_as_decode_writes_it(tok):
    ids = ids_of(tok, "ok 你")[:-1]  # drop the last byte of 你
    detok = IncrementalDetokenizer(tok, [])
    assert feed_one_by_one(detok, ids) == ["ok", " ", "", ""]
    assert detok.flush() == REPLACEMENT_CHAR
    assert detok.output_text == tok.decode(ids) == "ok " + REPLACEMENT_CHAR


STOP_TEXT = "The license is free software."


def test_stop_string_across_three_tokens_never_leaks(tok):
    ids = ids_of(tok, STOP_TEXT)
    assert tok.convert_ids_to_tokens(ids) == ["The", "Ġlicense", "Ġis", "Ġfree", "Ġsoftware", "."]
    stop = "se is f"  # the end of " license", all of " is", the start of " free"
    detok = IncrementalDetokenizer(tok, [0], stop=[stop])
    results = []
    for i in ids:
        results.append(detok.add_tokens([i]))
        assert not any(detok.output_text.endswith(stop[:k]) for k in range(1, len(stop) + 1))
    assert [r.new_text for r in results] == ["The", " licen", "", "", "", ""]
    assert [r.stop_hit for r in results] == [None, None, None, stop, stop, stop]
    assert detok.output_text == "The licen"
    assert detok.flush() == ""
    assert detok.output_text == "The licen"


def test_include_stop_str_in_output(tok):
    ids = ids_of(tok, STOP_TEXT)
    detok = IncrementalDetokenizer(tok, [0], stop=["se is f"], include_stop_str_in_output=True)
    assert feed_one_by_one(detok, ids) == ["The", " licen", "", "se is f", "", ""]
    assert detok.stop_hit == "se is f"
    assert detok.output_text == "The license is f"


def test_no_match_releases_everything_after_flush(tok):
    ids = ids_of(tok, STOP_TEXT)
    # Only what could start "software!" is held back: the "s" of " is", then "software".
    detok = IncrementalDetokenizer(tok, [0], stop=["software!", "xyz"])
    assert feed_one_by_one(detok, ids) == ["The", " license", " i", "s free", " ", "software."]
    assert detok.stop_hit is None
    assert detok.flush() == ""

    detok = IncrementalDetokenizer(tok, [0], stop=["software!"])
    assert feed_one_by_one(detok, ids[:-1]) == ["The", " license", " i", "s free", " "]
    assert detok.flush() == "software"
    assert detok.output_text == "The license is free software"


def test_earliest_completed_stop_wins(tok):
    ids = ids_of(tok, STOP_TEXT)
    # "free" completes before "license is free s" and "software", whatever the list order.
    for stops in (["software", "license is free s", "free"], ["free", "software", "license is free s"]):
        for chunking in ([ids], [[i] for i in ids]):
            detok = IncrementalDetokenizer(tok, [0], stop=stops)
            for chunk in chunking:
                detok.add_tokens(chunk)
            assert detok.stop_hit == "free"
            assert detok.output_text == "The license is "
    # Completing at the same character: the one that starts first wins.
    detok = IncrementalDetokenizer(tok, [0], stop=["free", "is free"])
    assert "".join(feed_one_by_one(detok, ids)) == "The license "
    assert detok.stop_hit == "is free"


def test_matches_decode_on_random_sequences(tok):
    rng = random.Random(1234)
    byte_ids = list(range(7, 263))
    for trial in range(400):
        # Half byte tokens, so invalid and split UTF-8 is common; some special tokens.
        pool = byte_ids if trial % 2 else range(len(tok))
        ids = [rng.choice(pool) if rng.random() > 0.05 else rng.randrange(7)
               for _ in range(rng.randrange(1, 30))]
        prompt = [rng.choice(pool) for _ in range(rng.randrange(0, 6))]
        skip = trial % 4 < 2
        want = tok.decode(ids, skip_special_tokens=skip)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        pos = 0
        while pos < len(ids):
            step = rng.randrange(1, 4)
            detok.add_tokens(ids[pos:pos + step])
            pos += step
            assert want.startswith(detok.output_text), (prompt, ids, skip)
        detok.flush()
        assert detok.output_text == want, (prompt, ids, skip)


def test_window_stays_short(tok):
    text = "Permission is granted to copy 🙂 and distribute 你好 this document. " * 10
    stray = ids_of(tok, "é")[1]  # the continuation byte 0xA9 on its own
    assert tok.decode([stray] * 2) == REPLACEMENT_CHAR * 2
    ids = ids_of(tok, text) + [stray] * 40 + ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, [0])
    widest = 0
    for i in ids:
        detok.add_tokens([i])
        widest = max(widest, len(detok._ids))
    detok.flush()
    assert detok.output_text == tok.decode(ids)
    assert widest <= 8
