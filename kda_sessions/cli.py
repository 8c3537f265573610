"""The ``kda-sessions`` command: serve, chat, demo, sessions (ls, show, rm, gc), bench.

Engine flags (--model, --store, --device and the EngineConfig ones) are accepted before or after the
subcommand, and after ``sessions ls/show/rm/gc``, which read the store only and never load a model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import anyio


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default, unless it is empty (None, [], off) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, [], False) or "(default" in text:
            return text
        return super()._get_help_string(action) or text


_FORMATTER = _Formatter

def _threads(text: str) -> int | str:
    """A thread count, or ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a thread count or 'auto': {text!r}") from None


# (flags, default, type, help); every parser that takes engine flags gets them with default SUPPRESS, so a flag
# given at any level survives, and ``_fill_defaults`` sets the ones nobody gave
_ENGINE_FLAGS: list[tuple[str, Any, Any, str]] = [
    ("--model", "tiny", str, "built-in name (tiny, tiny-random) or a Kimi-Linear checkpoint directory"),
    ("--store", "disk:", str, "snapshot store: disk:PATH (disk: alone is the user cache dir), redis://host:port/db, "
                              "memory:"),
    ("--device", "cpu", str, "torch device the model runs on: cpu, cuda, cuda:1"),
    ("--dtype", "auto", str, "weights' dtype: auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, float16"),
    ("--max-active-sessions", None, int, "KDA state slots in the pools (EngineConfig.max_active_sessions, 64)"),
    ("--num-pages", None, int, "MLA latent KV pages in the pool (EngineConfig.num_pages, 4096)"),
    ("--page-size", None, int, "tokens per KV page (EngineConfig.page_size, 64)"),
    ("--ram-tier-mib", None, int, "host-RAM cache of snapshot blobs in MiB (EngineConfig.ram_tier_bytes, 1024)"),
    ("--lease-ttl", None, float, "seconds a session's write lease lasts (EngineConfig.lease_ttl_s; the store's, 30)"),
    ("--prefill-chunk-tokens", None, int, "tokens of a step while requests generate: decode rows first, prompt "
                                          "chunks share the rest (EngineConfig.prefill_chunk_tokens, 2048)"),
    ("--prefill-chunk-tokens-idle", None, int, "prompt tokens of a step when no request generates "
                                               "(EngineConfig.prefill_chunk_tokens_idle; 8192 on a GPU, 2048 on a CPU)"),
    ("--page-wait", None, float, "seconds a request waits at admission for KV pages or a state slot held by "
                                 "running requests before a 503 (EngineConfig.page_wait_s, 30)"),
    ("--cpu-threads", None, int, "torch threads of the engine's steps on a CPU (EngineConfig.cpu_threads; torch's "
                                 "default: the cores)"),
    ("--cpu-decode-threads", None, _threads, "torch threads of decode steps on a CPU, or auto: 1 or --cpu-threads' count, "
                                               "whichever its steps time faster (EngineConfig.cpu_decode_threads, auto)"),
]
_STORE_FLAGS = {"--store"}
_DEFAULTS = {f.lstrip("-").replace("-", "_"): d for f, d, _, _ in _ENGINE_FLAGS} | {"enforce_eager": False,
                                                                                    "no_decode_ahead": False}


def _engine_args(p: argparse.ArgumentParser, store_only: bool = False) -> None:
    g = p.add_argument_group("engine" if not store_only else "store")
    for flag, default, kind, text in _ENGINE_FLAGS:
        if store_only and flag not in _STORE_FLAGS:
            continue
        shown = "" if default is None else f" (default: {default})"
        metavar = {str: flag.lstrip("-").upper(), int: "N", float: "SECONDS", _threads: "N|auto"}[kind]
        g.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=metavar, help=text + shown)
    if not store_only:
        g.add_argument("--enforce-eager", action="store_true", default=argparse.SUPPRESS,
                       help="no CUDA graphs for decode (GPU only; default: graphs on)")
        g.add_argument("--no-decode-ahead", action="store_true", default=argparse.SUPPRESS,
                       help="wait for each graphed decode step's tokens before queuing the next "
                            "(EngineConfig.decode_ahead off; GPU only; default: decode ahead on)")


def _fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    for name, default in _DEFAULTS.items():
        if not hasattr(args, name):
            setattr(args, name, default)
    return args


