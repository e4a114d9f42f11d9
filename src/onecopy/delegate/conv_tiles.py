"""Vector tiles for data-tiled convolutions over narrow rows: what IREE's heuristic picks, set right.

With convolution data tiling (the `channels-last+conv-data-tiling` tuning candidate), IREE 3.13 vectorizes every
data-tiled convolution over 1 output row x 16 output columns x 16 output channels. A row narrower than 16 wastes
the rest: ResNet-18's convolutions over 7x7 pixels ran at half the rate of the same multiply-adds at 14x14 to
56x56 (IREE's per-dispatch profile, Xeon). Compiled in two phases instead (to IREE's executable configurations,
then on from them), such a dispatch gets the whole image's rows (up to 8) x 8 columns, and each workgroup those
rows. IREE's CPU code runs such a tile row by row, each row over the whole reduction, so the rows a workgroup takes
share the filter panel it streams through its cache. ResNet-18's three 512-channel convolutions and its
256 -> 512 one, per call (iree-benchmark-module's per-dispatch profile, Xeon, the sum of the four):

| tile (rows x columns) | B=1 | B=8 |
|---|---|---|
| IREE's 1 x 16 | 7.6-7.9 ms | 55.5 ms |
| 2 x 8 | 6.2-6.3 ms | 44.2 ms |
| 4 x 8 | 5.9-6.2 ms | 39.8 ms |
| 7 x 8 (kept) | 5.4-6.1 ms | 35.5-36.5 ms |

ResNet-18 B=8 whole: 180 -> 152 ms. Two 16-channel blocks per tile (more accumulators) measured the same.
Rows of more than 8 columns (two tiles of 8 fill them no better than one of 16) and images of one row keep
IREE's tile.

`narrow_row_tiles` edits the configuration text: only the lowering configs of dispatches IREE names `..._conv_...`
whose convolution writes a `tensor<N x blocks x OH x OW x 16 x f32>` (N static or dynamic) with IREE's exact
1 x 16 x 16 vector tile, so a format it does not know is left as it is (and the compile is what it would have
been).
"""

from __future__ import annotations

import re

__all__ = ["CONV_DATA_TILING_FLAG", "DATA_TILED_OPS", "narrow_row_tiles"]

# The flag naming the op families data tiling annotates, and the one that puts convolutions among them
# (onecopy.delegate.tuning.CONV_DATA_TILING builds its flags from these).
DATA_TILED_OPS = "--iree-dispatch-creation-experimental-set-data-tiling-ops"
CONV_DATA_TILING_FLAG = f"{DATA_TILED_OPS}=convolution"

_ROW = 16  # the output columns IREE's tile spans
_COLUMNS = _ROW // 2  # the narrow tile's columns, and the widest row that gets it
_MAX_ROWS = 8  # rows per tile at most: the tile is run row by row, so more only enlarges the workgroup
# The convolution's 9 loops (batch, channel block, row, column, input channel block, kernel row and column, channel,
# input channel) and its fill / epilogue's 5 (batch, channel block, row, column, channel).
_CONV_TILE = "vector_common_parallel = [1, 1, 1, 16, 0, 0, 0, 16, 0]"
_OUT_TILE = "vector_common_parallel = [1, 1, 1, 16, 16]"
# What the convolution writes: batch (static or dynamic), channel blocks, rows, columns, 16 channels.
_CONV_OUT = re.compile(r"outs\(%\w+ : tensor<(?:\d+|\?)x\d+x(\d+)x(\d+)x16xf32>\)")
_DISTRIBUTION = re.compile(r"distribution = \[(\d+), (\d+), 1, 0")


def _functions(text: str) -> list[list[str]]:
    """The text's lines, in runs that each start at a `func.func` (the first run: what comes before any)."""
    runs: list[list[str]] = [[]]
    for line in text.split("\n"):
        if "func.func @" in line:
            runs.append([])
        runs[-1].append(line)
    return runs


def _narrow_rows(function: list[str]) -> int:
    """The rows of the narrow tile for this function, or 0 where IREE's tile stays (not a data-tiled convolution
    over rows of at most 8 columns and at least 2 rows)."""
    if not function or "func.func @" not in function[0] or "_conv_" not in function[0]:
        return 0
    for line in function:
        if _CONV_TILE in line and (out := _CONV_OUT.search(line)):
            rows, columns = int(out.group(1)), int(out.group(2))
            return min(rows, _MAX_ROWS) if columns <= _COLUMNS and rows >= 2 else 0
    return 0


def narrow_row_tiles(configuration: str) -> tuple[str, int]:
    """`configuration` (iree-compile's `--compile-to=executable-configurations` output) with the whole image's
    rows (up to 8) x 8 columns for data-tiled convolutions over rows of at most 8 columns (and at least 2 rows), and
    how many lines changed."""
    edited, changed = [], 0
    for function in _functions(configuration):
        rows = _narrow_rows(function)
        for line in function:
            if rows:
                new = line.replace(_CONV_TILE, f"vector_common_parallel = [1, 1, {rows}, {_COLUMNS}, 0, 0, 0, 16, 0]")
                if new != line:  # the convolution itself: each workgroup takes the tile's rows
                    new = _DISTRIBUTION.sub(rf"distribution = [\1, \2, {rows}, 0", new)
                new = new.replace(_OUT_TILE, f"vector_common_parallel = [1, 1, {rows}, {_COLUMNS}, 16]")
                changed += new != line
                line = new
            edited.append(line)
    return "\n".join(edited), changed
