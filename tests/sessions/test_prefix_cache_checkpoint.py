"""A checkpoint named while tokens are pending holds their state: a fork from it re-prefills nothing of its prefix."""

from __future__ import annotations

import kda_sessions as ks

PROMPT = list(range(40, 140))  # 100 byte tokens: several KV pages (page_size 16)


async def test_checkpoint_before_any_prefill_holds_the_state():
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session()
        s.state.tokens.extend(PROMPT)  # pending, as after a create_session_from_messages with no call yet
        info = await s.checkpoint("start")
        assert info.position == len(PROMPT)
        cp = s.state.checkpoints["start"]
        assert cp.state_pos == cp.target == len(PROMPT) - 1
        child = await eng.fork(s.id, checkpoint="start")
        got = await child.generate(max_tokens=6, ignore_eos=True)
        # only the prefix's last token is fed again (checkpoints keep the state one token short, for logits)
        assert got.usage.prefill_tokens == 1
        assert got.usage.cached_tokens == len(PROMPT) - 1
        ref = await eng.create_session()
        await ref.append(PROMPT)
        want = await ref.generate(max_tokens=6, ignore_eos=True)
        assert got.token_ids == want.token_ids


async def test_checkpoint_of_a_new_chat_session_holds_its_head():
    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        s = await eng.create_session(system="You are a careful coding agent. " * 4)
        head = s.num_tokens
        await s.checkpoint("head-named")
        child = await eng.fork(s.id, checkpoint="head-named")
        r = await child.send("hi", max_tokens=4, ignore_eos=True)
        assert r.usage.cached_tokens == head - 1


async def test_a_resumed_session_files_its_checkpoints_where_its_tokens_put_them(tmp_path):
    """load_session files checkpoints under the keys its manifest stores (no page chain on the resume path):
    the same keys the tokens give, so a new session with the same prefix finds them."""
    from kda_sessions.sessions.prefix_index import prefix_key

    store = f"disk:{tmp_path}"
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        s = await eng.create_session()
        await s.append(PROMPT[:37])
        await s.checkpoint("mid")
        await s.append(PROMPT[37:])
        await s.checkpoint("end")
        await s.save()
        sid = s.id
    async with await ks.Engine.open(store=store, page_size=16) as eng:
        r = await eng.resume(sid)
        index = eng.io.index
        for name, position in (("mid", 37), ("end", len(PROMPT))):
            assert index.key_of(sid, name, position) == prefix_key(r.state.tokens, position, 16), name
        hit = index.longest([*PROMPT, 7, 8])
        assert hit is not None and (hit.session_id, hit.checkpoint) == (sid, "end")


async def test_a_resent_conversation_hashes_its_pages_once(monkeypatch):
    """A session made from a resent history (stateless chat) keeps the page chain its prefix lookup computed, and a
    fork keeps its parent's: their next checkpoints hash only pages past them."""
    from kda_sessions.sessions import prefix_index

    async with await ks.Engine.open(store="memory:", page_size=16) as eng:
        history = [{"role": "user", "content": "read this: " + "x" * 300}]
        first = await eng.create_session_from_messages(history)
        reply = await first.send("and this: " + "y" * 200, max_tokens=4, ignore_eos=True)
        resent = [*history, {"role": "user", "content": "and this: " + "y" * 200},
                  {"role": "assistant", "content": reply.text}]
        calls = []
        real = prefix_index._link
        monkeypatch.setattr(prefix_index, "_link", lambda parent, tokens: calls.append(1) or real(parent, tokens))
        s = await eng.create_session_from_messages(resent)
        assert s.state.num_cached > 0  # started from the first session's checkpoint
        n = len(s.state.tokens)
        looked_up = len(calls)
        assert looked_up >= n // 16 - 1  # the lookup hashed the resent tokens' pages
        calls.clear()
        assert prefix_index.page_chain(s.state.tokens, 16, n // 16) == prefix_index.page_chain(
            list(s.state.tokens), 16, n // 16)
        assert len(calls) == n // 16  # the plain list's chain only: the session's was kept
        child = await eng.fork(s.id)
        calls.clear()
        prefix_index.page_chain(child.state.tokens, 16, n // 16)
        assert calls == []
