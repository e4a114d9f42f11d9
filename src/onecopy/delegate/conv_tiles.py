"""Vector tiles for data-tiled convolutions over narrow rows: what IREE's heuristic picks, set right.

With convolution data tiling (the `channels-last+conv-data-tiling` tuning candidate), IREE 3.13 vectorizes every
data-tiled convolution over 1 output row x 16 output columns x 16 output channels. A row narrower than 16 wastes
the rest: ResNet-18's four convolutions over 7x7 pixels ran at half the rate of the same multiply-adds at 14x14
to 56x56 (1.94 against 1.0 ms; IREE's per-dispatch profile, Xeon). Compiled in two phases instead (to IREE's
executable configurations, then on from them), such a dispatch gets 2 rows x 8 columns: each of those
convolutions 1.94 -> 1.55 ms, ResNet-18 B=1 through onecopy 22.6 -> 21.3 ms (2x7 and 4x8 measured the same, 1x8
and 3x7 no faster, 7x2 19% slower). Rows of more than 8 columns (two tiles of 8 fill them no better than one
of 16) and images of one row keep IREE's tile.

`narrow_row_tiles` edits the configuration text: only the lowering configs of dispatches IREE names
`..._conv_<OH>x<OW>x...` whose vector tile is exactly IREE's 1 x 16 x 16, so a format it does not know is left as
it is (and the compile is what it would have been).
"""

from __future__ import annotations

import re

__all__ = ["CONV_DATA_TILING_FLAG", "DATA_TILED_OPS", "narrow_row_tiles"]

# The flag naming the op families data tiling annotates, and the one that puts convolutions among them
# (onecopy.delegate.tuning.CONV_DATA_TILING builds its flags from these).
DATA_TILED_OPS = "--iree-dispatch-creation-experimental-set-data-tiling-ops"
CONV_DATA_TILING_FLAG = f"{DATA_TILED_OPS}=convolution"

_ROW = 16  # the output columns IREE's tile spans
_CONV = re.compile(r"func\.func @\S*?_conv_(\d+)x(\d+)x\d+x\d+x\d+x\d+_f32\(")
# The convolution's 9 loops (batch, channel block, row, column, input channel block, kernel row and column, channel,
# input channel) and its fill / epilogue's 5 (batch, channel block, row, column, channel).
_CONV_TILE = "vector_common_parallel = [1, 1, 1, 16, 0, 0, 0, 16, 0]"
_OUT_TILE = "vector_common_parallel = [1, 1, 1, 16, 16]"
_DISTRIBUTION = re.compile(r"distribution = \[0, (\d+), 1, 0")


def narrow_row_tiles(configuration: str) -> tuple[str, int]:
    """`configuration` (iree-compile's `--compile-to=executable-configurations` output) with 2 rows x 8 columns
    for data-tiled convolutions over rows of at most 8 columns (and at least 2 rows), and how many lines changed."""
    rows, cols = 2, _ROW // 2
    edited, changed, inside = [], 0, False
    for line in configuration.split("\n"):
        if "func.func @" in line:
            found = _CONV.search(line)
            inside = found is not None and int(found.group(2)) <= cols and int(found.group(1)) >= rows
        if inside:
            new = line.replace(_CONV_TILE, f"vector_common_parallel = [1, 1, {rows}, {cols}, 0, 0, 0, 16, 0]")
            if new != line:  # the convolution itself: distribute its rows by the tile's
                new = _DISTRIBUTION.sub(lambda m: f"distribution = [0, {m.group(1)}, {rows}, 0", new)
            new = new.replace(_OUT_TILE, f"vector_common_parallel = [1, 1, {rows}, {cols}, 16]")
            changed += new != line
            line = new
        edited.append(line)
    return "\n".join(edited), changed
