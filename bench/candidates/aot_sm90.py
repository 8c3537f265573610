"""Compile kernel variants for sm_90 (H100/H200) without a GPU and report what the compiler made of them.

    python bench/candidates/aot_sm90.py mla kernels/mla/paged_decode.py '[{"num_warps": 8}]'
    python bench/candidates/aot_sm90.py intra chunk_v4.py '[{"part": 1}, {"part": 2}]'   # git show 4fa80c4:kernels/kda/chunk.py

One JSON line per variant: registers and stack (spill) bytes per thread from the cubin, shared memory, and counts
in the TTGIR of warpgroup MMAs (``wgmma``), mma.sync dots (``mma_v2``), TMA copies, cp.async copies and layout
conversions. Uses the local Triton (its bundled ptxas and cuobjdump), which may be newer than the device's, so the
numbers are a guide, not the device's truth. Shapes: MLA r 512, dr 64, H 32, P 64; KDA H 32, K = V = 128.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def load(path: str, package: str):
    import kda_sessions.kernels  # noqa: F401  (the package the candidate's relative imports resolve in)

    name = f"{package}._aot_{os.path.basename(path)[:-3]}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def build(fn, types: dict[str, str], const: dict, num_warps: int, num_stages: int) -> dict:
    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in const else types[p] for p in params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params) if sig[p].startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(k),): v for k, v in const.items()}, attrs=attrs)
    k = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    tt = k.asm["ttgir"]
    if os.environ.get("AOT_PTX"):  # the PTX too, to read the loop's order of copies, waits and products
        with open(os.environ["AOT_PTX"], "w") as f:
            f.write(k.asm["ptx"])
    reg, stack = re.search(r"REG:(\d+)", usage), re.search(r"STACK:(\d+)", usage)
    return {"regs": int(reg.group(1)) if reg else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "shared": k.metadata.shared, "wgmma": tt.count("ttng.warp_group_dot "),
            "mma_v2": tt.count("versionMajor = 2"), "tma_copies": tt.count("async_tma_copy_global_to_local"),
            "cp_async": tt.count("async_copy_global_to_local"), "convert_layout": tt.count("convert_layout")}


def mla(mod, cfg: dict) -> dict:
    BN = cfg.get("BN", 64)
    types = {"q_lat": "*bf16", "q_pe": "*bf16", "kv": "*bf16", "page_table": "*i32", "seq_lens": "*i32",
             "o_part": "*bf16" if cfg.get("part_bf16") else "*fp32", "lse_part": "*fp32", "sm_scale": "fp32",
             "max_pages": "i32", "tokens_per_split": "i32", "NSPLIT": "i32", "acc_out": "*fp32", "m_out": "*fp32",
             "l_out": "*fp32", "c_desc": f"tensordesc<bf16[{BN}, 256]>", "pe_desc": f"tensordesc<bf16[{BN}, 64]>"}
    const: dict = {"H": 32, "R": 512, "DR": 64, "P": 64, "BH": cfg.get("BH", 32), "BN": BN, "ALIGN": 8}
    if cfg.get("tma"):
        fn = mod._split_kernel_tma
    else:
        fn = mod._split_kernel
        const.update(BR=512, BDR=64)
        params = inspect.signature(fn.fn).parameters
        if "TRANS" in params:
            const["TRANS"] = cfg.get("trans", True)
        if "PAGE_TILE" in params:
            const["PAGE_TILE"] = cfg.get("page_tile", True)
        if "RS" in params:
            const["RS"] = cfg.get("RS", 2)
    return build(fn, types, const, cfg.get("num_warps", 4), cfg.get("num_stages", 3))


def intra(mod, cfg: dict) -> dict:
    """The single intra kernel of chunk_kda v4 (shipped until 4fa80c4; the current kernel has none)."""
    if not hasattr(mod, "_intra_kernel"):
        raise ValueError("this chunk.py has no _intra_kernel: 'intra' compiles v4 (git show 4fa80c4:kernels/kda/chunk.py)")
    fn = mod._intra_kernel
    params = inspect.signature(fn.fn).parameters
    const = {"H": 32, "K": 128, "V": 128, "BK": cfg.get("BK", 32), "BV": cfg.get("BV", 32), "BT": 64, "BC": 16,
             "NORM": True, "GATE": 0, "SPAN_MAX": 160.0, "INV_IEEE": True, "SPLIT": cfg.get("split", False),
             "A_log": None, "dt_bias": None, "PART": cfg.get("part", 0)}
    if not const["SPLIT"]:
        const["Xb"] = None
    const = {k: v for k, v in const.items() if k in params}
    types = {p: "fp32" if p in ("scale", "lower_bound") else "*i32" if p in ("chunk_start", "chunk_len") else
             "*fp32" if p in ("g", "dl", "rq", "rk") else "*bf16" for p in params}
    return build(fn, types, const, cfg.get("num_warps", 4), cfg.get("num_stages", 2))


def main() -> None:
    kind, path, cfgs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    mod = load(path, "kda_sessions.kernels.mla" if kind == "mla" else "kda_sessions.kernels.kda")
    for cfg in cfgs:
        try:
            print(json.dumps({"cfg": cfg, **(mla(mod, cfg) if kind == "mla" else intra(mod, cfg))}), flush=True)
        except Exception as e:
            print(json.dumps({"cfg": cfg, "error": repr(e)[:500]}), flush=True)


if __name__ == "__main__":
    main()
