"""What names a specialization cache entry and a cache directory: the cache key, the directory's identity, and
where the cache lives (`$ONECOPY_CACHE_DIR`, else the platform's user cache directory)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CACHE_FORMAT_VERSION",
    "DEFAULT_MAX_CACHE_BYTES",
    "ENV_CACHE_DIR",
    "ENV_DISABLE_CACHE",
    "CacheIdentity",
    "cache_disabled",
    "cache_key",
    "default_cache_dir",
]

CACHE_FORMAT_VERSION = 1
DEFAULT_MAX_CACHE_BYTES = 4 * 2**30
ENV_CACHE_DIR = "ONECOPY_CACHE_DIR"
ENV_DISABLE_CACHE = "ONECOPY_DISABLE_CACHE"


def default_cache_dir() -> Path:
    """`$ONECOPY_CACHE_DIR`, else the platform's user cache directory for onecopy."""
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("onecopy"))


def cache_disabled() -> bool:
    """`ONECOPY_DISABLE_CACHE=1`: every load specializes (for debugging the compiler path)."""
    return os.environ.get(ENV_DISABLE_CACHE, "").strip().lower() not in ("", "0", "false", "no")


def cache_key(
    *, export_hash: str, packaging: str, compute_units: str, target: str, features: str, compiler: str
) -> str:
    """sha256 of what decides the compiled code. Function bindings are not in it: all delegates of a
    multifunction program share one entry."""
    fields = {
        "export_hash": export_hash,
        "packaging": packaging,
        "compute_units": compute_units,
        "target": target,
        "features": features,
        "compiler": compiler,
        "format": CACHE_FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class CacheIdentity:
    """(st_dev, st_ino) of the opened cache directory: the same for every path (symlink) that reaches it."""

    device: int
    inode: int
