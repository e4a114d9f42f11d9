"""Workgroup tiles for an image's NCHW -> NHWC transpose (onecopy.delegate.transpose_tiles): whole rows, the tile's
size kept; anything else left as it was; and the code computes what torch does."""

import pytest
import torch

from onecopy.delegate.transpose_tiles import whole_row_transposes
from tests.delegate.test_conv_tiles import assert_compiles_edited_and_matches_torch

NCHW_TO_NHWC = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3, d1)>]"
CHW_TO_HWC = "affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d1, d2, d0)>]"
NHWC_TO_NCHW = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d3, d1, d2)>]"


def dispatch(name: str, maps: str, source: str, distribution: str) -> str:
    """What IREE prints for a transpose dispatch at `--compile-to=executable-configurations` (its generic's line)."""
    return f"""        func.func @main$async_dispatch_0_{name}_f32() attributes {{translation_info = #x}} {{
          %4 = linalg.generic {{indexing_maps = [{maps}, iterator_types = ["parallel"]}} ins(%2 : tensor<{source}xf32>) outs(%3 : tensor<8x224x224x3xf32>) attrs =  {{lowering_config = #iree_cpu.lowering_config<distribution = [{distribution}], vector_common_parallel = [1, 16, 1, 16]>}} {{
        }}"""


def test_an_image_transpose_gets_whole_rows_and_keeps_its_tile_size():
    batched, changed = whole_row_transposes(dispatch("transpose_8x3x224x224", NCHW_TO_NHWC, "8x3x224x224", "8, 3, 56, 32"))
    assert changed == 1 and "distribution = [8, 3, 8, 224]" in batched  # 56 x 32 values a plane, as 8 rows of 224
    one, changed = whole_row_transposes(dispatch("transpose_3x224x224", CHW_TO_HWC, "3x224x224", "3, 56, 32"))
    assert changed == 1 and "distribution = [3, 8, 224]" in one  # IREE leaves a batch of 1 out of the loops
    dynamic, changed = whole_row_transposes(dispatch("transpose_Dx3x64x64", NCHW_TO_NHWC, "?x3x64x64", "1, 3, 4, 32"))
    assert changed == 1 and "distribution = [1, 3, 2, 64]" in dynamic


@pytest.mark.parametrize("name, maps, distribution", [
    ("transpose_8x3x224x224", NCHW_TO_NHWC, "8, 3, 56, 224"),  # whole rows already
    ("transpose_8x3x224x224", NCHW_TO_NHWC, "8, 3, 0, 32"),  # rows not tiled: a workgroup has them all
    ("transpose_8x3x224x224", NHWC_TO_NCHW, "8, 3, 56, 32"),  # another permutation
    ("elementwise_8x3x224x224", NCHW_TO_NHWC, "8, 3, 56, 32"),  # not a transpose dispatch
])
def test_anything_else_is_left_as_it_was(name, maps, distribution):
    text = dispatch(name, maps, "8x3x224x224", distribution)
    assert whole_row_transposes(text) == (text, 0)


class Stem(torch.nn.Module):
    """An image network's first layers: a 3x3 stride-2 convolution over RGB, then a depthwise one."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, 2, 1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(16, 16, 3, 1, 1, groups=16))

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_channels_last_compile_sets_whole_rows_and_matches_torch(caplog, batch):
    from onecopy.delegate.tuning import CHANNELS_LAST

    torch.manual_seed(0)
    assert_compiles_edited_and_matches_torch(Stem().eval(), torch.randn(batch, 3, 64, 96), CHANNELS_LAST,
                                             "NCHW -> NHWC transposes distributed over whole rows", caplog)
