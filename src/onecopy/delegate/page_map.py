"""Page-deduplicated storage for the encoded weights of a cache entry.

IREE's parameter encoder packs a weight once per function that reads it, into one parameter (`parameter0`) at
offsets baked into the compiled module: the built-in model's two functions carry every packed weight twice, the
copies byte-identical. The file keeps each distinct page once; on restore the parameter's address range is
rebuilt from the file's pages with fixed mappings (the same file page mapped at every offset that holds it), so
the module sees its layout while memory and disk hold one copy (PSS counts the shared pages once).

    write_pages(out, arrays) -> layout      # unique pages to `out`, runs of (virtual page, file page, count)
    map_pages(fd, layout entry, owner) -> memoryview   # read-only view of the rebuilt range; unmapped with owner
    huge_mapped_bytes(view) -> int          # how much of a view this process maps with huge (PMD) pages

Huge pages. Weights are read in full on every call, and on 4 KiB pages a 32 MiB matrix-vector product takes a TLB
miss every 64 cache lines; on 2 MiB pages it takes 16 (the built-in model's forward, B=1: 3-4% faster than the
same file on 4 KiB pages, measured in one process; calls bound by memory bandwidth gain nothing).
The page cache of a filesystem with large folios (ext4 and xfs since Linux 6.16, tmpfs mounted `huge=`) holds a
file in 2 MiB folios when it is read through a mapping advised MADV_HUGEPAGE, and every process that maps a
folio at a 2 MiB-aligned address whose offset matches the file's maps it with one page-table entry, still shared
(PSS counts it once). So the rebuilt range is placed where its largest runs line up with their file pages, and
advised before it is populated. Where the kernel cannot (older kernels, other filesystems, THP off) the same
calls leave 4 KiB pages: nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import weakref
from typing import BinaryIO

import numpy as np

__all__ = ["PAGE", "HUGE_PAGE", "MADV_HUGEPAGE", "MADV_POPULATE_READ", "write_pages", "map_pages", "advise_huge",
           "huge_mapped_bytes"]

log = logging.getLogger("onecopy")

PAGE = mmap.PAGESIZE
_MAP_FIXED = getattr(mmap, "MAP_FIXED", 0x10)
_PROT_NONE = 0


def _pmd_size() -> int:
    """The span of one huge (PMD) page: 2 MiB on x86_64 and on aarch64 with 4 KiB pages, 512 MiB with 64 KiB."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE = _pmd_size()
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_READ = 22  # Linux 5.14+; Python's mmap module does not name it

_libc = None


def _c():
    global _libc
    if _libc is None:
        # The process's own symbols (libc is loaded): find_library("c") would run ldconfig, ~3 ms per process.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
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
    """The array described by `entry`, rebuilt in one address range from the file's pages, read-only, on huge
    pages where the kernel can (see the module docstring).

    The range is unmapped when `owner` is collected, by Python, never from the engine's buffer release: IREE may
    drop its reference to a buffer on a worker thread without the GIL, where no Python code may run. The owner
    must therefore outlive every engine object that reads the range (the cache entry, held by the model)."""
    size = int(entry["size"])
    span = max((size + PAGE - 1) // PAGE, 1) * PAGE
    libc = _c()
    # Reserve a huge page more than needed, so the range can start where its runs line up with the file.
    reserved = span + HUGE_PAGE
    reservation = libc.mmap(None, reserved, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if reservation in (None, ctypes.c_void_p(-1).value):
        return _copy_pages(fd, entry)
    base = _aligned_base(reservation, entry["runs"])
    try:
        for vpage, fpage, count in entry["runs"]:
            where = base + vpage * PAGE
            got = libc.mmap(where, count * PAGE, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd, fpage * PAGE)
            if got != where:
                raise OSError(ctypes.get_errno(), "mmap of a cache page failed")
    except OSError as e:
        libc.munmap(reservation, reserved)
        log.warning("cache: mapping encoded weights page by page failed (%s); reading them into memory", e)
        return _copy_pages(fd, entry)
    advise_huge(base, span)
    # Fill the page tables now, after the advice (MAP_POPULATE would fill them before it, from 4 KiB folios): the
    # first call reads every weight, and faulting them in one page at a time there costs more than this.
    if libc.madvise(base, span, MADV_POPULATE_READ) != 0:
        log.debug("cache: MADV_POPULATE_READ unavailable (errno %d); weights fault in on first use", ctypes.get_errno())
    region = (ctypes.c_ubyte * span).from_address(base)
    weakref.finalize(owner, libc.munmap, reservation, reserved)
    # Read-only view: the pages are mapped PROT_READ, so a write through a writable view would fault.
    return memoryview(region).cast("B")[:size].toreadonly()


def _aligned_base(reservation: int, runs: list) -> int:
    """The start, within a reservation one huge page longer than the range, at which the most pages of `runs` sit
    at the same offset modulo a huge page as their file pages: only such pages can be mapped huge. (Deduplicated
    runs point back into earlier file pages at arbitrary distances, so not every run can line up.)"""
    per_huge = HUGE_PAGE // PAGE
    weight: dict[int, int] = {}
    for vpage, fpage, count in runs:
        if count >= per_huge:  # a shorter run cannot cover a whole huge page
            shift = (fpage - vpage) % per_huge
            weight[shift] = weight.get(shift, 0) + count
    shift = max(weight, key=weight.__getitem__) if weight else 0
    first = reservation // PAGE
    return (first + (shift - first) % per_huge) * PAGE


def advise_huge(address: int, length: int) -> bool:
    """Ask the kernel to back [address, address + length) with huge pages (MADV_HUGEPAGE); False where it cannot
    (THP compiled out or off): then the range keeps 4 KiB pages, which is never wrong."""
    if _c().madvise(address, length, MADV_HUGEPAGE) == 0:
        return True
    log.debug("MADV_HUGEPAGE refused (errno %d): 4 KiB pages", ctypes.get_errno())
    return False


def huge_mapped_bytes(view: memoryview) -> int:
    """Bytes of `view`'s address range this process maps with huge (PMD) pages, per /proc/self/smaps; 0 where the
    kernel says nothing (not Linux). Counts whole mappings that overlap the range, clipped to it."""
    start = np.frombuffer(view, np.uint8).ctypes.data
    end = start + view.nbytes
    total = 0
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read()
    except OSError:
        return 0
    low = high = 0
    for line in smaps.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
        elif line.startswith(("FilePmdMapped:", "ShmemPmdMapped:", "AnonHugePages:")) and low < end and high > start:
            kib = int(line.split()[1])
            total += min(kib * 1024, min(high, end) - max(low, start))
    return total


def _copy_pages(fd: int, entry: dict) -> memoryview:
    """Fallback where fixed mappings are not available: the same bytes, read into private memory."""
    size = int(entry["size"])
    buffer = bytearray(max((size + PAGE - 1) // PAGE, 1) * PAGE)
    for vpage, fpage, count in entry["runs"]:
        buffer[vpage * PAGE : (vpage + count) * PAGE] = os.pread(fd, count * PAGE, fpage * PAGE)
    return memoryview(buffer)[:size].toreadonly()