def _engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the flags ask for (validated: a bad value is a one-line error naming the field)."""
    from .engine.config import EngineConfig

    def get(name: str) -> Any:
        return getattr(args, name, None)

    fields = {
        "max_active_sessions": get("max_active_sessions"), "num_pages": get("num_pages"), "page_size": get("page_size"),
        "ram_tier_bytes": None if get("ram_tier_mib") is None else get("ram_tier_mib") << 20,
        "lease_ttl_s": get("lease_ttl"), "page_wait_s": get("page_wait"),
        "prefill_chunk_tokens": get("prefill_chunk_tokens"), "prefill_chunk_tokens_idle": get("prefill_chunk_tokens_idle"),
        "cuda_graphs": False if get("enforce_eager") else None,
        "decode_ahead": False if get("no_decode_ahead") else None,
        "cpu_compile": True if get("compile") else None, "cpu_compile_weights": get("compile"),
        "cpu_threads": get("cpu_threads"), "cpu_decode_threads": get("cpu_decode_threads"),
    }
    return EngineConfig(**{k: v for k, v in fields.items() if v is not None})


def _dtype(args: argparse.Namespace) -> Any:
    """The weights' torch dtype for ``--dtype`` on ``--device`` (a bad name is a ConfigError naming it)."""
    from .dtypes import resolve_dtype

    return resolve_dtype(getattr(args, "dtype", "auto"), args.device)


def _sub(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=_FORMATTER)  # type: ignore[no-any-return]


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kda-sessions", description=__doc__, formatter_class=_FORMATTER)
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO and show tracebacks of errors")
    _engine_args(ap)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    p = _sub(sub, "serve", "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/sessions)")
    _engine_args(p)
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR", help="address to bind; a non-loopback one needs --api-key")
    p.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port (0 picks a free one)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY", help="accepted bearer key; may be given several times")
    p.add_argument("--served-model-name", default=None, metavar="NAME", help="the model id clients send and /v1/models lists "
                   "(default: the model's name)")
    p.add_argument("--model-alias", action="append", default=[], metavar="NAME", help="another model name requests may use; "
                   "may be given several times (any other name answers 404 model_not_found)")
    p.add_argument("--default-max-tokens", type=int, default=None, metavar="N", help="max_tokens of a completion that names "
                   "none (default: the model's generation config, else 512)")
    g = p.add_argument_group("chat-completion sessions (docs/server.md, 'Durability')")
    g.add_argument("--no-save-chat-sessions", action="store_true", help="keep them in memory only (default: each "
                   "is saved after every turn, so its session_id answers after a restart)")
    g.add_argument("--chat-session-idle", type=float, default=120.0, metavar="SECONDS", help="seconds idle before one is forgotten "
                   "from memory (it stays in the store)")
    g.add_argument("--chat-sessions-in-memory", type=int, default=32, metavar="N", help="at most this many held in memory")
    g.add_argument("--chat-session-retention", type=float, default=7 * 86_400.0, metavar="SECONDS", help="seconds unused before one "
                   "is deleted from the store; 0 keeps them until deleted")

    p = _sub(sub, "chat", "interactive chat in a session; --session resumes one, --tools-dir lets the model "
             "run list_dir, read_file and grep in a folder")
    _engine_args(p)
    p.add_argument("--session", default=None, help="resume this session id (default: a new session)")
    p.add_argument("--system", default=None, help="system prompt of a new session (with --tools-dir, default: the "
                   "demo's agent prompt)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per reply at most")
    p.add_argument("--tools-dir", default=None, help="folder the built-in read-only tools (list_dir, read_file, "
                   "grep) run in; the model's calls are run there and their output sent back")
    p.add_argument("--max-tool-rounds", type=int, default=6, help="tool calls run per user message at most")

    p = _sub(sub, "demo", "scripted coding-agent loop: tools, checkpoint, save, resume, forks")
    _engine_args(p)
    p.add_argument("--dir", default=None, help="folder the agent explores (default: this package's source)")

    p = _sub(sub, "sessions", "list, show, remove or garbage-collect stored sessions (reads the store only)")
    _engine_args(p, store_only=True)
    ssub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    sp = _sub(ssub, "ls", "list stored sessions")
    _store_args(sp)
    sp = _sub(ssub, "show", "a stored session's messages and checkpoints, as JSON")
    _store_args(sp)
    sp.add_argument("session_id", help="the session's id")
    sp = _sub(ssub, "rm", "remove stored sessions (and the blobs nothing else references)")
    _store_args(sp)
    sp.add_argument("session_ids", nargs="*", metavar="SESSION_ID", help="sessions to remove")
    sp.add_argument("--all", action="store_true", help="remove every stored session")
    sp.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                    help="remove the sessions saved longer ago than this")
    sp = _sub(ssub, "gc", "delete blobs no session references (and, with --older-than, old sessions first)")
    _store_args(sp)
    sp.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                    help="first remove the sessions saved longer ago than this")
    sp.add_argument("--grace", type=float, default=600.0, help="seconds a fresh blob is spared (a save in flight "
                    "in a server sharing the store may count on it)")

    p = _sub(sub, "bench", "quick benchmark: prefill and decode tokens/s, first token resumed vs re-prefilled")
    _engine_args(p)
    p.add_argument("--context", type=int, default=4096, help="context tokens prefilled, saved and resumed")
    p.add_argument("--compile", nargs="?", const="model", choices=["model", "bfloat16"], default=None,
                   help="on a CPU, decode through torch.compile (EngineConfig.cpu_compile), reading the matmul "
                        "weights in the model's dtype or, with 'bfloat16', in bfloat16")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    return ap


