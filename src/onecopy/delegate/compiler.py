"""The compiler: MLIR bundles become `.vmfb` code for a target, with IREE's diagnostics turned into onecopy errors.

Export (checking that a bundle compiles, AOT `vmfb` packaging) and specialization (compiling a portable bundle
for this machine) both compile through here, so the flags and the data-tiling fallback are decided in one place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from contextvars import ContextVar

from onecopy.delegate.conv_tiles import CONV_DATA_TILING_FLAG, narrow_row_tiles
from onecopy.delegate.targets import Target, compiler_flags
from onecopy.errors import DelegateError

__all__ = ["compile_bundle", "compile_bundle_best", "fallbacks_warned_once", "warn_fallback"]

log = logging.getLogger("onecopy")

# Within `fallbacks_warned_once`: the fallback warnings already logged there.
_warned: ContextVar[set[str] | None] = ContextVar("onecopy_fallbacks_warned", default=None)


@contextlib.contextmanager
def fallbacks_warned_once() -> Iterator[None]:
    """Within: each distinct fallback warning is logged once, repeats at debug level. Tuning compiles a module in
    several configurations, and each fell back the same way: a bf16 MobileNet's first load logged ten warnings."""
    token = _warned.set(set())
    try:
        yield
    finally:
        _warned.reset(token)


def warn_fallback(message: str, *args: object) -> None:
    """Log that a compile fell back to fewer flags (once per distinct text within `fallbacks_warned_once`)."""
    text = message % args
    seen = _warned.get()
    if seen is not None and text in seen:
        log.debug(text)
        return
    if seen is not None:
        seen.add(text)
    log.warning(text)


def compile_bundle(
    source: bytes | memoryview, target: Target, *, for_host: bool, data_tiling: bool = True,
    extra_flags: Sequence[str] = (),
) -> bytes:
    """Compile MLIR (bytecode or text) into a `.vmfb` for `target`. Raises `DelegateError` with the compiler's
    diagnostics."""
    from iree.compiler import CompilerToolError, compile_str

    flags = compiler_flags(target, for_host=for_host, data_tiling=data_tiling) + list(extra_flags)
    try:
        if data_tiling and CONV_DATA_TILING_FLAG in flags:
            return _compile_conv_tiles(source, flags, target)
        return compile_str(bytes(source), input_type="auto", extra_args=flags)
    except CompilerToolError as e:
        detail = str(e).strip().splitlines()
        summary = next((line for line in detail if "error:" in line), detail[0] if detail else "unknown error")
        raise DelegateError(f"IREE could not compile the bundle for {target.name}: {summary.strip()}") from e


def _compile_conv_tiles(source: bytes | memoryview, flags: list[str], target: Target) -> bytes:
    """Convolution data tiling in two phases, IREE's vector tiles of convolutions over narrow rows set between
    them (onecopy.delegate.conv_tiles). Where the edited configuration does not compile, the one-phase compile."""
    from iree.compiler import CompilerToolError, compile_str

    configured = compile_str(bytes(source), input_type="auto",
                             extra_args=[*flags, "--compile-to=executable-configurations"])
    text, changed = narrow_row_tiles(configured.decode())
    try:
        vmfb = compile_str(text.encode(), input_type="auto", extra_args=[*flags, "--compile-from=executable-configurations"])
    except CompilerToolError as e:
        log.debug("%s: the two-phase compile failed (%s); in one phase, with IREE's own tiles", target.name,
                  str(e).strip().splitlines()[:1])
        return compile_str(bytes(source), input_type="auto", extra_args=flags)
    if changed:
        log.debug("%s: vector tiles set for convolutions over narrow rows (%d lines)", target.name, changed)
    return vmfb


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
        warn_fallback("%s: compiling for %s with data tiling failed (%s); compiling without it", where, target.name, e)
        return compile_bundle(source, target, for_host=for_host, data_tiling=False, extra_flags=semantic_flags), False
