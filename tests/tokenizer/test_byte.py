import pytest
from hypothesis import given
from hypothesis import strategies as st

from kda_sessions.tokenizer import BYTE_SPECIALS, ByteTokenizer

TOK = ByteTokenizer()


def test_layout_is_fixed():
    assert TOK.vocab_size == 272
    assert TOK.token_to_id("<|im_end|>") == 256
    assert TOK.token_to_id("<|tool_call_end|>") == 265
    assert TOK.token_to_id("<|bos|>") == 266
    assert TOK.token_to_id("<|pad|>") == 267
    assert TOK.token_to_id("<|reserved_15|>") == 271
    assert TOK.id_to_token(258) == "<|im_assistant|>"
    assert TOK.eos_ids == {256}
    assert len(BYTE_SPECIALS) == 16


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld", "日本語", "emoji 🦀🧪", "\x00\n\t"], ids=repr)
def test_round_trip(text):
    ids = TOK.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert TOK.decode(ids) == text


@given(st.text())
def test_round_trip_any_text(text):
    assert TOK.decode(TOK.encode(text)) == text
    assert TOK.decode(TOK.encode(text, allow_special=True)) == text


def test_specials_only_with_allow_special():
    text = "a<|im_end|>b"
    assert TOK.encode(text) == list(text.encode())
    assert TOK.encode(text, allow_special=True) == [ord("a"), 256, ord("b")]
    assert TOK.decode([ord("a"), 256, ord("b")]) == text
    assert TOK.decode([ord("a"), 256, ord("b")], skip_special=True) == "ab"


def test_unknown_id_is_an_error():
    with pytest.raises(ValueError, match="272"):
        TOK.decode([272])
    with pytest.raises(KeyError, match="nope"):
        TOK.token_to_id("<|nope|>")


def _stream(tok, ids, skip_special=False):
    dec = tok.incremental_decoder(skip_special=skip_special)
    pieces = [dec.feed(i) for i in ids]
    return pieces, dec.flush()


def test_incremental_never_emits_half_a_character():
    text = "a日🦀b"
    pieces, tail = _stream(TOK, TOK.encode(text))
    assert tail == ""
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # '日' is 3 bytes: nothing until the third, then the whole character
    assert pieces[1:4] == ["", "", "日"]


@given(st.text())
def test_incremental_equals_whole(text):
    ids = TOK.encode(text, allow_special=True)
    pieces, tail = _stream(TOK, ids)
    assert "".join(pieces) + tail == TOK.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_incremental_specials():
    ids = [*"é".encode(), 256, *b"x"]
    pieces, _ = _stream(TOK, ids)
    assert pieces == ["", "é", "<|im_end|>", "x"]
    pieces, _ = _stream(TOK, ids, skip_special=True)
    assert "".join(pieces) == "éx"


def test_incremental_special_after_incomplete_character_flushes_it():
    ids = ["日".encode()[0], 256]
    pieces, tail = _stream(TOK, ids)
    assert pieces == ["", "\ufffd<|im_end|>"]
    assert tail == ""


def test_incremental_invalid_bytes_do_not_stall_forever():
    ids = [0xFF] * 20 + [ord("a")]
    pieces, tail = _stream(TOK, ids)
    assert "".join(pieces) + tail == TOK.decode(ids)
