"""The prefix index's per-page hash chains: the longest indexed prefix of any token list, at any position."""

from __future__ import annotations

import random

import pytest

from kda_sessions.sessions.prefix_index import PrefixHit, PrefixIndex, PrefixKey, prefix_key

P = 4
TOKENS = list(range(100, 130))


def _index(*positions: int) -> PrefixIndex:
    index = PrefixIndex(P)
    for p in positions:
        index.add(TOKENS, PrefixHit("a", f"at-{p}", p))
    return index


def test_longest_first_at_page_boundaries_and_inside_pages():
    index = _index(5, 8, 13, 21)
    assert [h.position for h in index.matches(TOKENS)] == [21, 13, 8, 5]
    assert [h.position for h in index.matches(TOKENS, max_len=12)] == [8, 5]
    assert index.longest(TOKENS[:13]).position == 13


def test_a_different_token_cuts_the_chain_where_it_differs():
    index = _index(5, 8, 13, 21)
    other = [*TOKENS[:10], 0, *TOKENS[11:]]  # token 10 differs: prefixes up to 10 tokens still match
    assert [h.position for h in index.matches(other)] == [8, 5]
    tail = [*TOKENS[:12], 0]  # differs inside the last partial page of the 13-token entry
    assert index.longest(tail).position == 8
    assert index.longest([0, *TOKENS[1:]]) is None


def test_remove_leaves_other_holders_of_the_same_prefix():
    index = _index(13)
    index.add(TOKENS, PrefixHit("b", "copy", 13))
    assert {h.session_id for h in index.matches(TOKENS)} == {"a", "b"}
    index.remove("a", "at-13")
    assert [h.session_id for h in index.matches(TOKENS)] == ["b"]
    index.remove_session("b")
    assert index.longest(TOKENS) is None and len(index) == 0


def test_stored_keys_round_trip_and_index_without_tokens():
    key = prefix_key(TOKENS, 13, P)
    again = PrefixKey.from_json(key.to_json())
    assert again == key and PrefixKey.from_json("a whole-prefix sha256 of an older format") is None
    index = PrefixIndex(P)
    index.add_key(again, PrefixHit("restarted", "msg-3", 13))
    assert index.longest(TOKENS).session_id == "restarted"
    assert index.indexed(TOKENS, [8, 13, 20]) == {13}


def test_add_many_files_each_checkpoint_where_add_files_it():
    positions = [0, 3, 4, 5, 8, 13, 21, 30, 31]  # 0 and 31 (past the tokens) are not indexed, as by add
    many = PrefixIndex(P)
    many.add_many(TOKENS, [PrefixHit("a", f"at-{p}", p) for p in positions])
    for p in positions:
        key = many.key_of("a", f"at-{p}", p)
        if 0 < p <= len(TOKENS):
            assert key == prefix_key(TOKENS, p, P), p
        else:
            assert key is None, p
    assert [h.position for h in many.matches(TOKENS)] == [30, 21, 13, 8, 5, 4, 3]