def _store_args(p: argparse.ArgumentParser) -> None:
    _engine_args(p, store_only=True)
    p.add_argument("--tenant", default=None, help="the tenant's namespace of the store (a server's API-key tenant)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _fill_defaults(_parser().parse_args(argv))


# -- chat ------------------------------------------------------------------------------------------------------

_CHAT_HELP = ("commands: /help, /save, /checkpoint NAME, /fork NAME (continue in a fork from that checkpoint), "
              "/quit (or Ctrl-D); anything else is sent to the model")


class _Progress:
    """A progress bar on stderr (tqdm; only on a terminal): prefill tokens done out of ``total``, or the time
    elapsed on work with no count (loading, decode)."""

    def __init__(self, label: str, engine: Any = None, total: int | None = None) -> None:
        self.label, self.engine, self.total = label, engine, total
        self.task: Any = None
        self.bar: Any = None

    async def __aenter__(self) -> _Progress:
        from tqdm import tqdm

        counted = self.engine is not None and bool(self.total)
        self.base = self.engine.runner.tokens_prefilled if self.engine is not None else 0
        self.bar = tqdm(total=self.total if counted else None, desc=self.label, unit=" tokens", file=sys.stderr,
                        leave=False, disable=not sys.stderr.isatty(), dynamic_ncols=True,
                        bar_format=None if counted else "{desc}: {elapsed}")
        if not self.bar.disable:
            import asyncio

            self.task = asyncio.get_running_loop().create_task(self._tick())
        return self

    async def _tick(self) -> None:
        while True:
            await anyio.sleep(0.2)
            if self.engine is not None and self.total:
                self.bar.n = min(self.engine.runner.tokens_prefilled - self.base, self.total)
            self.bar.refresh()

    def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
        if self.bar is not None:
            self.bar.close()

    async def __aexit__(self, *exc: object) -> None:
        self.stop()


def _resume_hint(args: argparse.Namespace, session_id: str) -> str:
    """The command that resumes this chat: the same store (and model, tools folder) as this one."""
    parts = ["kda-sessions", "chat", "--session", session_id, "--store", args.store]
    if args.model != _DEFAULTS["model"]:
        parts += ["--model", args.model]
    if args.device != _DEFAULTS["device"]:
        parts += ["--device", args.device]
    if args.tools_dir:
        parts += ["--tools-dir", args.tools_dir]
    import shlex

    return " ".join(shlex.quote(p) for p in parts)


async def _command(line: str, s: Any, engine: Any) -> tuple[bool, Any]:
    """Handle a /command locally: (quit?, the session to continue in)."""
    cmd, _, arg = line[1:].strip().partition(" ")
    arg = arg.strip()
    if cmd in ("quit", "exit", "q"):
        return True, s
    if cmd == "save":
        async with _Progress("saving"):
            await s.save()
        print(f"saved {s.id}", file=sys.stderr)
    elif cmd == "checkpoint" and arg:
        info = await s.checkpoint(arg)
        print(f"checkpoint {info.name} at token {info.position}", file=sys.stderr)
    elif cmd == "fork" and arg:
        s = await engine.fork(s.id, arg)
        print(f"now in fork {s.id}", file=sys.stderr)
    elif cmd == "help":
        print(_CHAT_HELP, file=sys.stderr)
    else:
        print(f"unknown command {line.split()[0]!r} or missing argument; {_CHAT_HELP}", file=sys.stderr)
    return False, s


async def _reply(s: Any, engine: Any, messages: list[dict[str, Any]], max_tokens: int) -> list[Any]:
    """Stream one assistant turn to stdout; the tool calls it made."""
    from .engine.types import Done, TokenDelta, ToolCallEvent

    calls = []
    progress = _Progress("prefill", engine, total=s.num_tokens - s.state.num_cached + 16)
    await progress.__aenter__()
    try:
        async for ev in s.stream(messages, max_tokens=max_tokens):
            progress.stop()
            if isinstance(ev, TokenDelta):
                print(ev.text, end="", flush=True)
            elif isinstance(ev, ToolCallEvent):
                calls.append(ev.tool_call)
                print(f"\n[tool call] {ev.tool_call.function.name}({ev.tool_call.function.arguments})", flush=True)
            elif isinstance(ev, Done):
                u = ev.reply.usage
                print(f"\n[{u.prefill_tokens} prefilled, {u.cached_tokens} reused, {u.completion_tokens} generated]",
                      file=sys.stderr)
    finally:
        progress.stop()
    return calls


def run_tool(tools: Any, call: Any, limit: int = 2000) -> str:
    """A tool call's output (or its error, which the model sees as the output), cut to ``limit`` characters."""
    from .tools import ToolError

    try:
        out = tools.call(call.function.name, call.function.arguments)
    except (ToolError, ValueError) as e:  # bad JSON is a ValueError too
        out = f"error: {e}"
    return out[:limit]


async def _chat(args: argparse.Namespace) -> None:
    from .api import Engine
    from .demo import SYSTEM
    from .tools import TOOL_SCHEMAS, Tools

    tools = Tools(args.tools_dir) if args.tools_dir else None
    system = args.system if args.system is not None or tools is None else SYSTEM  # what tiny was trained with
    async with _Progress(f"loading {args.model}"):
        engine = await Engine.open(model=args.model, store=args.store, device=args.device, dtype=_dtype(args),
                                   config=_engine_config(args))
    async with engine:
        async with _Progress("loading session"):
            if args.session:
                s = await engine.resume(args.session)
            else:
                s = await engine.create_session(system=system, tools=TOOL_SCHEMAS if tools else None)
        where = f"; tools run in {tools.root}" if tools else ""
        print(f"session {s.id} ({s.num_tokens} tokens{where}). {_CHAT_HELP}", file=sys.stderr)
        while True:
            try:
                line = await anyio.to_thread.run_sync(input, "> ")
            except EOFError:
                break
            if not line.strip():
                continue
            if line.startswith("/"):
                done, s = await _command(line, s, engine)
                if done:
                    break
                continue
            messages: list[dict[str, Any]] = [{"role": "user", "content": line}]
            for _ in range(args.max_tool_rounds + 1):
                calls = await _reply(s, engine, messages, args.max_tokens)
                if not calls:
                    break
                if tools is None:
                    print("[tools are not run: start chat with --tools-dir DIR to run them]", file=sys.stderr)
                    break
                messages = []
                for call in calls:
                    out = run_tool(tools, call)
                    lines = out.splitlines()
                    more = f" (+{len(lines) - 1} lines)" if len(lines) > 1 else ""
                    print(f"[tool output] {lines[0] if lines else ''}{more}", file=sys.stderr)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        await s.save()
        print(f"saved {s.id}; resume with: {_resume_hint(args, s.id)}", file=sys.stderr)


# -- sessions (store only) -------------------------------------------------------------------------------------


def _age(seconds: float) -> str:
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def table(rows: list[list[str]], header: list[str], right: set[int] | None = None) -> str:
    """Columns padded to their widest cell (those in ``right`` right-aligned), a header and a rule."""
    right = right or set()
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(r: list[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)])


