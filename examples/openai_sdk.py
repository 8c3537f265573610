"""The official openai SDK against a kda-sessions server, continuing a session with `session_id`.

Starts its own server on a free local port unless --url is given:
    python examples/openai_sdk.py [--url http://127.0.0.1:8000/v1]
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import openai


def start_local_server() -> str:
    import uvicorn

    from kda_sessions.server import ServerSettings, build_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = ServerSettings(model="tiny", store="memory:", port=port)
    server = uvicorn.Server(uvicorn.Config(build_app(None, settings), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}/v1"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="base URL of a running server, ending in /v1")
    ap.add_argument("--api-key", default="unused")
    args = ap.parse_args()
    client = openai.OpenAI(base_url=args.url or start_local_server(), api_key=args.api_key)
    first = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}],
        max_tokens=8,
    )
    sid = first.model_extra["session_id"]
    print(f"session {sid}: {first.choices[0].message.content!r}")
    second = client.chat.completions.create(  # only the new message; the session holds the rest
        model="tiny",
        messages=[{"role": "user", "content": "And again?"}],
        max_tokens=8,
        extra_body={"session_id": sid},
    )
    print(f"continued: prompt {second.usage.prompt_tokens} tokens, "
          f"{second.usage.prompt_tokens_details.cached_tokens} of them cached")
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Stream it."}], max_tokens=8, stream=True,
        extra_body={"session_id": sid},
    )
    print("streamed:", repr("".join(c.choices[0].delta.content or "" for c in stream if c.choices)))


if __name__ == "__main__":
    main()
