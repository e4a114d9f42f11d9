"""Memory of a process, in bytes: psutil's RSS, PSS and USS, and the kinds of its PSS from smaps_rollup.

PSS divides each page among the mappings of it, so memory shared by processes (or mapped twice by one) counts once
in total: the figure for weights stored once. USS counts only the pages no other mapping shares.
"""

from __future__ import annotations

import psutil

__all__ = ["SMAPS_FIELDS", "smaps_rollup"]

# psutil reports Rss, Pss and Uss but does not split PSS by kind (anonymous, file, shared memory) nor pages by
# clean / dirty: those come from /proc/<pid>/smaps_rollup, the file psutil reads its PSS from.
_KINDS = ("Pss_Anon", "Pss_File", "Pss_Shmem", "Shared_Clean", "Shared_Dirty", "Private_Clean", "Private_Dirty",
          "Anonymous")
SMAPS_FIELDS = ("Rss", "Pss", "Uss", *_KINDS)


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """SMAPS_FIELDS of process `pid` (Linux), in bytes."""
    process = psutil.Process() if pid == "self" else psutil.Process(int(pid))
    full = process.memory_full_info()
    found = {"Rss": full.rss, "Pss": full.pss, "Uss": full.uss}
    with open(f"/proc/{process.pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB" and parts[0].rstrip(":") in _KINDS:
                found[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return found
