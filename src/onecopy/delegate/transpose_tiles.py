"""Workgroup tiles for an image's NCHW -> NHWC transpose: whole rows, where IREE's heuristic cuts them short.

The channels-last candidates (onecopy.delegate.tuning) compute convolutions in NHWC, so IREE transposes the NCHW
input image first. IREE 3.13 distributes that transpose over tiles of 32 columns (MobileNetV3-small's input,
B=8: all 8 images x 3 channels x 56 rows x 32 columns a workgroup): each workgroup then reads 128-byte pieces of
rows from every channel plane of every image, and writes 384-byte pieces of NHWC rows. Given whole rows instead
(the same number of values a workgroup: 8 rows x 224 columns), it reads and writes contiguous rows. IREE's
per-dispatch profile, Xeon (AVX-512), 2 threads, the transpose of 3x224x224 images:

| workgroup tile (images x channels x rows x columns) | B=1 | B=8 |
|---|---|---|
| IREE's (B x 3 x 56 x 32) | 0.066-0.074 ms | 1.25-1.39 ms |
| whole rows, same size (B x 3 x 8 x 224, kept) | 0.043 ms | 0.50-0.53 ms |
| whole rows, 56 of them (B x 3 x 56 x 224) | 0.044 ms | 0.51 ms |
| one image, 32 columns (1 x 3 x 56 x 32) | | 1.20 ms |

So the columns are what matters; keeping the tile's size keeps IREE's number of workgroups (28 here), and with it
the parallelism on machines with more cores than this one. MobileNetV3-small B=8 in channels-last: 17.8-18.3 ->
17.3-17.4 ms a call in iree-benchmark-module, 16.93 -> 16.51 ms through onecopy (interleaved in one process; the
transpose's own 0.8 ms is not all saved); B=1 unchanged (2.77 / 2.76 ms).

`whole_row_transposes` edits the configuration text (iree-compile's `--compile-to=executable-configurations`
output): only the distribution of generics that map (d0, d1, d2, d3) to (d0, d2, d3, d1) (NCHW -> NHWC) in
dispatches IREE names `..._transpose_...`, over a static width, so anything else is left as it is.
"""

from __future__ import annotations

import re

__all__ = ["CHANNELS_LAST_FLAG", "whole_row_transposes"]

# The preprocessing that computes convolutions in NHWC (onecopy.delegate.tuning.CHANNELS_LAST is this flag), and so
# transposes their NCHW inputs.
CHANNELS_LAST_FLAG = ("--iree-preprocessing-pass-pipeline="
                      "builtin.module(util.func(iree-preprocessing-convert-conv-to-channels-last))")

# The generic's indexing maps (input, output) of a (N)CHW -> (N)HWC transpose: IREE leaves a batch of 1 out.
_TO_CHANNELS_LAST = (
    "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d2, d3, d1)>]",
    "affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d1, d2, d0)>]",
)
_WIDTH = re.compile(r"ins\(%\w+ : tensor<(?:(?:\d+|\?)x)?\d+x\d+x(\d+)xf32>\)")
_DISTRIBUTION = re.compile(r"distribution = \[([\d, ]+)\]")


def _whole_rows(distribution: re.Match, width: int) -> str:
    """The distribution with the columns' tile the whole width and the rows' tile shrunk to keep its size."""
    *outer, rows, columns = (int(v) for v in distribution.group(1).split(","))
    if columns == 0 or columns >= width or rows == 0:  # 0: not tiled, already whole
        return distribution.group(0)
    return f"distribution = [{', '.join(str(v) for v in (*outer, max(1, rows * columns // width), width))}]"


def whole_row_transposes(configuration: str) -> tuple[str, int]:
    """`configuration` with (N)CHW -> (N)HWC transposes distributed over whole rows (as many values a workgroup as
    IREE's tile: rows x columns kept), and how many lines changed."""
    edited, changed, transpose = [], 0, False
    for line in configuration.split("\n"):
        if "func.func @" in line:
            transpose = "_transpose_" in line
        if (transpose and "linalg.generic" in line and any(maps in line for maps in _TO_CHANNELS_LAST)
                and (found := _WIDTH.search(line))):
            new = _DISTRIBUTION.sub(lambda d: _whole_rows(d, int(found.group(1))), line)
            changed += new != line
            line = new
        edited.append(line)
    return "\n".join(edited), changed
