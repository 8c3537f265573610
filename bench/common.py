"""Shared helpers of the CPU benchmarks: machine description, the wider model, engines, raw bandwidth, Redis.

Imported by ``bench/model_cpu.py``, ``bench/sessions_resume.py`` and ``bench/concurrency.py`` (run from the repo
root: ``python bench/<name>.py``); not part of the library.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

import kda_sessions as ks
from kda_sessions.config import ModelConfig
from kda_sessions.model import HybridModel, save_model
from kda_sessions.model.loader import BUILTIN_DIR, _tiny_random_weights

REPO = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024

# A wider Kimi-Linear config than tiny-random (same layer pattern, 4x the width): D 1024, 8 layers
# (KDA at 1,2,3,5,6,7; MLA at 4,8), KDA 8 heads x 128, MLA 8 heads with r 256, dn 128, dr 64, dv 128,
# MoE 8 experts top-2 + 1 shared of width 512, layer 1 dense of width 2048; byte-tokenizer vocabulary.
WIDER_OVERRIDES: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 512,
    "num_attention_heads": 8,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7],
        "full_attn_layers": [4, 8],
        "num_heads": 8,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
}


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken."""
    cpu = "unknown"
    try:
        m = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_gib": round(mem, 1),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "git_commit": commit,
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all cores busy over ``seconds`` (from /proc/stat); called while this process idles, it is
    the load of everything else on the machine."""

    def sample() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = f[3] + f[4]
        return sum(f) - idle, sum(f)

    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return (b1 - b0) / max(1, t1 - t0)


MAX_WAIT_S = 180.0  # the scripts lower it for --quick


def wait_quiet(max_wait_s: float | None = None, threshold: float = 0.15) -> dict[str, float]:
    """Other engineers share this 2-core machine: wait (up to ``max_wait_s``) until the rest of the machine
    uses under ``threshold`` of the cores for 3 s in a row, so torch's threads are not oversubscribed.
    Returns the wait and the last busy fraction seen (recorded next to the numbers)."""
    max_wait_s = MAX_WAIT_S if max_wait_s is None else max_wait_s
    t0 = time.monotonic()
    quiet = 0
    busy = cpu_busy()
    while time.monotonic() - t0 < max_wait_s:
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= 3:
            break
        busy = cpu_busy()
    return {"waited_s": round(time.monotonic() - t0, 1), "others_busy": round(busy, 3)}


def wider_config() -> ModelConfig:
    cfg = json.loads((BUILTIN_DIR / "tiny-random.json").read_text())
    cfg.update(WIDER_OVERRIDES)
    return ModelConfig.model_validate(cfg)


def build_wider(path: Path) -> Path:
    """Write the wider config with seeded weights (the tiny-random seeding, applied to its own names and shapes)
    to ``path`` in the Kimi-Linear format; reused if already there."""
    if (path / "config.json").exists() and (path / "model.safetensors").exists():
        return path
    cfg = wider_config()
    with torch.device("meta"):
        model = HybridModel(cfg)
    model.load_state_dict(_tiny_random_weights(model), strict=True, assign=True)
    save_model(model, path)
    return path


def model_params(model: HybridModel) -> int:
    return sum(p.numel() for p in model.parameters())


async def open_engine(model: str | Path, store: str, notes: list[str], **overrides: Any) -> ks.Engine:
    """``Engine.open``; for a checkpoint directory without tokenizer files (the wider model) that fails in
    ``load_tokenizer``, so the engine is then assembled the way ``Engine.open`` does but with the byte tokenizer
    and the built-in chat template (noted in ``notes`` once)."""
    try:
        return await ks.Engine.open(model=model, store=store, **overrides)
    except ValueError as e:
        from kda_sessions.tokenizer import ByteTokenizer, builtin_template
        from kda_sessions.tokenizer.loader import TokenizerNotFound

        if not isinstance(e, TokenizerNotFound):
            raise
        note = f"Engine.open({Path(model).name!r}) failed in load_tokenizer ({e}); engine built with ByteTokenizer"
        if note not in notes:
            notes.append(note)
        from kda_sessions.storage import SnapshotStore

        config = ks.EngineConfig.model_validate(ks.EngineConfig().model_copy(update=overrides).model_dump())
        m = ks.load_model(model)
        snapshots = await SnapshotStore.open(store, ram_bytes=config.ram_tier_bytes, gc_grace_s=config.gc_grace_s)
        return ks.Engine(m, Path(str(model)).name, ByteTokenizer(), builtin_template(), snapshots, config)


def random_tokens(n: int, seed: int, vocab: int = 256) -> list[int]:
    """Plain byte tokens (no special ids) from a fixed seed."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def drop_page_cache() -> bool:
    """sync + drop the OS page cache (needs root); False where the sandbox does not allow it."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _dd(args: list[str]) -> float:
    """MB/s (10^6 bytes) that dd reports on its last line."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr.strip().splitlines()[-1]
    m = re.match(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    assert m, out
    return int(m.group(1)) / float(m.group(2)) / 1e6


def raw_disk_bandwidth(directory: Path, mib: int = 512) -> dict[str, float | bool]:
    """Sequential 1 MiB writes and reads of one ``mib`` file in ``directory`` with dd (MB/s = 10^6 B/s)."""
    directory.mkdir(parents=True, exist_ok=True)
    f = directory / "dd.bin"
    out: dict[str, float | bool] = {}
    try:
        out["write_direct_MBps"] = _dd(["if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "oflag=direct"])
        out["write_fdatasync_MBps"] = _dd(["if=/dev/zero", f"of={f}", "bs=1M", f"count={mib}", "conv=fdatasync"])
        out["page_cache_dropped"] = drop_page_cache()
        out["read_cold_MBps"] = _dd([f"if={f}", "of=/dev/null", "bs=1M"])
        out["read_direct_MBps"] = _dd([f"if={f}", "of=/dev/null", "bs=1M", "iflag=direct"])
        out["file_MiB"] = mib
    finally:
        f.unlink(missing_ok=True)
    return out


def raw_redis_bandwidth(port: int, sizes: tuple[int, ...] = (100_000, 1_000_000), total_mb: int = 200) -> dict[str, float]:
    """redis-benchmark SET/GET of large values (MB/s = requests/s x value bytes / 10^6)."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    out: dict[str, float] = {}
    for d in sizes:
        n = max(100, total_mb * 1_000_000 // d)
        res = subprocess.run(
            [exe, "-p", str(port), "-t", "set,get", "-d", str(d), "-n", str(n), "-q"],
            capture_output=True, text=True, check=True,
        ).stdout
        for line in res.replace("\r", "\n").splitlines():
            m = re.match(r"\s*(SET|GET): ([\d.]+) requests per second", line)
            if m:
                out[f"{m.group(1).lower()}_{d // 1000}KB_MBps"] = float(m.group(2)) * d / 1e6
    return out


def redis_helpers():
    """tests/redis_server.py (start_redis_server, stop_redis_server), imported by path."""
    spec = importlib.util.spec_from_file_location("_bench_redis_server", REPO / "tests" / "redis_server.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Timer:
    """``with Timer() as t: ...`` then ``t.s`` wall seconds and ``t.cores`` = this process's CPU seconds / wall
    seconds (about 2 when torch had both cores to itself; lower means it waited, e.g. on another process)."""

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        self.c0 = time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.s = time.perf_counter() - self.t0
        self.cores = (time.process_time() - self.c0) / self.s if self.s > 0 else 0.0


def emit(result: dict[str, Any], out: str | None) -> None:
    """Print the JSON document; also write it to ``out`` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