async def _sessions(args: argparse.Namespace) -> None:
    from .storage import SnapshotStore

    url = args.store
    if args.tenant:
        from .sessions.store_io import tenant_store_url

        url = tenant_store_url(url, args.tenant)
    async with await SnapshotStore.open(url, gc_grace_s=getattr(args, "grace", 600.0)) as store:
        if args.action == "ls":
            rows = []
            now = time.time()
            for sid in await store.list_sessions():
                try:
                    m = await store.load_manifest(sid)
                except Exception as e:  # listed but unreadable: say so, list the rest
                    rows.append([sid, "?", "?", "?", f"unreadable: {type(e).__name__}"])
                    continue
                rows.append([sid, f"{m.num_tokens:,}", str(len(m.checkpoints)), _age(now - m.saved_at), m.parent or "-"])
            print(table(rows, ["SESSION", "TOKENS", "CHECKPOINTS", "SAVED", "PARENT"], right={1, 2}) if rows
                  else f"no sessions in {url}")
        elif args.action == "show":
            m = await store.load_manifest(args.session_id)
            print(json.dumps({
                "session_id": m.session_id, "num_tokens": m.num_tokens, "parent": m.parent, "saved_at": m.saved_at,
                "model": m.fingerprint.model_id, "checkpoints": {c.name: c.position for c in m.checkpoints},
                "system": m.meta.get("system"), "messages": m.meta.get("messages", []),
            }, indent=2, ensure_ascii=False))
        else:
            await _remove(args, store)


