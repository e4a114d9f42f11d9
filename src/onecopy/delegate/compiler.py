"""The compiler: MLIR bundles become `.vmfb` code for a target, with IREE's diagnostics turned into onecopy errors.

Export (checking that a bundle compiles, AOT `vmfb` packaging) and specialization (compiling a portable bundle
for this machine) both compile through here, so the flags and the data-tiling fallback are decided in one place.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar

from onecopy.delegate.conv_tiles import CONV_DATA_TILING_FLAG, narrow_row_tiles
from onecopy.delegate.targets import Target, compiler_flags
from onecopy.delegate.transpose_tiles import CHANNELS_LAST_FLAG, whole_row_transposes
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
    edits = _configuration_edits(flags, data_tiling=data_tiling)
    try:
        if edits:
            return _compile_edited(source, flags, target, edits)
        return compile_str(bytes(source), input_type="auto", extra_args=flags)
    except CompilerToolError as e:
        detail = str(e).strip().splitlines()
        summary = next((line for line in detail if "error:" in line), detail[0] if detail else "unknown error")
        raise DelegateError(f"IREE could not compile the bundle for {target.name}: {summary.strip()}") from e


# What the two-phase compile sets in IREE's executable configurations, and the log line that says it did.
_Edit = tuple[Callable[[str], tuple[str, int]], str]
_NARROW_ROWS: _Edit = (narrow_row_tiles, "vector tiles set for convolutions over narrow rows")
_WHOLE_ROWS: _Edit = (whole_row_transposes, "NCHW -> NHWC transposes distributed over whole rows")


def _configuration_edits(flags: Sequence[str], *, data_tiling: bool) -> list[_Edit]:
    """The configuration edits that apply to a compile with `flags`: each fixes a heuristic of IREE's for dispatches
    only those flags create (data-tiled convolutions; the input transposes of channels-last convolutions)."""
    return [edit for edit, applies in ((_NARROW_ROWS, data_tiling and CONV_DATA_TILING_FLAG in flags),
                                       (_WHOLE_ROWS, CHANNELS_LAST_FLAG in flags)) if applies]


def _compile_edited(source: bytes | memoryview, flags: list[str], target: Target, edits: list[_Edit]) -> bytes:
    """Compile in two phases, to IREE's executable configurations and on from them, `edits` applied between
    (onecopy.delegate.conv_tiles, onecopy.delegate.transpose_tiles). Where the edited configuration does not
    compile, the one-phase compile, with IREE's own configurations."""
    from iree.compiler import CompilerToolError, compile_str

    configured = compile_str(bytes(source), input_type="auto",
                             extra_args=[*flags, "--compile-to=executable-configurations"])
    text, changes = configured.decode(), []
    for edit, what in edits:
        text, changed = edit(text)
        if changed:
            changes.append(f"{what} ({changed} lines)")
    try:
        vmfb = compile_str(text.encode(), input_type="auto", extra_args=[*flags, "--compile-from=executable-configurations"])
    except CompilerToolError as e:
        log.debug("%s: the two-phase compile failed (%s); in one phase, with IREE's own configurations", target.name,
                  str(e).strip().splitlines()[:1])
        return compile_str(bytes(source), input_type="auto", extra_args=flags)
    for change in changes:
        log.debug("%s: %s", target.name, change)
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
