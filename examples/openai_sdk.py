"""The official openai SDK against a kda-sessions server, continuing a session with `session_id`.

Starts its own server on a free local port unless --url is given. Needs the openai package
(`pip install openai`, or the `examples` extra: `pip install -e ".[examples]"`):
    python examples/openai_sdk.py [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import openai


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A server on a free loopback port for the length of the block (stopped cleanly, so that it finishes
    its sessions' saves before the process exits); yields its /v1 URL."""
    import uvicorn

    from kda_sessions.server import ServerSettings, build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ServerSettings(model="tiny", store="memory:", port=port)
    server = uvicorn.Server(uvicorn.Config(build_app(None, settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the local server did not start")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join()


def chat(base_url: str, api_key: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id  # the model the server runs
    first = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}],
        max_tokens=8,
    )
    sid = first.model_extra["session_id"]
    print(f"session {sid}: {first.choices[0].message.content!r}")
    second = client.chat.completions.create(  # only the new message; the session holds the rest
        model=model,
        messages=[{"role": "user", "content": "And again?"}],
        max_tokens=8,
        extra_body={"session_id": sid},
    )
    print(f"continued: prompt {second.usage.prompt_tokens} tokens, "
          f"{second.usage.prompt_tokens_details.cached_tokens} of them cached")
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Stream it."}], max_tokens=8, stream=True,
        extra_body={"session_id": sid},
    )
    print("streamed:", repr("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running kda-sessions server (its root, or its /v1)")
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    if args.url:
        url = args.url.rstrip("/")
        chat(url if url.endswith("/v1") else url + "/v1", args.api_key)
    else:
        with local_server() as url:
            chat(url, args.api_key)


if __name__ == "__main__":
    main()
