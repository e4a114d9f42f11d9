"""Page-deduplicated storage for the encoded weights of a cache entry.

IREE's parameter encoder packs a weight once per function that reads it, into one parameter (`parameter0`) at
offsets baked into the compiled module: the built-in model's two functions carry every packed weight twice, the
copies byte-identical. The file keeps each distinct page once; on restore the parameter's address range is
rebuilt from the file's pages with fixed mappings (the same file page mapped at every offset that holds it), so
the module sees its layout while memory and disk hold one copy (PSS counts the shared pages once).

    write_pages(out, arrays) -> layout      # unique pages to `out`, runs of (virtual page, file page, count)
    map_pages(fd, layout entry, owner) -> memoryview   # read-only view of the rebuilt range; unmapped with owner
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import BinaryIO

import numpy as np

__all__ = ["PAGE", "MAP_POPULATE", "write_pages", "map_pages"]

log = logging.getLogger("onecopy")

PAGE = mmap.PAGESIZE
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
# Fill the page tables at mapping time: the first call reads every weight, and faulting them in one 4 KiB page
# at a time there costs more than one populate here (the pages are in the page cache after the restore's check).
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only
_PROT_NONE = 0

_libc = None


def _c():
    global _libc
    if _libc is None:
        # The process's own symbols (libc is loaded): find_library("c") would run ldconfig, ~3 ms per process.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = libc
    return _libc


def write_pages(out: BinaryIO, arrays: dict[str, np.ndarray]) -> list[dict]:
    """Write each distinct page of `arrays` once to `out`. Returns, per array, its size and page runs."""
    import xxhash

    seen: dict[bytes, int] = {}  # page digest -> file page
    next_page = 0
    layout = []
    for name, array in arrays.items():
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        runs: list[list[int]] = []
        for vpage in range((data.nbytes + PAGE - 1) // PAGE):
            page = bytes(data[vpage * PAGE : (vpage + 1) * PAGE]).ljust(PAGE, b"\0")
            digest = xxhash.xxh3_128_digest(page)
            fpage = seen.get(digest)
            if fpage is not None:
                # A 128-bit digest match is checked byte for byte: a cache must not lie, even by collision.
                out.seek(fpage * PAGE)
                if out.read(PAGE) != page:
                    fpage = None
                out.seek(next_page * PAGE)
            if fpage is None:
                fpage = next_page
                out.seek(fpage * PAGE)
                out.write(page)
                seen.setdefault(digest, fpage)
                next_page += 1
            if runs and runs[-1][0] + runs[-1][2] == vpage and runs[-1][1] + runs[-1][2] == fpage:
                runs[-1][2] += 1
            else:
                runs.append([vpage, fpage, 1])
        layout.append({"name": name, "size": data.nbytes, "runs": runs})
    out.truncate(next_page * PAGE)
    return layout


def map_pages(fd: int, entry: dict, owner: object) -> memoryview:
    """The array described by `entry`, rebuilt in one address range from the file's pages, read-only.

    The range is unmapped when `owner` is collected, by Python, never from the engine's buffer release: IREE may
    drop its reference to a buffer on a worker thread without the GIL, where no Python code may run. The owner
    must therefore outlive every engine object that reads the range (the cache entry, held by the model)."""
    size = int(entry["size"])
    span = max((size + PAGE - 1) // PAGE, 1) * PAGE
    libc = _c()
    base = libc.mmap(None, span, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        return _copy_pages(fd, entry)
    try:
        for vpage, fpage, count in entry["runs"]:
            where = base + vpage * PAGE
            flags = mmap.MAP_SHARED | _MAP_FIXED | MAP_POPULATE
            got = libc.mmap(where, count * PAGE, mmap.PROT_READ, flags, fd, fpage * PAGE)
            if got != where:
                raise OSError(ctypes.get_errno(), "mmap of a cache page failed")
    except OSError as e:
        libc.munmap(base, span)
        log.warning("cache: mapping encoded weights page by page failed (%s); reading them into memory", e)
        return _copy_pages(fd, entry)
    region = (ctypes.c_ubyte * span).from_address(base)
    weakref.finalize(owner, libc.munmap, base, span)
    # Read-only view: the pages are mapped PROT_READ, so a write through a writable view would fault.
    return memoryview(region).cast("B")[:size].toreadonly()


def _copy_pages(fd: int, entry: dict) -> memoryview:
    """Fallback where fixed mappings are not available: the same bytes, read into private memory."""
    size = int(entry["size"])
    buffer = bytearray(max((size + PAGE - 1) // PAGE, 1) * PAGE)
    for vpage, fpage, count in entry["runs"]:
        buffer[vpage * PAGE : (vpage + count) * PAGE] = os.pread(fd, count * PAGE, fpage * PAGE)
    return memoryview(buffer)[:size].toreadonly()
