"""The host's work of a chat request at long contexts, before the model runs: an agent's conversation of N tokens
(tool outputs of real source files, short assistant turns) under a byte-level BPE trained here on this repository
(32K ids asked, ~9.2K learnt from this small corpus; real checkpoints' tokenizers are not on this
machine), ms on the event loop:

- stateless (OpenAI-style, the whole history resent, parsed afresh each request): render the conversation
  and encode it (``encode_chat``), the first request and the next one (same history, one more message); the
  next one also rendered whole (the built-in template's text as a checkpoint's template: no
  ``Tokenizer.message_cache``; its messages prepared once, ``ChatTemplate.render_segments``), and rendered whole
  without ``Tokenizer.segment_cache`` either; then its page
  chain (``page_chain`` of the ids as a plain list), and after the session that served the previous request
  (its tokens' keys taken where they begin the new ids, ``TokenList.take_keys``);
- a session's turn under a checkpoint's chat template (``encode_chat_turn``: the history rendered alone and with
  the new message, with and without the generation prompt, ``ChatTemplate.render_deltas``).

    python bench/request_host.py --contexts 131072,1048576
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kda_sessions.sessions.prefix_index import TokenList, page_chain
from kda_sessions.tokenizer import ChatTemplate, Tokenizer, encode_chat, encode_chat_turn, load_tokenizer
from kda_sessions.tokenizer.chat import BUILTIN_TEMPLATE, CHAT_SPECIALS

ROOT = Path(__file__).resolve().parents[1]


def sources() -> list[str]:
    return [p.read_text() for p in sorted((ROOT / "kda_sessions").rglob("*.py")) if p.stat().st_size > 2000]


def train_tokenizer(directory: Path, texts: list[str]) -> Tokenizer:
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=32768, special_tokens=list(CHAT_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return load_tokenizer(directory)


def conversation(tok: Tokenizer, files: list[str], n_tokens: int) -> list[dict]:
    """System prompt, then (assistant's call, tool's output of one file) pairs up to ~n_tokens."""
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent. " * 40},
                        {"role": "user", "content": "Read the code and fix the failing test."}]
    total, i = 0, 0
    while total < n_tokens:
        text = files[i % len(files)]
        msgs.append({"role": "assistant", "content": f"Reading file {i}."})
        msgs.append({"role": "tool", "content": text, "tool_call_id": f"functions.read:{i}"})
        total += len(tok.encode(text)) + 16
        i += 1
    return msgs


def ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 1)


def parsed(msgs: list[dict], n: int) -> Iterator[list[dict]]:
    """``n`` copies of the messages as requests' JSON bodies parse them: new objects each (no string keeps
    its hash), made before the timing."""
    return iter([json.loads(json.dumps(msgs)) for _ in range(n)])


def case(tok: Tokenizer, files: list[str], n: int) -> dict:
    msgs = conversation(tok, files, n)
    t = time.perf_counter()
    ids = encode_chat(tok, msgs, add_generation_prompt=True)  # the caches are empty: the first request
    first = (time.perf_counter() - t) * 1e3
    more = [*msgs, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Go on."}]
    requests = parsed(more, 7)  # one a timed request
    nxt = ms(lambda: encode_chat(tok, next(requests), add_generation_prompt=True))
    # the built-in template's text as a checkpoint's: the same ids, the whole history rendered each time
    checkpoint = ChatTemplate(BUILTIN_TEMPLATE, special_tokens=tok.special_ids)
    whole = ms(lambda: encode_chat(tok, next(requests), add_generation_prompt=True, template=checkpoint))
    tok.SEGMENT_CACHE_MIN_CHARS = 1 << 62  # the segment cache off too: every piece through the tokenizer
    uncached = ms(lambda: encode_chat(tok, next(requests), add_generation_prompt=True, template=checkpoint),
                  reps=1)
    del tok.SEGMENT_CACHE_MIN_CHARS
    again = encode_chat(tok, more, add_generation_prompt=True)
    assert again[: len(ids) - 3] == ids[: len(ids) - 3]
    assert again == encode_chat(tok, more, add_generation_prompt=True, template=checkpoint)
    chain = ms(lambda: page_chain(list(ids), 64, len(ids) // 64))
    # after the session that served the previous request (SessionManager._keyed): its keys up to where the two
    # agree (whole, else up to the end of its last message), then only the new pages hashed
    served = TokenList(ids)
    page_chain(served, 64, len(ids) // 64)
    prefix = "whole" if served.continued_by(again) is not None else "to its last message"

    # the request's ids as encode_chat(out=TokenList()) leaves them (made before the timing: a TokenList takes keys
    # once)
    made = [TokenList(again) for _ in range(3)]
    fresh = iter(made)  # ``made`` keeps them: a session keeps its tokens (freeing a million ids is ~3 ms)

    def keyed_chain() -> None:
        keyed = next(fresh)
        assert keyed.take_keys(served, (len(ids), len(ids) - 3))  # as SessionManager._keyed tries them
        page_chain(keyed, 64, len(keyed) // 64)

    chain_kept = ms(keyed_chain)
    turn = ms(lambda: encode_chat_turn(tok, [{"role": "user", "content": "Go on."}], template=checkpoint,
                                       history=more[:-1]))
    return {"tokens": len(ids), "messages": len(msgs), "chars": sum(len(m["content"]) for m in msgs),
            "stateless_first_ms": round(first, 1), "stateless_next_ms": nxt,
            "stateless_next_rendered_whole_ms": whole, "stateless_next_uncached_ms": uncached,
            "page_chain_ms": chain, "page_chain_after_served_ms": chain_kept, "served_prefix": prefix,
            "checkpoint_template_turn_ms": turn}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="131072,1048576")
    args = ap.parse_args()
    files = sources()
    with tempfile.TemporaryDirectory() as d:
        train_tokenizer(Path(d), files)
        # a tokenizer loaded afresh for each case: its caches empty
        res = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "command": " ".join(sys.argv),
               "cases": [case(load_tokenizer(d), files, int(n)) for n in args.contexts.split(",")]}
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
