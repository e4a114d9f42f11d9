"""split_softmax (onecopy.export.softmax): a softmax, attention's safe one too, as max, sum of exponentials and a
scale by the reciprocal; torch's results, -inf rows included, checked on random inputs and through IREE."""

import numpy as np
import pytest
import torch

from onecopy import Runtime
from onecopy.export import CompileSpec, export_program
from onecopy.export.rewrites import apply_rewrites, decomposition_table, rewrite_split_softmax
from tests.export.test_rewrites import targets

aten = torch.ops.aten
SOFTMAXES = (aten._softmax.default, aten._safe_softmax.default)


class Softmax(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return torch.softmax(x * 2.0, self.dim)


class Attention(torch.nn.Module):
    """scaled_dot_product_attention under a boolean mask that hides every key from the first query."""

    def forward(self, q, k, v):
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask[0] = False
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def decomposed(model, args, rewrites=("split_softmax",), skip_ops=(), dynamic_shapes=None):
    """`model` exported and decomposed as the exporter does for a method with `rewrites` and `skip_ops`."""
    ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    ep = ep.run_decompositions(decomposition_table("forward", rewrites, skip_ops))
    apply_rewrites({"forward": ep}, {"forward": rewrites}, {"forward": skip_ops})
    return ep


def assert_close(got, want, **tolerance):
    torch.testing.assert_close(got, want, rtol=tolerance.get("rtol", 1e-6), atol=tolerance.get("atol", 1e-6),
                               equal_nan=True)


@pytest.mark.parametrize("dim, shape", [(-1, (3, 5, 17)), (1, (3, 5, 17)), (0, (7, 4)), (-1, (2, 4, 8, 128))])
def test_a_softmax_becomes_three_passes_with_torchs_results(dim, shape):
    torch.manual_seed(0)
    model, x = Softmax(dim), torch.randn(*shape)
    ep = decomposed(model, (x,))
    assert not set(SOFTMAXES) & set(targets(ep))
    assert aten.reciprocal.default in targets(ep)
    assert_close(ep.module()(x), model(x))


def test_rows_of_minus_infinity_give_nan_as_torchs_softmax_does():
    x = torch.randn(4, 6)
    x[1, :3] = float("-inf")  # partly: the rest of the row shares it all
    x[2] = float("-inf")  # wholly: NaN in torch's softmax
    model = Softmax(-1)
    got, want = decomposed(model, (x,)).module()(x), model(x)
    assert torch.isnan(want[2]).all()
    assert_close(got, want)


def test_attentions_safe_softmax_is_kept_whole_and_split_fully_masked_rows_give_zeros():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    model = Attention()
    ep = decomposed(model, (q, k, v))
    # The safe softmax's own masking (a boolean reduction over the scores) is gone too.
    assert not set(SOFTMAXES) & set(targets(ep))
    assert aten.any.dim not in targets(ep)
    got, want = ep.module()(q, k, v), model(q, k, v)
    assert torch.equal(want[:, :, 0], torch.zeros_like(want[:, :, 0]))
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Without the rewrite torch's decomposition stays, masking and all.
    plain = decomposed(model, (q, k, v), rewrites=())
    assert aten._softmax.default in targets(plain) and aten.any.dim in targets(plain)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32_and_returned_as_it_came(dtype):
    torch.manual_seed(0)
    model, x = Softmax(-1), torch.randn(4, 33).to(dtype)
    ep = decomposed(model, (x,))
    got, want = ep.module()(x), model(x)
    assert got.dtype == dtype
    assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-3)


def test_a_dynamic_dimension_stays_dynamic():
    model = Softmax(-1)
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = decomposed(model, (torch.randn(2, 9),), dynamic_shapes=({0: batch},))
    for n in (1, 7):
        x = torch.randn(n, 9)
        assert_close(ep.module()(x), model(x))


def test_a_method_that_leaves_softmax_on_the_host_keeps_torchs_decomposition():
    q = torch.randn(1, 2, 4, 8)
    skip = ("aten._softmax.default",)
    assert decomposition_table("forward", ("split_softmax",), skip) is None
    assert decomposition_table("forward", ("split_softmax",)) is not None
    assert decomposition_table("forward", ("space_to_depth",)) is None
    ep = decomposed(Attention(), (q, q, q), skip_ops=skip)
    assert aten._softmax.default in targets(ep)


def test_an_empty_softmax_or_a_graph_without_one_is_left_as_it_is():
    ep = torch.export.export(Softmax(-1), (torch.randn(0, 5),)).run_decompositions()
    assert not rewrite_split_softmax(ep.graph_module)
    ep = torch.export.export(torch.nn.ReLU(), (torch.randn(3, 5),)).run_decompositions()
    assert not rewrite_split_softmax(ep.graph_module)


@pytest.mark.parametrize("rewrites", [None, ()])
def test_attention_through_iree_matches_torch_fully_masked_rows_included(rewrites, tmp_path):
    """The default export (split) and one without rewrites (IREE's own softmax) give torch's results."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    model = Attention()
    spec = CompileSpec() if rewrites is None else CompileSpec(rewrites=rewrites)
    program = export_program({"forward": torch.export.export(model, (q, k, v))}, compile_spec=spec)
    prog = Runtime(cache_dir=tmp_path / "cache").load_program(program.to_bytes())
    try:
        (got,) = prog.load_method("forward").execute([t.numpy() for t in (q, k, v)])
    finally:
        prog.close()
    want = model(q, k, v).numpy()
    assert np.array_equal(got[:, :, 0], np.zeros_like(got[:, :, 0]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
