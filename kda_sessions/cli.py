"""The ``kda-sessions`` command: serve, chat, demo, sessions ls/show/rm, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

import anyio


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="built-in name (tiny, tiny-random) or Kimi-Linear checkpoint directory")
    p.add_argument("--store", default="disk:", help="disk:PATH (default: user cache dir), redis://host:port/db, memory:")
    p.add_argument("--device", default="cpu")
    g = p.add_argument_group("engine (EngineConfig; defaults in kda_sessions/engine/config.py)")
    g.add_argument("--max-active-sessions", type=int, default=None, help="KDA state slots in the pools")
    g.add_argument("--num-pages", type=int, default=None, help="MLA latent KV pages in the pool")
    g.add_argument("--page-size", type=int, default=None, help="tokens per KV page")
    g.add_argument("--ram-tier-mib", type=int, default=None, help="host-RAM cache of snapshot blobs, MiB")
    g.add_argument("--lease-ttl", type=float, default=None, help="seconds a session's write lease lasts")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode (GPU only)")


def _engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the flags ask for (validated: a bad value is a one-line error naming the field)."""
    from .engine.config import EngineConfig

    fields = {
        "max_active_sessions": args.max_active_sessions, "num_pages": args.num_pages, "page_size": args.page_size,
        "ram_tier_bytes": None if args.ram_tier_mib is None else args.ram_tier_mib << 20,
        "lease_ttl_s": args.lease_ttl, "cuda_graphs": False if args.enforce_eager else None,
    }
    return EngineConfig(**{k: v for k, v in fields.items() if v is not None})


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kda-sessions", description=__doc__)
    ap.add_argument("-v", "--verbose", action="store_true")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", default=[], help="may be given several times")

    p = sub.add_parser("chat", help="interactive chat; resumes a session by id")
    _engine_args(p)
    p.add_argument("--session", help="resume this session id")
    p.add_argument("--system", default=None)
    p.add_argument("--max-tokens", type=int, default=128)

    p = sub.add_parser("demo", help="scripted coding-agent loop: tools, checkpoint, save, resume, forks")
    _engine_args(p)
    p.add_argument("--dir", default=None, help="folder the agent explores (default: this package's source)")

    p = sub.add_parser("sessions", help="list, show or remove stored sessions")
    _engine_args(p)
    ssub = p.add_subparsers(dest="action", required=True)
    ssub.add_parser("ls")
    sp = ssub.add_parser("show")
    sp.add_argument("session_id")
    sp = ssub.add_parser("rm")
    sp.add_argument("session_id")

    p = sub.add_parser("bench", help="quick CPU benchmark: prefill and decode tokens/s, resume vs re-prefill")
    _engine_args(p)
    p.add_argument("--context", type=int, default=4096)
    return ap


