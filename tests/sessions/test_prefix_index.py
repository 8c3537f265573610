"""The prefix index's per-page hash chains: the longest indexed prefix of any token list, at any position."""

from __future__ import annotations

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