def test_token_list_keeps_its_chain_through_every_kind_of_change():
    """A ``TokenList``'s kept chain equals the chain of the same tokens as a plain list after any sequence of
    changes (growth, and changes below its end, which drop keys), at two page sizes."""
    import random

    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    rng = random.Random(3)
    kept, plain = TokenList(range(37)), list(range(37))
    ops = ["append", "extend", "iadd", "setitem", "setslice", "del", "delslice", "insert", "pop", "pop_end",
           "remove", "clear", "sort", "reverse", "imul"]
    for step in range(400):
        op = rng.choice(ops)
        n = len(plain)
        i = rng.randrange(-n, n) if n else 0
        v = rng.randrange(50)
        for t in (kept, plain):
            if op == "append":
                t.append(v)
            elif op == "extend":
                t.extend(range(v, v + 1 + step % 8))
            elif op == "iadd":
                t += [v, v + 1]
            elif op == "setitem" and n:
                t[i] = v
            elif op == "setslice":
                t[i : i + 2] = [v] * (step % 4)
            elif op == "del" and n:
                del t[i]
            elif op == "delslice":
                del t[i:]
            elif op == "insert":
                t.insert(i, v)
            elif op == "pop" and n:
                t.pop(i)
            elif op == "pop_end" and n:
                t.pop()
            elif op == "remove" and v in plain:
                t.remove(v)
            elif op == "clear" and step % 7 == 0:
                t.clear()
            elif op == "sort" and step % 5 == 0:
                t.sort()
            elif op == "reverse" and step % 5 == 0:
                t.reverse()
            elif op == "imul" and step % 9 == 0:
                t *= 1 if step % 2 else 0
        assert kept == plain and type(kept) is TokenList
        size = 4 if step % 3 else 16
        pages = rng.randint(0, -(-len(plain) // size))  # a partial last page too (page_chain keeps none of it)
        assert page_chain(kept, size, pages) == page_chain(plain, size, pages), (step, op)


def test_token_list_hashes_only_new_pages(monkeypatch):
    """After a chain of 8 pages, growing by one page hashes one page; a change inside page 2 re-hashes from it."""
    from kda_sessions.sessions import prefix_index
    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    calls = []
    real = prefix_index._link
    monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    t = TokenList(range(8 * P))
    page_chain(t, P, 8)
    assert len(calls) == 8
    t.extend(range(P))
    calls.clear()
    assert page_chain(t, P, 9) == page_chain(list(t), P, 9)
    assert len(calls) == 1 + 9  # the kept chain's new page, then the plain list's whole chain
    t[2 * P + 1] = -1
    calls.clear()
    page_chain(t, P, 9)
    assert len(calls) == 7  # pages 2..8


def test_token_list_copies_keep_no_shared_keys():
    """A copy grows apart from its original: neither sees the other's pages in its chain."""
    import copy

    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    t = TokenList(range(4 * P))
    page_chain(t, P, 4)
    for c in (copy.copy(t), copy.deepcopy(t)):
        assert type(c) is TokenList and c == t
        t.extend([1] * P)
        c.extend([2] * P)
        assert page_chain(t, P, len(t) // P) == page_chain(list(t), P, len(t) // P)
        assert page_chain(c, P, 5) == page_chain(list(c), P, 5)
        del t[4 * P :]


def test_session_state_tokens_are_a_token_list():
    from kda_sessions.sessions.prefix_index import TokenList
    from kda_sessions.sessions.state import SessionState

    s = SessionState(id="s", tokens=[1, 2, 3])
    assert type(s.tokens) is TokenList and s.tokens == [1, 2, 3]
    assert type(SessionState(id="t").tokens) is TokenList


def test_token_list_head_starts_with_its_full_pages_keys(monkeypatch):
    """A fork's tokens (``head``) hash only the pages after its parent's kept ones, and never share its chain."""
    from kda_sessions.sessions import prefix_index
    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    t = TokenList(range(6 * P + 2))
    page_chain(t, P, 6)
    calls = []
    real = prefix_index._link
    monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    for n in (0, 1, P, 3 * P + 1, 6 * P + 2):
        h = t.head(n)
        assert type(h) is TokenList and h == t[:n]
        calls.clear()
        assert page_chain(h, P, n // P) == page_chain(t[:n], P, n // P)
        assert len(calls) == n // P  # only the plain list's chain: the head's keys were all kept
    h = t.head(5 * P)
    h[P] = -1  # a change in the head's page 1 leaves the parent's chain as it was
    h.extend(range(2 * P))
    assert page_chain(h, P, 7) == page_chain(list(h), P, 7)
    assert page_chain(t, P, 6) == page_chain(list(t), P, 6)
    assert TokenList([1, 2]).head(1) == [1]  # nothing kept yet: a plain copy


def test_token_list_continued_by_keeps_keys_only_of_a_true_prefix(monkeypatch):
    """A resent conversation takes the keys of the tokens that begin it (only its new pages hashed), and nothing
    from a list that differs anywhere, is longer, or kept no keys."""
    from kda_sessions.sessions import prefix_index
    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    t = TokenList(range(5 * P + 3))
    page_chain(t, P, 5)
    calls = []
    real = prefix_index._link
    monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    longer = list(t) + list(range(1000, 1000 + 3 * P))
    keyed = t.continued_by(longer)
    assert type(keyed) is TokenList and keyed == longer and keyed is not longer
    calls.clear()
    assert page_chain(keyed, P, 8) == page_chain(longer, P, 8)
    assert len(calls) == 3 + 8  # the keyed list's three new pages, then the plain list's whole chain
    for other in (list(t)[:-1], [*list(t)[:P], -1, *list(t)[P + 1:], 7], [-1, *list(t)[1:], 7]):
        assert t.continued_by(other) is None
    assert TokenList([1, 2]).continued_by([1, 2, 3]) is None  # no keys kept yet
    # its first n tokens only (a reply that did not re-encode as sampled): the keys of their full pages
    differs = [*list(t)[: 3 * P + 5], -7, *range(2 * P)]
    assert t.continued_by(differs) is None and t.continued_by(differs, 3 * P + 6) is None
    keyed3 = t.continued_by(differs, 3 * P + 5)
    assert keyed3 == differs
    calls.clear()
    assert page_chain(keyed3, P, 5) == page_chain(differs, P, 5)
    assert len(calls) == (5 - (3 * P + 5) // P) + 5  # the pages from the one holding the change on, then all
    keyed.append(5)  # the copy's changes leave the original's keys alone
    keyed[0] = -1
    assert page_chain(t, P, 5) == page_chain(list(t), P, 5)


@pytest.mark.parametrize("block", [1, 2, 7, 64, 1 << 14])
def test_common_prefix_against_an_element_by_element_scan(block, monkeypatch):
    """``common_prefix`` at several slice sizes (the first differing slice narrowed down) against a plain scan:
    random lists sharing a random prefix, differing anywhere, of any lengths, with limits below, inside and past
    them."""
    from kda_sessions.sessions import prefix_index
    from kda_sessions.sessions.prefix_index import common_prefix

    monkeypatch.setattr(prefix_index, "COMPARE_BLOCK", block)
    rng = random.Random(block)
    for _ in range(400):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 300))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        limit = rng.choice([None, rng.randrange(-2, 400)])
        end = min(len(a), len(b)) if limit is None else max(0, min(limit, len(a), len(b)))
        expected = 0
        while expected < end and a[expected] == b[expected]:
            expected += 1
        assert common_prefix(a, b, limit) == expected


def test_take_keys_takes_the_first_count_whose_tokens_begin_the_list():
    """The counts are tried in order (the whole session, then up to its last message) on one comparison: the
    whole where it fits, else the first shorter count within the common prefix; none past it."""
    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    t = TokenList(range(6 * P))
    page_chain(t, P, 6)
    resent = [*range(4 * P + 1), -1, *range(P)]  # agrees with t up to 4 P + 1 tokens
    keyed = TokenList(resent)
    assert keyed.take_keys(t, (len(t), 4 * P + 1, 2 * P))
    assert keyed.keys_of(4 * P + 1) == t.keys_of(4 * P + 1)  # the first count that fits, not the later 2 P
    assert page_chain(keyed, P, 5) == page_chain(list(resent), P, 5)
    assert not TokenList(resent).take_keys(t, (len(t), 4 * P + 2))
    assert not TokenList(resent).take_keys(t, (0, len(t) + 1))  # counts past either list, or none, never fit
    whole = TokenList([*range(6 * P), 9])
    assert whole.take_keys(t, (len(t), 2 * P)) and whole.keys_of(6 * P) == t.keys_of(6 * P)


def test_take_keys_keys_a_list_in_place_only_where_it_is_begun(monkeypatch):
    """A request's TokenList (``encode_chat(out=TokenList())``) takes the served session's keys in place, no copy:
    only where its first n tokens begin it, and only while it keeps none of its own."""
    from kda_sessions.sessions import prefix_index
    from kda_sessions.sessions.prefix_index import TokenList, page_chain

    served = TokenList(range(5 * P + 2))
    page_chain(served, P, 5)
    fresh = TokenList([*range(5 * P + 2), *range(100, 100 + 2 * P)])
    assert not fresh.keeps_keys
    assert not fresh.take_keys(TokenList(range(5 * P)), (5 * P,))  # a list that keeps no keys gives none
    different = TokenList([-1, *range(1, 5 * P + 2)])
    assert not different.take_keys(served, (len(served), 3 * P)) and not different.keeps_keys
    assert fresh.take_keys(served, (len(served),)) and fresh.keeps_keys
    calls = []
    real = prefix_index._link
    monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
    assert page_chain(fresh, P, 7) == page_chain(list(fresh), P, 7)
    assert len(calls) == 2 + 7  # its two new full pages past the five taken, then the plain list's whole chain
    assert not fresh.take_keys(served, (len(served),))  # it keeps keys of its own now: nothing replaced
