"""The compiler: MLIR bundles become `.vmfb` code for a target, with IREE's diagnostics turned into onecopy errors.

Export (checking that a bundle compiles, AOT `vmfb` packaging) and specialization (compiling a portable bundle
for this machine) both compile through here, so the flags and the data-tiling fallback are decided in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from onecopy.delegate.targets import Target, compiler_flags
from onecopy.errors import DelegateError

__all__ = ["compile_bundle", "compile_bundle_best"]

log = logging.getLogger("onecopy")


def compile_bundle(
    source: bytes | memoryview, target: Target, *, for_host: bool, data_tiling: bool = True,
    extra_flags: Sequence[str] = (),
) -> bytes:
    """Compile MLIR (bytecode or text) into a `.vmfb` for `target`. Raises `DelegateError` with the compiler's
    diagnostics."""
    from iree.compiler import CompilerToolError, compile_str

    flags = compiler_flags(target, for_host=for_host, data_tiling=data_tiling) + list(extra_flags)
    try:
        return compile_str(bytes(source), input_type="auto", extra_args=flags)
    except CompilerToolError as e:
        detail = str(e).strip().splitlines()
        summary = next((line for line in detail if "error:" in line), detail[0] if detail else "unknown error")
        raise DelegateError(f"IREE could not compile the bundle for {target.name}: {summary.strip()}") from e


def compile_bundle_best(
    source: bytes | memoryview, target: Target, *, for_host: bool, where: str, extra_flags: Sequence[str] = (),
    semantic_flags: Sequence[str] = (),
) -> tuple[bytes, bool]:
    """Compile with data tiling (faster matmuls), or without it where IREE fails: it is an optimization, and
    IREE 3.13 fails some dynamic-shape dispatches with it (seen: "exceeded stack allocation limit" in an
    attention block). Returns (vmfb, data_tiling_used). `extra_flags` go with the data-tiled compile only;
    `semantic_flags` (what the code computes, e.g. its precision) go with both, so a fallback never changes the
    answers the caller asked for."""
    try:
        return compile_bundle(source, target, for_host=for_host, extra_flags=[*semantic_flags, *extra_flags]), True
    except DelegateError as e:
        log.warning("%s: compiling for %s with data tiling failed (%s); compiling without it", where, target.name, e)
        return compile_bundle(source, target, for_host=for_host, data_tiling=False, extra_flags=semantic_flags), False
