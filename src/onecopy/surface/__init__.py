"""Surfaces: caller buffers in shared memory that a bound method reads and writes in place.

- `header`: the on-disk format every process agrees on (magic, format code, sizes, row stride, generation),
  and the checks of what a creator or opener is given;
- `lock`: the reader/writer lock across threads and processes;
- `surface`: `Surface` itself: create, open by name, map, view, close, unlink.
"""

from onecopy.surface.header import DATA_OFFSET, FORMATS, HEADER_VERSION, ROW_ALIGNMENT, SHM_DIR
from onecopy.surface.surface import Surface

__all__ = ["Surface", "SHM_DIR", "ROW_ALIGNMENT", "DATA_OFFSET", "HEADER_VERSION", "FORMATS"]
