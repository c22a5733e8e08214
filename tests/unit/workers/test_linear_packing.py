"""The linears' prepacked oneDNN path on CPU (the same products as torch's `linear`, never a stale copy), and
stacked linears (one matmul, filled through each linear's own parameters)."""

import pytest
import torch
import torch.nn.functional as F

from workers import parallel
from workers.parallel import ColumnParallelLinear, ReplicatedLinear, Stacked

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def filled(layer: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return layer


def test_a_batch_goes_through_the_packed_weight_and_matches_linear():
    layer = filled(ColumnParallelLinear(64, 96, bias=True), 0)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x)
    assert layer.matmul._packed is not None  # the batch took the packed path
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    with torch.inference_mode():
        one = layer(x[:1])
    assert torch.equal(one, F.linear(x[:1], layer.weight, layer.bias))  # a lone row: torch's linear


def test_weights_loaded_or_tied_after_packing_are_the_ones_used():
    layer = filled(ReplicatedLinear(32, 48), 2)
    x = torch.randn(4, 32)
    with torch.inference_mode():
        layer(x)
    filled(layer, 3)  # loaded again in place: the packed copy is stale
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)
    layer.weight = torch.nn.Parameter(torch.randn(48, 32), requires_grad=False)  # tied to another tensor
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-4, rtol=1e-5)


def test_without_onednn_every_batch_takes_torchs_linear(monkeypatch):
    monkeypatch.setattr(parallel, "_MKLDNN", False)
    layer = filled(ColumnParallelLinear(16, 8, bias=False), 4)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.equal(layer(x), F.linear(x, layer.weight))
    assert layer.matmul._packed is None


@pytest.mark.parametrize("rows", [1, 6])
def test_stacked_linears_fill_through_their_names_and_give_each_ones_output(rows):
    q, k = ColumnParallelLinear(32, 24, bias=True), ColumnParallelLinear(32, 8, bias=True)
    qk = Stacked(q, k)
    filled(q, 5), filled(k, 6)  # as the loader does: each linear's own parameters, in place
    names = {name for name, _ in torch.nn.ModuleDict({"q": q, "k": k}).named_parameters()}
    assert names == {"q.weight", "q.bias", "k.weight", "k.bias"}  # no stacked name for a checkpoint to lack
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        yq, yk = qk(x)
    torch.testing.assert_close(yq, F.linear(x, q.weight, q.bias), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(yk, F.linear(x, k.weight, k.bias), atol=1e-4, rtol=1e-5)
