from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kda_sessions import Engine
from tools.average_weights import SoupError, average, main


def _ckpt(path: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    return state


def test_average_is_the_weighted_mean_and_written_in_the_asked_dtype(tmp_path: Path):
    s1, s2 = _ckpt(tmp_path / "one", 1), _ckpt(tmp_path / "two", 2)
    main([str(tmp_path / "one"), str(tmp_path / "two" / "model.safetensors"), "--out", str(tmp_path / "soup"),
          "--weights", "1", "3", "--dtype", "float32"])
    got = load_file(str(tmp_path / "soup" / "tiny.safetensors"))
    for n in s1:
        torch.testing.assert_close(got[n], 0.25 * s1[n] + 0.75 * s2[n])
    assert (tmp_path / "soup" / "config.json").read_text().startswith("{")
    main([str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(tmp_path / "bf")])
    assert load_file(str(tmp_path / "bf" / "tiny.safetensors"))["a.weight"].dtype == torch.bfloat16


def test_mismatched_checkpoints_and_bad_weights_are_refused():
    a = {"x": torch.zeros(2), "y": torch.zeros(3)}
    with pytest.raises(SoupError, match="other tensor names"):
        average([a, {"x": torch.zeros(2)}])
    with pytest.raises(SoupError, match="other shapes"):
        average([a, {"x": torch.zeros(2), "y": torch.zeros(4)}])
    with pytest.raises(SoupError, match="one positive weight"):
        average([a, a], [1.0, 0.0])
    with pytest.raises(SoupError, match="no checkpoints"):
        average([])


async def test_the_soup_of_the_shipped_model_with_itself_loads_as_the_same_model(tmp_path: Path):
    builtin = Path(__file__).resolve().parents[2] / "kda_sessions" / "builtin"
    main([str(builtin), str(builtin), "--out", str(tmp_path / "soup")])
    soup, shipped = load_file(str(tmp_path / "soup" / "tiny.safetensors")), load_file(str(builtin / "tiny.safetensors"))
    assert soup.keys() == shipped.keys()
    assert all(torch.equal(soup[n], shipped[n]) for n in shipped)  # bf16 -> float32 mean of equals -> bf16: exact
    async with await Engine.open(model=str(tmp_path / "soup"), store="memory:") as engine:  # the loader checks it
        assert engine.model.config.hidden_size == 256


def test_take_keeps_matching_tensors_from_one_input_and_refuses_bad_rules(tmp_path: Path):
    s1, s2 = _ckpt(tmp_path / "one", 1), _ckpt(tmp_path / "two", 2)
    main([str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(tmp_path / "soup"), "--dtype", "float32",
          "--take", r"^a\.=1"])
    got = load_file(str(tmp_path / "soup" / "tiny.safetensors"))
    assert torch.equal(got["a.weight"], s2["a.weight"])  # taken from input 1 as it is
    torch.testing.assert_close(got["b.bias"], 0.5 * s1["b.bias"] + 0.5 * s2["b.bias"])  # the rest averaged
    for rule, msg in [("a.weight", "REGEX=INDEX"), ("a=2", "does not exist"), ("zzz=0", "matches no tensor"),
                      ("(=0", "bad pattern")]:
        with pytest.raises(SoupError, match=msg):
            main([str(tmp_path / "one"), str(tmp_path / "two"), "--out", str(tmp_path / "bad"), "--take", rule])
    assert not (tmp_path / "bad").exists()  # refused before anything is written
