"""Whether this kernel and the filesystem under a directory can map file pages with huge (PMD) pages at all,
probed with a plain whole-file mapping (no onecopy code), so tests of onecopy's huge-page mapping skip, saying
why, where the machine cannot, and fail where it can and onecopy does not."""

import mmap
import os
from pathlib import Path

HUGE = 2 << 20


def mapped_kib(path: Path, *fields: str) -> dict[str, int]:
    """KiB per smaps field (e.g. "Rss", "Pss", "FilePmdMapped") over this process's mappings of `path`."""
    totals, inside = dict.fromkeys(fields, 0), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and ":" not in head:
                inside = line.rstrip().endswith(str(path))
            elif inside and head.rstrip(":") in totals:
                totals[head.rstrip(":")] += int(line.split()[1])
    return totals


def file_pmd_mapped(path: Path) -> int:
    """Bytes of `path` this process maps with PMD entries, summed over its mappings in /proc/self/smaps."""
    return mapped_kib(path, "FilePmdMapped")["FilePmdMapped"] * 1024


def file_pages_map_huge(directory: Path) -> bool:
    path = directory / "huge-probe.bin"
    with open(path, "wb") as f:
        f.write(os.urandom(2 * HUGE))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            mapped.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            return False
        sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
        huge = file_pmd_mapped(path)
        mapped.close()
        return huge > 0
    finally:
        path.unlink()


SKIP_REASON = ("this kernel or the filesystem of the test's temporary directory keeps file pages in 4 KiB folios "
               "(huge file folios need THP on and a filesystem with large folios: ext4/xfs on Linux 6.16+, tmpfs "
               "mounted huge=): nothing to map huge here")
