"""The linears' prepacked oneDNN path on CPU (the same products as torch's `linear`, never a stale copy), and
stacked linears (one matmul, filled through each linear's own parameters)."""

import pytest
import torch
import torch.nn.functional as F

from workers import cpu_kernels, parallel
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
    x = torch.randn(parallel.SMALL_ROWS + 1, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x)
    assert layer.matmul._packed is not None  # the batch took the packed path
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)


def test_a_lone_row_takes_our_row_kernel_and_matches_linear():
    assert cpu_kernels.cpu_ops() is not None, "csrc/cpu_ops.cpp did not build (see the log)"
    layer = filled(ColumnParallelLinear(67, 99, bias=True), 0)  # neither a multiple of the kernel's 8 or 4
    x = torch.randn(1, 67, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        y = layer(x)
    assert layer.matmul._packed is None  # not oneDNN's copy: the kernel reads the weight itself
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)


# up to three rows, tiles of four weight rows; more, of two weight rows and six input rows, and the rest
@pytest.mark.parametrize("rows", [2, 3, 7, 13, parallel.SMALL_ROWS])
def test_a_small_batch_takes_our_kernel_and_each_row_is_what_it_would_be_alone(rows):
    layer = filled(ColumnParallelLinear(67, 99, bias=True), 0)
    x = torch.randn(rows, 67, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        y = layer(x)
        alone = [layer(x[i : i + 1]) for i in range(rows)]
    assert layer.matmul._packed is None
    torch.testing.assert_close(y, F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
    for i in range(rows):  # batch-invariant: a row's sums in the same order whatever its batch
        assert torch.equal(y[i : i + 1], alone[i])


def test_without_our_kernel_a_lone_row_takes_linear_on_one_thread_and_onednn_on_more(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "USE_CPU_OPS", False)
    layer = filled(ColumnParallelLinear(64, 96, bias=True), 0)
    x = torch.randn(1, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with torch.inference_mode():
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        assert layer.matmul._packed is None
        torch.set_num_threads(2)
        with torch.inference_mode():
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-4, rtol=1e-5)
        assert layer.matmul._packed is not None
    finally:
        torch.set_num_threads(threads)


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


def test_without_onednn_or_our_kernel_every_batch_takes_torchs_linear(monkeypatch):
    monkeypatch.setattr(parallel, "_MKLDNN", False)
    monkeypatch.setattr(cpu_kernels, "USE_CPU_OPS", False)
    layer = filled(ColumnParallelLinear(16, 8, bias=False), 4)
    for x in (torch.randn(3, 16), torch.randn(1, 16)):
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
