"""bench/candidates/paged_decode_v9.py (programmatic dependent launch)
against the float32 twin under the interpreter, at the tiles and stages the device timings use."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

from kda_sessions.kernels.mla.naive import naive_mla_decode_paged

from .kernel_helpers import rel_rms
from .test_conv_mla_triton import TOL, _mla_inputs

_PATH = pathlib.Path(__file__).parents[2] / "bench" / "candidates" / "paged_decode_v9.py"


def _v9():
    import kda_sessions.kernels.mla  # noqa: F401  (the package the candidate's relative imports resolve in)

    name = "kda_sessions.kernels.mla._cand_paged_decode_v9"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.mark.parametrize("P", [16, 64])
@pytest.mark.parametrize("cfg", [{}, {"pdl": 0}])
def test_v9_tokens_form_matches_twin(P, cfg):
    """Sequences ending inside a split's first tile, mid-split, on a page boundary and at the table's end, with
    2 and 3 splits (so splits past a sequence's end and page ids past its last page both occur)."""
    mod = _v9()
    ql, qp, kv, pt, sl = _mla_inputs([1, 33, 200, 256, 700, 1024], P, 1024 // P)
    ref = naive_mla_decode_paged(ql, qp, kv, pt, sl, 0.1)
    for splits in (2, 3):
        o = mod._launch(ql, qp, kv, pt, sl, 0.1, splits, form="tokens", **cfg)
        assert not o.isnan().any()
        assert rel_rms(o, ref) < TOL, (cfg, splits)
