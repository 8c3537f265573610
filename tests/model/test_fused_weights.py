"""``fused.lossless_dtype`` and ``reduction_weight``'s default: bfloat16 only where it holds every value exactly."""

import pytest
import torch

from kda_sessions.model.fused import lossless_dtype, reduction_weight

g = torch.Generator().manual_seed(0)
RANDOM = torch.randn(64, 32, generator=g)
FROM_BF16 = torch.randn(64, 32, generator=g).bfloat16().float()  # a bfloat16 checkpoint loaded in float32


@pytest.mark.parametrize(
    ("w", "want"),
    [
        (FROM_BF16, torch.bfloat16),
        (RANDOM, torch.float32),
        (torch.cat([FROM_BF16, RANDOM[:1]]), torch.float32),  # one row off bfloat16's grid is enough
        (FROM_BF16.bfloat16(), torch.bfloat16),
        (FROM_BF16.double(), torch.float64),  # only float32 is narrowed
        (torch.full((4, 4), float("nan")), torch.float32),
        (torch.empty(0, 4), torch.float32),
    ],
    ids=["bf16-values", "random", "one-row-off", "bf16", "float64", "nan", "empty"],
)
def test_lossless_dtype(w, want):
    assert lossless_dtype(w) == want


def test_reduction_weight_default_keeps_every_value():
    """The default layout's values equal w's (transposed) in whichever dtype it picked; an explicit dtype wins."""
    for w, dtype in ((FROM_BF16, torch.bfloat16), (RANDOM, torch.float32)):
        r = reduction_weight(w)
        assert r.dtype == dtype and r.t().is_contiguous() and torch.equal(r.float(), w.t())
    assert reduction_weight(FROM_BF16, torch.float32).dtype == torch.float32


def test_param_watch_sees_every_kind_of_change():
    """``ParamWatch``: unchanged parameters report no change; an in-place update, a new storage (``.data =``, as
    ``.to()`` does) and a new Parameter object in the module each report one, once."""
    from torch import nn

    from kda_sessions.model.fused import ParamWatch

    lin = nn.Linear(4, 3)
    watch = ParamWatch([lin])
    assert watch.changed()  # the first call
    assert not watch.changed()
    with torch.no_grad():
        lin.weight.mul_(2)
    assert watch.changed() and not watch.changed()
    lin.weight.data = lin.weight.data.clone()
    assert watch.changed() and not watch.changed()
    lin.bias = nn.Parameter(lin.bias.detach().clone())
    assert watch.changed() and not watch.changed()


def test_param_watch_names_a_parameter_set_to_none():
    from torch import nn

    from kda_sessions.errors import ConfigError
    from kda_sessions.model.fused import ParamWatch

    lin = nn.Linear(4, 3)
    watch = ParamWatch([lin])
    assert watch.changed()
    lin.bias = None
    with pytest.raises(ConfigError, match=r"parameter Linear\.bias was deleted or set to None"):
        watch.changed()
    del lin.weight
    with pytest.raises(ConfigError, match=r"Linear\.weight, Linear\.bias"):
        watch.changed()
