"""Engine configuration, validated once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import torch


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_active_sessions: int = Field(default=64, ge=1)
    """KDA state slots: sessions whose state sits in the pools at once (idle ones are moved out on demand)."""
    num_pages: int = Field(default=4096, ge=1)
    """MLA latent KV pages in the pool."""
    page_size: int = Field(default=64, ge=1)
    """Tokens per KV page. 64 matches the KDA chunk: checkpoints at chunk boundaries share whole pages, a fork
    copies at most 63 rows, and a page blob of Kimi-Linear (7 layers x 64 x 1,152 B = 504 KiB) is large enough
    to store at full bandwidth yet small enough that dedup of equal prefixes loses little."""
    prefill_chunk_tokens: int = Field(default=2048, ge=16)
    """Tokens of a step while requests are generating: their decode rows first, prompt chunks share the rest
    (at least 64), so a huge tool output does not stall the other sessions' decode."""
    prefill_chunk_tokens_idle: int | None = Field(default=None, ge=16)
    """Prompt tokens of a step when no request is generating, never below ``prefill_chunk_tokens``. None: 8,192
    on a GPU, ``prefill_chunk_tokens`` on a CPU (where the prefill rate does not grow with the chunk, and a
    request arriving during an 8K step would wait seconds for it). On a GPU, fewer, larger model calls: a
    prefill call of the 48B shape reads every expert's weights (~94 GB in bf16,
    ~20 ms on an H200), and 8,192-token chunks prefill 32K there at ~33,000 tokens/s. Memory grows linearly
    with the chunk (MLA prefill runs in tiles, KDA in chunks: 2.8 GiB above weights and pools at 8,192). A
    request that arrives meanwhile waits up to one such step for its first chunk."""
    max_queued_requests: int = Field(default=256, ge=1)
    """Requests waiting beyond this are refused with EngineBusy instead of queueing without limit."""
    ram_tier_bytes: int = Field(default=1 << 30, ge=0)
    """Host-RAM LRU cache of snapshot blobs in front of the persistent store."""
    gc_grace_s: float = Field(default=600.0, ge=0)
    """Blobs written or reused within this many seconds survive garbage collection, so a save in flight in
    another process sharing the store never loses a blob it counts on."""
    max_checkpoints_in_memory: int = Field(default=8, ge=1)
    """Automatic (msg-N) checkpoint states kept on the host per session (each is one copy of the KDA state:
    40 MiB at Kimi-Linear's shape); older ones survive in the store once saved. Named checkpoints and the
    conversation's head (system prompt + tools) are kept besides."""
    checkpoint_interval_pages: int = Field(default=256, ge=0)
    """Inside a long prompt, the prefill also keeps the state every this many KV pages (16,384 tokens at the
    default page size: one KDA state, 40 MiB at Kimi-Linear's shape, per 126 MiB of its KV, so a saved session
    grows by about a third; at 64 pages a save of the 48B shape doubled), so a request that
    resends that prompt with another tail, or again after a cancelled prefill, reuses all of it up to the last such
    boundary. Page-aligned, so these checkpoints share whole pages. 0: only at message boundaries."""
    checkpoint_memory_bytes: int = Field(default=4 << 30, ge=0)
    """Host bytes of checkpoint states the engine keeps across all sessions: beyond it the automatic checkpoints
    least recently used (captured or started another session from) are dropped; a saved one keeps its stored
    blobs. Named checkpoints and each conversation's system prompt + tools head are never dropped. Checked when a
    request is admitted (room is made for what its prefill will capture) and when it ends."""
    lease_ttl_s: float | None = Field(default=None, ge=0.5, le=86_400)
    """Lifetime of a session's write lease in the store (None: the store's own, 30 s, or a Redis url's
    ``?lease_ttl=``). The engine renews the lease of every session it holds every quarter of this, so a held
    session stays its own however long it idles; a process that dies without closing leaves its leases to expire
    after this long (on disk at once, when the holder was a dead process of the same host), and only then can
    another engine save the session. Shorter means a faster takeover after a crash and more renewal traffic."""
    page_wait_s: float = Field(default=30.0, ge=0)
    """How long a request waits for KV pages or a state slot that others hold before it fails with OutOfPages or
    OutOfSlots (503): at admission, for a slot when every slot holds a busy session (more concurrent requests than
    ``max_active_sessions``) and for the pages of its prompt (running requests end, and their sessions become idle
    and evictable); while generating, parked after a preemption, for pages to resume with."""
    cpu_threads: int | None = Field(default=None, ge=1)
    """Torch threads of the engine's step thread on a CPU (its decode steps: ``cpu_decode_threads``). torch's count is process-wide for threads started while
    the engine runs (torch gives new threads the last count set); the engine sets the caller's count back when it
    closes. None: torch's default. On a shared 2-core machine neither 1 nor 2 wins for ``tiny`` at every
    load (docs/benchmarks.md, "`tiny` on the CPU"). No effect on a GPU."""
    cpu_decode_threads: Annotated[int, Field(ge=1)] | Literal["auto"] | None = "auto"
    """Torch threads of the model call of decode steps on a CPU (prefill keeps ``cpu_threads``). "auto": for every
    step, decode or prefill, 1 or the step thread's count, whichever the step thread times faster on steps like it
    (``engine/cpu_threads.py``: decode steps by batch size, prefill steps by the tokens they feed; it starts on 1,
    tries the other count for a few steps now and then, sooner when its steps slow down). None: the same as prefill.
    Neither count wins everywhere: ``tiny`` at 1K on a 2-core machine decodes ~1.4x faster on 2 threads while the
    step thread is the process's only OpenMP team, and 10-40x slower on 2 with another busy process beside it, or
    once another thread has run torch on 2 threads (OpenMP then holds more threads than cores and they sleep
    between ops; docs/benchmarks.md, "`tiny` on the CPU"). Prefill is ~1.8x faster on 2 threads on a quiet machine
    and 2-7x slower beside a busy process. Logits can differ in the last bits between 1 and 2 threads (the BLAS picks other
    kernels), so decoding is bit-reproducible only with a number here. No effect on a GPU."""
    cuda_graphs: bool = True
    """On a CUDA device, decode steps of up to 64 sequences replay a CUDA graph captured per batch bucket (1, 2,
    4, ... 64) and page-table width, instead of launching every kernel from Python; so do prefill steps of up to 8
    chunks of at most 128 tokens after at least one cached token, with no checkpoint inside (an agent's tool output:
    ``model.prefill_graphs``). No effect on a CPU."""
    decode_ahead: bool = True
    """On a CUDA device with ``cuda_graphs``, while only decode rows run and none has a constraint (``tool_choice``,
    ``response_format``: its masks follow the tokens the host reads), each decode step is queued before the host has read the step before
    it, its ids taken on the device from that step's tokens: the GPU decodes while the host reads, checks and
    delivers tokens, instead of waiting for it between steps. A row whose token stops its request runs once more as
    a dummy (scratch slot and page); one whose ``stop`` string the host finds in the text a step late has that step
    undone (its KDA state and conv tails from before it put back: ``engine.undo.StepUndo``, a buffer of 42 MB a row
    at the 48B shape, allocated on first use), so sessions end in the same state, token for token.
    Sampled rows (temperature, top-k, top-p, seeds, logprobs and top logprobs) run ahead too: their draws never wait for the device
    (``engine.sampler.draw_rows``). ``generate`` at the 48B shape's first 16 layers on an H100 (``bench/decode_engine_48b.py --layers 16
    --decode-ahead off,on``): 1 x 8K 1.797 -> 1.739 ms a step, 1 x 128K 2.063 -> 1.889 (graph replay 1.844), 8 x 32K
    6.303 -> 5.958 (replay 5.960), 1 x 1M 3.347 -> 3.267 (replay 3.250). No effect on a CPU."""
    cpu_compile: bool = False
    """On a CPU, decode steps of one sequence run as one ``torch.compile``d function (inductor's C++, which needs a
    C++ compiler; ``HybridModel.compile_cpu_decode``): for ``tiny`` at 1K about half the eager path's CPU time a token
    (docs/benchmarks.md). The step thread compiles it when the engine opens, before its first step (35-80 s cold on
    a busy 2-core machine, 8-16 s from inductor's on-disk cache); requests wait meanwhile, which is why it is not
    the default. Batches of several sequences, contexts under 3 tokens and models with MoE layers decode eagerly.
    No effect on a GPU."""
    cpu_half_weights: bool = True
    """On a CPU (x86, where torch has FBGEMM), the eager decode step's one-row matmuls read a float16 pack of each
    float32 weight float16 holds to within 6e-8 (``model.fused.HALF_ROW_WEIGHTS``: float32 activations, products and
    sums; ``tiny`` decodes ~2x faster, docs/benchmarks.md). The packs sit beside the float32 weights: +50% of their
    bytes in memory (``tiny``: +18 MB). False: no packs, the BLAS on the float32 weights (logits as prefill's
    matmuls give them; greedy tokens the same for ``tiny``). No effect on a GPU."""
    cpu_compile_weights: Literal["model", "bfloat16"] = "model"
    """The matmul weights the compiled CPU decode reads: the model's values (the eager path's greedy tokens, logits
    equal to float rounding; held in bfloat16 where that is exact, as for ``tiny``'s bfloat16 checkpoint loaded in
    float32: ``fused.lossless_dtype``) or bfloat16 (half the bytes a token reads, summed in float32; every weight
    rounded to bfloat16, so logits move by ~1e-3 relative and a near tie can pick another greedy token)."""

    @property
    def cpu_compile_dtype(self) -> torch.dtype | None:
        """``cpu_compile_weights`` as a dtype (None: the model's)."""
        import torch

        return torch.bfloat16 if self.cpu_compile_weights == "bfloat16" else None