async def _remove(args: argparse.Namespace, store: Any) -> None:
    """rm and gc: the sessions asked for (ids, --all, --older-than), then a garbage collection for gc."""
    stored = await store.list_sessions()
    victims = list(dict.fromkeys(getattr(args, "session_ids", []) or []))
    if getattr(args, "all", False):
        victims = stored
    if args.older_than is not None:
        now = time.time()
        for sid in stored:
            try:
                if now - (await store.load_manifest(sid)).saved_at > args.older_than:
                    victims.append(sid)
            except Exception:  # unreadable: not ours to judge by age
                continue
        victims = list(dict.fromkeys(victims))
    if args.action == "rm" and not victims and not (getattr(args, "all", False) or args.older_than is not None):
        raise ValueError("name the sessions to remove, or give --all or --older-than SECONDS")
    missing = [v for v in victims if v not in stored]
    if missing:
        raise ValueError(f"no stored session {missing[0]!r}")
    for sid in victims:
        await store.delete_session(sid)
        print(f"removed {sid}")
    if args.action == "gc":
        gc = await store.collect_garbage()
        print(f"removed {len(victims)} sessions; deleted {gc.blobs_deleted} unreferenced blobs "
              f"({gc.blobs_protected} fresh ones kept for {args.grace:.0f} s)")
    elif not victims:
        print("nothing to remove")


# -- serve -----------------------------------------------------------------------------------------------------


def _serve_settings(args: argparse.Namespace) -> Any:
    from .server.settings import ServerSettings

    return ServerSettings(
        model=args.model, store=args.store, device=args.device, dtype=args.dtype, host=args.host, port=args.port, api_keys=args.api_key,
        engine=_engine_config(args), served_model_name=args.served_model_name, served_model_aliases=args.model_alias,
        default_max_tokens=args.default_max_tokens, save_chat_sessions=not args.no_save_chat_sessions,
        stateless_session_ttl_s=args.chat_session_idle, max_stateless_sessions=args.chat_sessions_in_memory,
        chat_session_retention_s=args.chat_session_retention,
    )


def startup_summary(settings: Any) -> str:
    """What the server is about to serve, in a few lines (printed before the model loads)."""
    from .storage import default_disk_root

    e = settings.engine
    store = settings.store
    if store == "disk:":
        store = f"disk:{default_disk_root()}"
    keep = (f"kept {settings.chat_session_retention_s:,.0f} s unused" if settings.chat_session_retention_s
            else "kept until deleted")
    saving = f"saved after every turn, {keep}" if settings.save_chat_sessions else "memory only (not saved)"
    return "\n".join([
        f"kda-sessions serve: model {settings.model} (served as {settings.model_name!r}) on {settings.device}, "
        f"dtype {settings.dtype}",
        f"  store         {store}",
        f"  listening     http://{settings.host}:{settings.port}/v1"
        + ("  (API key required)" if settings.api_keys else "  (no API key: loopback only)"),
        f"  pools         {e.max_active_sessions} session slots, {e.num_pages:,} KV pages x {e.page_size} tokens "
        f"({e.num_pages * e.page_size:,} tokens)",
        f"  chat sessions {saving}; at most {settings.max_stateless_sessions} in memory, "
        f"forgotten after {settings.stateless_session_ttl_s:.0f} s idle",
        f"  sampling      {_sampling_line(settings.sampling_defaults())} (for a request that names none)",
    ])


def _sampling_line(d: dict[str, float | int]) -> str:
    how = "greedy" if d["temperature"] == 0 else f"temperature {d['temperature']:g}, top_p {d['top_p']:g}"
    return f"{how}, max_tokens {d['max_tokens']}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.cmd == "serve":
            from .server import run_server

            settings = _serve_settings(args)
            print(startup_summary(settings), file=sys.stderr, flush=True)
            run_server(settings)
        elif args.cmd == "chat":
            anyio.run(_chat, args)
        elif args.cmd == "demo":
            from .demo import run_demo

            anyio.run(lambda: run_demo(args.dir, model=args.model, store=args.store, config=_engine_config(args),
                                        device=args.device, dtype=_dtype(args)))
        elif args.cmd == "sessions":
            anyio.run(_sessions, args)
        elif args.cmd == "bench":
            from .bench_cli import bench_table, run_bench

            out = anyio.run(run_bench, args, _engine_config(args), _dtype(args), _Progress)
            print(json.dumps(out, indent=2) if args.json else bench_table(out))
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
