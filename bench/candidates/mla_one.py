"""One launch of an MLA decode candidate on small shapes, for compute-sanitizer (bench/candidates/README.md):

    compute-sanitizer --tool memcheck python3 bench/candidates/mla_one.py kernels/mla/paged_decode.py \
        '{"form": "tokens"}' 64 1000,37

Prints the relative error against the float32 twin, or the exception."""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch


def load_path(path: Path, name: str):
    """The module at ``path``, imported under ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_source(src: str, name: str):
    """A module from source text, written to a real file first: Gluon and Triton compile a kernel from its
    function's source file, so an edited copy of a kernel module must live on disk."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src)
    return load_path(path, name)


# bench/kernels.py (its import shim and input builders), loaded by path under its own name: the bare name
# ``kernels`` is also the repo's top-level kernel folder (imported as ``kda_sessions.kernels``)
kb = load_path(Path(__file__).resolve().parents[1] / "kernels.py", "bench_kernels")


def main() -> None:
    path, cfg, P, lens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), [int(x) for x in sys.argv[4].split(",")]
    kb.configure(not torch.cuda.is_available())
    mod = kb.load_mla(path)[Path(path).stem]
    args = kb.mla_setup(lens, P=P)[0]
    ref = kb.naive_mla_decode_paged(args[0].float(), args[1].float(), args[2].float(), *args[3:])
    try:
        out = mod._launch(*args, **cfg)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(json.dumps({"cfg": cfg, "P": P, "lens": lens, "rel": kb.rel(out, ref)}))
    except Exception as e:
        print(json.dumps({"cfg": cfg, "P": P, "lens": lens, "error": repr(e)[:500]}))


if __name__ == "__main__":
    main()
