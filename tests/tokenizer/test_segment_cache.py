"""The cache of long plain pieces' ids behind ``Tokenizer.encode_segments`` (a resent conversation encodes once)."""

import pytest

from kda_sessions.tokenizer import ByteTokenizer, ChatTemplate, Segment, encode_chat, load_tokenizer
from kda_sessions.tokenizer.base import IdCache
from kda_sessions.tokenizer.chat import BUILTIN_TEMPLATE

from .helpers import CountingBytes as Counting
from .helpers import write_hf_tokenizer


class CountingBytes(Counting):
    SEGMENT_CACHE_MIN_CHARS = 8


def test_long_pieces_encode_once_and_short_ones_every_time():
    tok = CountingBytes()
    segs = [Segment("a long piece of text", False), Segment("<|im_end|>", True), Segment("short", False)]
    first = tok.encode_segments(segs)
    second = tok.encode_segments(segs)
    assert first == second == ByteTokenizer().encode_segments(segs)
    assert tok.encoded == ["a long piece of text", "short", "short"]
    assert tok.segment_cache.hits == 1
    second.append(0)  # the caller's list is its own: the cache is not changed through it
    assert tok.encode_segments(segs) == first


@pytest.mark.parametrize("backend", ["bytes", "hf"])
def test_a_resent_conversation_encodes_to_the_same_ids(tmp_path, backend):
    """Under a checkpoint's template (rendered whole each request; here the built-in one's text)."""
    tok = ByteTokenizer() if backend == "bytes" else load_tokenizer(write_hf_tokenizer(tmp_path))
    template = ChatTemplate(BUILTIN_TEMPLATE, special_tokens=tok.special_ids)
    body = "def read_file(path):\n    return open(path).read()\n" * 40  # over SEGMENT_CACHE_MIN_CHARS
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": body},
            {"role": "assistant", "content": "ok"}, {"role": "user", "content": body + "more"}]
    tok.SEGMENT_CACHE_MIN_CHARS = 1 << 62  # the reference: every piece through the tokenizer
    reference = encode_chat(tok, msgs, template=template)
    del tok.SEGMENT_CACHE_MIN_CHARS
    assert encode_chat(tok, msgs, template=template) == reference
    assert len(tok.segment_cache) == 2
    assert encode_chat(tok, msgs, template=template) == reference
    assert tok.segment_cache.hits == 2


def test_least_recently_used_pieces_go_past_the_bound():
    cache = IdCache(max_tokens=10, id_objects=tuple(range(16)))
    cache.put((None, "a"), [1, 2, 3, 4])
    cache.put((None, "b"), [5, 6, 7, 8])
    assert cache.get((None, "a")) is not None  # "b" is now the least recently used
    cache.put((None, "c"), [9, 10, 11])
    assert cache.tokens == 7 and cache.get((None, "b")) is None
    assert list(cache.get((None, "a"))) == [1, 2, 3, 4] and list(cache.get((None, "c"))) == [9, 10, 11]
    cache.put((None, "a"), [1])  # replaced: its old ids no longer count
    assert cache.tokens == 4
    cache.put((None, "huge"), list(range(11)))  # longer than the bound: not kept, nothing dropped for it
    assert cache.get((None, "huge")) is None and len(cache) == 2


def test_ids_are_kept_as_shared_objects_and_any_id_as_it_is():
    table = tuple(range(2000))
    cache = IdCache(max_tokens=100, id_objects=table)
    ids = [int("1003"), int("1007")]  # above 256: a new int object each
    cache.put((None, "a"), ids)
    kept = cache.get((None, "a"))
    assert kept == (1003, 1007) and kept[0] is table[1003] and kept[0] is not ids[0]
    for outside in ([-1, 3], [3, 2000], [7]):  # below or past the table, or alone: the values as they came
        cache.put((None, "b"), outside)
        assert cache.get((None, "b")) == tuple(outside)


def test_tenants_pieces_are_kept_apart():
    """One tenant's request never finds another's piece (which would time as a hit): each scope encodes its own."""
    tok = CountingBytes()
    segs = [Segment("a long piece of text", False)]
    assert tok.encode_segments(segs, scope="acme") == tok.encode_segments(segs, scope="globex")
    assert tok.encoded == ["a long piece of text"] * 2 and tok.segment_cache.hits == 0
    tok.encode_segments(segs, scope="acme")
    assert tok.encoded == ["a long piece of text"] * 2 and tok.segment_cache.hits == 1


async def test_sessions_encode_under_their_tenant():
    import kda_sessions as ks

    body = "x" * 600  # over SEGMENT_CACHE_MIN_CHARS
    async with await ks.Engine.open(store="memory:") as eng:
        cache = eng.tokenizer.segment_cache
        a = await (await eng.for_tenant("acme")).create_session_from_messages([{"role": "user", "content": body}])
        assert cache.get(("acme", body)) is not None and cache.get((None, body)) is None
        await a.send(body + "!", max_tokens=1)
        assert cache.get(("acme", body + "!")) is not None and cache.get(("globex", body + "!")) is None
        stats = eng.stats()
        assert stats["segment_cache_pieces"] == 2 and stats["segment_cache_tokens"] == 2 * 600 + 1
        assert stats["segment_cache_hits"] == cache.hits >= 2
