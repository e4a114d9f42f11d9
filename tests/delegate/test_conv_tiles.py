"""Vector tiles for data-tiled convolutions over narrow rows (onecopy.delegate.conv_tiles): set where IREE's
1 x 16 tile would waste half a row's columns or more, left alone elsewhere, and the code computes what torch does."""

import logging

import numpy as np
import pytest
import torch

from onecopy.delegate.conv_tiles import narrow_row_tiles


def dispatch(name: str, out: str) -> str:
    """What IREE prints for a data-tiled convolution dispatch at `--compile-to=executable-configurations` (the
    lines that carry lowering configs), the convolution writing `tensor<{out}xf32>`."""
    return f"""        func.func @main$async_dispatch_3_{name}_f32() attributes {{translation_info = #x}} {{
          %11 = linalg.fill {{lowering_config = #iree_cpu.lowering_config<vector_common_parallel = [1, 1, 1, 16, 16]>}} ins(%cst : f32) outs(%10 : tensor<{out}xf32>) -> tensor<{out}xf32>
          %12 = linalg.generic {{indexing_maps = []}} ins(%8, %9 : tensor<1x32x9x9x16xf32>, tensor<32x32x3x3x16x16xf32>) outs(%11 : tensor<{out}xf32>) attrs =  {{lowering_config = #iree_cpu.lowering_config<distribution = [0, 4, 1, 0, 0, 0, 0, 0, 0], vector_common_parallel = [1, 1, 1, 16, 0, 0, 0, 16, 0], vector_reduction = [0, 0, 0, 0, 1, 1, 1, 0, 16]>}} {{
          %19 = iree_linalg_ext.map_store {{lowering_config = #iree_cpu.lowering_config<vector_common_parallel = [1, 1, 1, 16, 16]>}} %12 into %13 {{
        }}"""


def test_only_convolutions_over_rows_of_eight_or_fewer_columns_get_their_rows_by_eight_columns():
    narrow = dispatch("conv_7x7x512x3x3x512", "1x32x7x7x16")
    wide = dispatch("conv_14x14x256x3x3x256", "1x16x14x14x16")
    one_row = dispatch("conv_1x7x64x1x3x64", "1x4x1x7x16")
    text, changed = narrow_row_tiles(f"{wide}\n{narrow}\n{one_row}")
    assert changed == 3
    edited = text.split("\n")
    assert "\n".join(edited[:5]) == wide and "\n".join(edited[10:]) == one_row  # left exactly as they were
    assert "distribution = [0, 4, 7, 0, 0, 0, 0, 0, 0], vector_common_parallel = [1, 1, 7, 8, 0, 0, 0, 16, 0]" in edited[7]
    assert edited[6].count("[1, 1, 7, 8, 16]") == 1 and edited[8].count("[1, 1, 7, 8, 16]") == 1


def test_a_batch_static_or_dynamic_and_tall_narrow_images_get_the_tiles_too():
    """IREE names a B=8 dispatch `conv_8x7x7x...` (unit dims are left out of names, so B=1 reads `conv_7x7x...`):
    the shape comes from what the convolution writes, never from the name."""
    batched, changed = narrow_row_tiles(dispatch("conv_8x7x7x512x3x3x512", "8x32x7x7x16"))
    assert changed == 3 and "vector_common_parallel = [1, 1, 7, 8, 0, 0, 0, 16, 0]" in batched
    dynamic, changed = narrow_row_tiles(dispatch("conv_Dx7x7x512x3x3x512", "?x32x7x7x16"))
    assert changed == 3 and "distribution = [0, 4, 7, 0" in dynamic
    tall, changed = narrow_row_tiles(dispatch("conv_20x6x64x3x3x64", "1x4x20x6x16"))
    assert changed == 3 and "[1, 1, 8, 8, 16]" in tall  # at most 8 rows a tile


def test_a_configuration_it_does_not_know_is_left_as_it_is():
    unknown = dispatch("conv_7x7x512x3x3x512", "1x32x7x7x16").replace("[1, 1, 1, 16, 0, 0, 0, 16, 0]",
                                                                    "[1, 1, 1, 8, 0, 0, 0, 16, 0]")
    text, changed = narrow_row_tiles(unknown.replace("[1, 1, 1, 16, 16]", "[1, 1, 1, 8, 16]"))
    assert changed == 0 and text == unknown.replace("[1, 1, 1, 16, 16]", "[1, 1, 1, 8, 16]")
    not_a_conv, changed = narrow_row_tiles(dispatch("matmul_like_7x7x512x256", "1x32x7x7x16"))
    assert changed == 0 and "[1, 1, 1, 16, 16]" in not_a_conv


class NarrowRows(torch.nn.Module):
    """A stride-2 conv down to 7x7 pixels, then two 3x3 convs over them (ResNet's last stage, narrower)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(32, 64, 3, 2, 1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, 1, 1), torch.nn.ReLU(),
            torch.nn.Conv2d(64, 64, 3, 1, 1),
        )

    def forward(self, x):
        return self.body(x)


def assert_compiles_edited_and_matches_torch(model, x, candidate, edited: str, caplog) -> None:
    """`model` compiled for this CPU as tuning's `candidate` is (in two phases): the log says the configuration edit
    `edited` was made, and the code computes what torch does."""
    import iree.runtime as ireert
    from iree.turbine import aot

    from onecopy.delegate.compiler import compile_bundle
    from onecopy.delegate.targets import host_cpu_target

    source = str(aot.export(model, args=(x,)).mlir_module).encode()
    with caplog.at_level(logging.DEBUG, logger="onecopy"):
        vmfb = compile_bundle(source, host_cpu_target(), for_host=True, extra_flags=candidate.flags)
    assert edited in caplog.text
    got = ireert.load_vm_flatbuffer(vmfb, driver="local-sync").main(x.numpy()).to_host()
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_network_over_7x7_pixels_compiles_with_the_narrow_tiles_and_matches_torch(caplog, batch):
    from onecopy.delegate.tuning import CHANNELS_LAST_DATA_TILING

    torch.manual_seed(0)
    assert_compiles_edited_and_matches_torch(NarrowRows().eval(), torch.randn(batch, 32, 14, 14),
                                             CHANNELS_LAST_DATA_TILING,
                                             "vector tiles set for convolutions over narrow rows", caplog)
