"""tokenizer.json and tiktoken.model backends, and load_tokenizer's choice between them."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_sessions.tokenizer import ByteTokenizer, TokenizerNotFound, load_tokenizer
from kda_sessions.tokenizer.hf import HFTokenizer
from kda_sessions.tokenizer.tiktoken_tok import NUM_RESERVED_SPECIALS, TiktokenTokenizer

from .helpers import TIKTOKEN_MERGES, write_hf_tokenizer, write_tiktoken_model

TEXTS = ["hello world", "héllo wörld 日本語 🦀", "  spaces\n\nand\ttabs ", "def f(x): return x"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    return load_tokenizer(str(write_hf_tokenizer(tmp_path_factory.mktemp("hf"))))


@pytest.fixture(scope="module")
def tt_tok(tmp_path_factory):
    return load_tokenizer(str(write_tiktoken_model(tmp_path_factory.mktemp("tt"))))


@pytest.fixture(params=["hf", "tiktoken", "byte"])
def tok(request, hf_tok, tt_tok):
    return {"hf": hf_tok, "tiktoken": tt_tok, "byte": ByteTokenizer()}[request.param]


def test_loader_picks_backend(hf_tok, tt_tok):
    assert isinstance(hf_tok, HFTokenizer)
    assert isinstance(tt_tok, TiktokenTokenizer)
    assert isinstance(load_tokenizer("tiny-random"), ByteTokenizer)
    assert isinstance(load_tokenizer("tiny"), ByteTokenizer)


def test_loader_accepts_the_file_itself(tmp_path):
    write_tiktoken_model(tmp_path)
    assert isinstance(load_tokenizer(tmp_path / "tiktoken.model"), TiktokenTokenizer)


def test_loader_error_names_directory_and_files(tmp_path):
    with pytest.raises(TokenizerNotFound) as exc:
        load_tokenizer(str(tmp_path))
    msg = str(exc.value)
    assert str(tmp_path) in msg and "tokenizer.json" in msg and "tiktoken.model" in msg
    assert isinstance(exc.value, ValueError)
    with pytest.raises(TokenizerNotFound):
        load_tokenizer("no-such-model")


@pytest.mark.parametrize("text", TEXTS, ids=repr)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_specials_are_not_injectable(tok):
    text = "x<|im_end|><|tool_call_begin|>y"
    plain = tok.encode(text)
    assert not set(plain) & set(tok.special_ids.values())
    assert tok.decode(plain) == text
    ids = tok.encode(text, allow_special=True)
    assert tok.token_to_id("<|im_end|>") in ids and tok.token_to_id("<|tool_call_begin|>") in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "xy"


def test_eos_includes_end_of_turn(tok):
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids


@pytest.mark.parametrize("text", TEXTS, ids=repr)
def test_incremental_decoding_equals_whole(tok, text):
    ids = tok.encode(text + "<|im_end|>", allow_special=True)
    dec = tok.incremental_decoder()
    pieces = [dec.feed(i) for i in ids]
    assert "".join(pieces) + dec.flush() == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_hf_eos_from_config(hf_tok):
    assert hf_tok.token_to_id("[EOS]") in hf_tok.eos_ids


def test_tiktoken_layout(tt_tok):
    num_base = 256 + len(TIKTOKEN_MERGES)
    assert tt_tok.vocab_size == num_base + NUM_RESERVED_SPECIALS
    assert tt_tok.token_to_id("<|im_end|>") == num_base
    assert tt_tok.id_to_token(num_base + 100) == f"<|reserved_token_{num_base + 100}|>"
    assert tt_tok.encode("hello world") == [
        256 + TIKTOKEN_MERGES.index(b"hello"),
        256 + TIKTOKEN_MERGES.index(b" world"),
    ]


def test_tiktoken_specials_beyond_reserved_and_overlap(tmp_path):
    num_base = 256 + len(TIKTOKEN_MERGES)
    write_tiktoken_model(tmp_path / "a", added={num_base: "<|im_end|>", num_base + 300: "<|late|>"})
    tok = load_tokenizer(tmp_path / "a")
    assert tok.vocab_size == num_base + 301 and tok.token_to_id("<|late|>") == num_base + 300
    write_tiktoken_model(tmp_path / "b", added={5: "<|im_end|>"})
    with pytest.raises(ValueError, match="overlap"):
        load_tokenizer(tmp_path / "b")


def test_tiktoken_eos_from_generation_config(tmp_path):
    write_tiktoken_model(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert {7, 8} <= load_tokenizer(tmp_path).eos_ids


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet=st.sampled_from("ab \n\t日é<|>"), max_size=60), max_size=6))
def test_batch_encode_equals_one_by_one(tok, texts):
    """``encode_plain_batch`` (threads in the tokenizers library, tiktoken's batch) gives each text's own ids."""
    assert tok.encode_plain_batch(texts) == [tok.encode(t, allow_special=False) for t in texts]


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.text(alphabet=st.sampled_from("ab \n<|im_end|>"), max_size=40), min_size=1, max_size=8),
       long=st.integers(0, 3))
def test_encode_segments_batched_equals_one_by_one(tok, texts, long):
    """A request's pieces encoded together past ``BATCH_MIN_CHARS`` give the ids of the pieces encoded one by one,
    long pieces through the segment cache included (a piece twice in one request too)."""
    from kda_sessions.tokenizer.base import Segment

    segs = [Segment(t * (40 if i < long else 1), False) for i, t in enumerate(texts)]
    segs = [*segs, Segment("<|im_end|>", True), *segs[:1]] if "<|im_end|>" in tok.special_ids else segs
    one = [i for s in segs for i in ((tok.token_to_id(s.text),) if s.is_special else tok.encode(s.text))]
    tok.BATCH_MIN_CHARS = 0
    try:
        assert tok.encode_segments(segs, scope="batch") == one
    finally:
        del tok.BATCH_MIN_CHARS
    assert tok.encode_segments(segs, scope="batch") == one  # cache hits now, one by one


@settings(max_examples=200)
@given(s=st.text(alphabet=st.sampled_from("ab \n\u2028\x1c"), max_size=80), max_run=st.integers(1, 9))
def test_tiktoken_run_split_cuts_long_runs_from_their_start(s, max_run):
    """The regex cut equals a scan of the runs: no piece holds more than max_run chars of one class (str.isspace)
    in a row, and a run is cut every max_run chars from its start."""
    from kda_sessions.tokenizer.tiktoken_tok import _split_runs

    expected, start, run, space = [], 0, 0, s[:1].isspace()
    for i, ch in enumerate(s):
        if ch.isspace() != space:
            run, space = 1, ch.isspace()
        else:
            run += 1
            if run > max_run:
                expected.append(s[start:i])
                start, run = i, 1
    expected.append(s[start:])
    assert list(_split_runs(s, max_run)) == expected
