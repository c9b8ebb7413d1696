"""The tiny tokenizer (made offline, loaded by transformers' AutoTokenizer), incremental
detokenization against the tokenizer's decode of the whole sequence (multi-byte characters
split across tokens, invalid byte runs, special tokens), and stop strings."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvsched.http.text import StopStrings, TextModel
from kvsched.tinymodel.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, make_tokenizer
from tests.http.harness import text_of

MULTIBYTE = "Grüße aus 東京! こんにちは 🙂🚀 crème brûlée, Привет, مرحبا → ✓ naïve café"


def test_make_tokenizer_writes_a_loadable_tokenizer_with_a_chat_template(tmp_path: Path) -> None:
    d = make_tokenizer(tmp_path / "t", vocab_size=400)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["bos_token"] == "<s>" and cfg["eos_token"] == "</s>"
    tok = AutoTokenizer.from_pretrained(str(d))
    assert len(tok) == 400
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    assert tok("Hello").input_ids[0] == BOS_TOKEN_ID
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # Same training data, same tokenizer: a rebuilt directory encodes identically.
    again = AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path / "u", vocab_size=400)))
    assert again(MULTIBYTE).input_ids == tok(MULTIBYTE).input_ids
    with pytest.raises(ValueError, match="vocab_size must be"):
        make_tokenizer(tmp_path / "v", vocab_size=100)


def test_every_id_of_the_vocabulary_decodes(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 512
    for i in range(5, 512):
        assert tok.decode([i]) != "", i


def _stream(text: TextModel, ids: list[int], rng: random.Random) -> str:
    """Push `ids` in batches of random sizes (as engine steps deliver them)."""
    d = text.detokenizer()
    out, pos = [], 0
    while pos < len(ids):
        n = rng.randint(1, 4)
        out.append(d.push(ids[pos : pos + n]))
        pos += n
    return "".join(out)


def test_incremental_detokenization_equals_decode_of_the_whole_sequence(model_dir: Path) -> None:
    text = TextModel(str(model_dir))
    rng = random.Random(7)
    ids = text.hf(MULTIBYTE, add_special_tokens=False).input_ids
    # Multi-byte characters really are split across tokens in this vocabulary.
    assert any("\ufffd" in text.hf.decode([i]) for i in ids)
    assert _stream(text, ids, rng) == MULTIBYTE == text.hf.decode(ids)
    # Pieces never contain a half character: each piece is valid text on its own.
    d = text.detokenizer()
    pieces = [d.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MULTIBYTE
    # Random ids (what the sim emits): special tokens skipped, invalid byte runs inside the
    # text as U+FFFD, an incomplete last character dropped (vLLM's text, harness.text_of).
    ended_inside = 0
    for seed in range(50):
        r = random.Random(seed)
        ids = [r.randrange(0, 512) for _ in range(80)]
        whole = text.hf.decode(ids, skip_special_tokens=True)
        got = _stream(text, ids, rng)
        assert got == text_of(text.hf, ids)
        assert not got.endswith("\ufffd") and whole.startswith(got)
        ended_inside += got != whole
    assert ended_inside > 0  # the case is exercised


def test_a_text_ending_inside_a_character_drops_its_bytes(model_dir: Path) -> None:
    """ "é" is two bytes; a sequence cut after its first byte ends without U+FFFD (vLLM)."""
    text = TextModel(str(model_dir))
    ids = text.hf("café", add_special_tokens=False).input_ids
    byte_ids = [i for i in range(5, 512) if text.hf.decode([i]) == "\ufffd"]
    cut = ids[:-1] if text.hf.decode(ids[:-1]).endswith("\ufffd") else ids + byte_ids[:1]
    assert text.hf.decode(cut).endswith("\ufffd")
    d = text.detokenizer()
    out = d.push(cut)
    assert out and not out.endswith("\ufffd") and text.hf.decode(cut).startswith(out)


def test_detokenizer_primed_with_the_prompt(model_dir: Path) -> None:
    """As vLLM's, the decode stream starts after the prompt: output equals decoding prompt +
    output minus decoding the prompt (here a prompt ending in a complete character)."""
    text = TextModel(str(model_dir))
    prompt = text.hf("Hello there", add_special_tokens=False).input_ids
    out_ids = text.hf(" café 東京", add_special_tokens=False).input_ids
    d = text.detokenizer(True, prompt)
    assert d.push(out_ids) == text.hf.decode(prompt + out_ids)[len(text.hf.decode(prompt)) :]


def test_stop_strings_cut_before_the_earliest_and_hold_back_a_possible_start() -> None:
    s = StopStrings(["STOP", "ab"])
    first = s.feed("hello S")
    assert first == "hell"  # the last len("STOP") - 1 characters wait: "o S" may begin it
    pieces = [first] + [s.feed(x) for x in ("T", "x more", "ore S", "TOP and more")]
    assert "".join(pieces) == s.text == "hello STx moreore "  # "STOP" straddled two feeds
    assert s.hit == "STOP"
    assert s.feed("anything") == "" and s.flush() == ""
    t = StopStrings(["xyz", "b"])
    assert t.feed("aaxyzab") == "aa" and t.hit == "xyz"  # the earliest match wins
    u = StopStrings([])
    assert u.feed("abc") == "abc" and u.flush() == "" and u.hit is None
    v = StopStrings(["END"])
    assert v.feed("the E") == "the" and v.flush() == " E"  # ended without the stop string