class _Progress:
    """A one-line progress display on stderr (only on a terminal): prefill tokens done, or elapsed time."""

    def __init__(self, label: str, engine: Any = None, total: int | None = None) -> None:
        self.label, self.engine, self.total = label, engine, total
        self.on = sys.stderr.isatty()

    async def __aenter__(self) -> _Progress:
        import time

        self.t0 = time.perf_counter()
        self.base = self.engine.runner.tokens_prefilled if self.engine is not None else 0
        self.scope = anyio.CancelScope()
        if self.on:
            import asyncio

            self.task = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def _tick(self) -> None:
        import time

        while True:
            await anyio.sleep(0.2)
            done = (self.engine.runner.tokens_prefilled - self.base) if self.engine is not None else 0
            bar = ""
            if self.total:
                frac = min(done / self.total, 1.0)
                bar = f" [{'#' * int(frac * 30):30s}] {done}/{self.total} tokens"
            print(f"\r{self.label}{bar} {time.perf_counter() - self.t0:5.1f}s", end="", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.on and not self.task.done():
            self.task.cancel()
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


async def _chat(args: argparse.Namespace) -> None:
    from .engine.engine import Engine
    from .engine.types import Done, TokenDelta, ToolCallEvent

    async with await Engine.open(model=args.model, store=args.store, device=args.device,
                                 config=_engine_config(args)) as engine:
        async with _Progress("loading session"):
            s = await engine.resume(args.session) if args.session else await engine.create_session(system=args.system)
        print(f"session {s.id} ({s.num_tokens} tokens). Commands: /save, /checkpoint NAME, /fork NAME, /quit", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                break
            if line in ("/quit", "/exit"):
                break
            if line == "/save":
                async with _Progress("saving"):
                    await s.save()
                print(f"saved {s.id}", file=sys.stderr)
                continue
            if line.startswith("/checkpoint "):
                info = await s.checkpoint(line.split(maxsplit=1)[1])
                print(f"checkpoint {info.name} at {info.position}", file=sys.stderr)
                continue
            if line.startswith("/fork "):
                s = await engine.fork(s.id, line.split(maxsplit=1)[1])
                print(f"now in fork {s.id}", file=sys.stderr)
                continue
            progress = _Progress("prefill", engine, total=s.num_tokens - s.state.num_cached + len(line))
            await progress.__aenter__()
            async for ev in s.stream(line, max_tokens=args.max_tokens):
                progress.stop()
                if isinstance(ev, TokenDelta):
                    print(ev.text, end="", flush=True)
                elif isinstance(ev, ToolCallEvent):
                    print(f"\n[tool call] {ev.tool_call.function.name}({ev.tool_call.function.arguments})")
                elif isinstance(ev, Done):
                    u = ev.reply.usage
                    print(f"\n[{u.prefill_tokens} prefilled, {u.cached_tokens} reused, {u.completion_tokens} generated]", file=sys.stderr)
        await s.save()
        print(f"saved {s.id}; resume with: kda-sessions chat --session {s.id}", file=sys.stderr)


async def _sessions(args: argparse.Namespace) -> None:
    from .engine.engine import Engine

    async with await Engine.open(model=args.model, store=args.store, device=args.device,
                                 config=_engine_config(args)) as engine:
        if args.action == "ls":
            for info in await engine.list_sessions():
                print(f"{info.session_id}\t{info.num_tokens} tokens\tcheckpoints: {', '.join(info.checkpoints) or '-'}")
        elif args.action == "show":
            s = await engine.resume(args.session_id)
            print(json.dumps({"session_id": s.id, "num_tokens": s.num_tokens, "checkpoints": sorted(s.state.checkpoints),
                              "messages": s.messages}, indent=2))
        else:
            await engine.delete_session(args.session_id)
            print(f"removed {args.session_id}")


async def _bench(args: argparse.Namespace) -> None:
    import time

    from .engine.engine import Engine

    tokens = [(i * 31) % 250 for i in range(args.context)]
    out: dict[str, Any] = {"context": args.context, "model": args.model}
    async with await Engine.open(model=args.model, store="memory:", device=args.device,
                                 config=_engine_config(args)) as engine:
        s = await engine.create_session()
        t0 = time.perf_counter()
        await s.append(tokens)
        out["prefill_tokens_per_s"] = args.context / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = await s.generate(max_tokens=32, ignore_eos=True)
        out["decode_tokens_per_s"] = len(r.token_ids) / (time.perf_counter() - t0)
        await s.save()
        engine._release(s.state, keep_checkpoint_states=False)
        del engine.sessions[s.id]
        t0 = time.perf_counter()
        s2 = await engine.resume(s.id)
        await s2.generate(max_tokens=1)
        out["ttft_resume_s"] = time.perf_counter() - t0
        fresh = await engine.create_session()
        t0 = time.perf_counter()
        await fresh.append(tokens + r.token_ids)
        await fresh.generate(max_tokens=1)
        out["ttft_reprefill_s"] = time.perf_counter() - t0
    out["resume_speedup"] = out["ttft_reprefill_s"] / out["ttft_resume_s"]
    print(json.dumps(out, indent=2))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            from .server import run_server
            from .server.settings import ServerSettings

            run_server(ServerSettings(model=args.model, store=args.store, device=args.device, host=args.host,
                                      port=args.port, api_keys=args.api_key, engine=_engine_config(args)))
        elif args.cmd == "chat":
            anyio.run(_chat, args)
        elif args.cmd == "demo":
            from .demo import run_demo

            anyio.run(lambda: run_demo(args.dir, model=args.model, store=args.store, config=_engine_config(args)))
        elif args.cmd == "sessions":
            anyio.run(_sessions, args)
        elif args.cmd == "bench":
            anyio.run(_bench, args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # the CLI reports typed errors in one line; -v shows the traceback
        if args.verbose:
            raise
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
