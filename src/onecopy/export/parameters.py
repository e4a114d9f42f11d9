"""The parameter table of an export: every weight once, deduplicated by identity and by content."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import torch

__all__ = ["ParameterTable", "parameter_key"]


def parameter_key(digest: str) -> str:
    """Named data key of a parameter: content-addressed, so equal weights share one segment."""
    return f"param/{digest[:40]}"


class ParameterTable:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.digests: dict[str, str] = {}
        self._by_digest: dict[str, str] = {}
        self._by_identity: dict[tuple, str] = {}

    def add(self, fqn: str, tensor: torch.Tensor) -> str:
        """Return the table name of `tensor`, adding it unless the same tensor or the same content is there."""
        t = tensor.detach()
        identity = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        known = self._by_identity.get(identity)
        if known is not None:
            return known
        t = t.contiguous()
        data = self.host_bytes(t)
        h = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
        h.update(data)
        digest = h.hexdigest()
        name = self._by_digest.get(digest)
        if name is None:
            name = self._unique_name(fqn)
            self.tensors[name] = t
            self.digests[name] = digest
            self._by_digest[digest] = name
        self._by_identity[identity] = name
        return name

    @staticmethod
    def host_bytes(t: torch.Tensor) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array sharing its memory (works for every dtype, bf16 included)."""
        return t.contiguous().reshape(-1).view(torch.uint8).numpy()

    def _unique_name(self, fqn: str) -> str:
        base = re.sub(r"\W", "_", fqn).strip("_") or "param"
        if base[0].isdigit():
            base = f"p_{base}"
        name, n = base, 1
        while name in self.tensors:
            n += 1
            name = f"{base}_{n}"
        return name
