"""Compute precision of a specialization: what `load_program(..., precision=)` means for IREE's CPU code.

`bf16` keeps the program fp32 at its edges (inputs, outputs, weights on disk) and has the compiler demote the
inputs of contractions (matmuls, convolutions) to bf16, accumulating in f32
(`--iree-global-opt-demote-contraction-inputs-type=bf16`). It only pays on a CPU that multiplies bf16 natively
(x86 AVX512-BF16 or AMX-BF16, Arm BF16): elsewhere the conversions cost time and buy none, so it is refused there,
naming the missing feature. It is never the default: the answers differ from fp32 by bf16 rounding (~1e-3
relative per layer).

A different precision is different code: the flags are part of the cache key's features, so fp32 and bf16
specializations of one program coexist in the cache.
"""

from __future__ import annotations

import platform
from collections.abc import Collection

from onecopy.errors import InvalidArgument
from onecopy.runtime.backend_options import DEFAULT_PRECISION

__all__ = ["check_precision_runs_here", "native_bf16_flags", "precision_flags"]

# /proc/cpuinfo flags (x86 "flags", Arm "Features") that mean bf16 dot products in hardware.
_NATIVE_BF16 = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}

_FLAGS = {
    "fp32": (),
    "bf16": (
        "--iree-global-opt-demote-contraction-inputs-type=bf16",
        "--iree-global-opt-demote-contraction-inputs-operations=all",
        # A demoted convolution stays a convolution, which has no bf16 microkernel: ResNet-18 ran as slow as in
        # fp32 (4.4x ONNX Runtime, with or without conv data tiling). As im2col + matmul it reaches the bf16
        # matmul microkernel: 1.5x (measured on Zen 4 with avx512_bf16).
        "--iree-global-opt-use-im2col-for-convs",
        # IREE 3.13's unpack microkernel fails to lower for some bf16 tiles (MobileNetV3-small: "failed to lower
        # micro kernel operation", iree_uk_unpack on 16x16 bf16), which threw away data tiling altogether (3.0x
        # ONNX Runtime instead of 1.6x). The matmul microkernel alone, after compiler_flags' `all` (the last one
        # given wins), keeps data tiling; packing as generated code cost ResNet-18 and the seed MLP about 3%.
        "--iree-llvmcpu-enable-ukernels=mmt4d",
    ),
}


def native_bf16_flags(machine: str | None = None) -> tuple[str, ...]:
    """The CPU flags any one of which gives native bf16 on `machine` (default: this one)."""
    machine = (machine or platform.machine()).lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return _NATIVE_BF16.get(machine, ())


def check_precision_runs_here(precision: str, *, compute_unit: str, packaging: str, cpu_flags: Collection[str],
                              where: str) -> None:
    """Refuse a precision this load cannot honour, with the reason and the fix."""
    if precision == DEFAULT_PRECISION:
        return
    if packaging != "mlir":
        raise InvalidArgument(
            f"{where}: precision='{precision}' needs a portable program (packaging='mlir'): a '{packaging}' "
            "program's code was compiled in fp32 at export. Re-export with CompileSpec(packaging='mlir'), or load "
            f"with precision='{DEFAULT_PRECISION}'."
        )
    if compute_unit != "cpu":
        raise InvalidArgument(
            f"{where}: precision='{precision}' is for CPU targets only; load with backend option "
            f"compute_units='cpu', or precision='{DEFAULT_PRECISION}'."
        )
    wanted = native_bf16_flags()
    if not any(flag in cpu_flags for flag in wanted):
        features = " or ".join(wanted) or "a bf16 dot-product instruction"
        raise InvalidArgument(
            f"{where}: precision='{precision}' needs a CPU with native bf16 ({features}); this CPU ({platform.machine()}) "
            f"lacks {features}, where bf16 would be slower than fp32. Load with precision='{DEFAULT_PRECISION}'."
        )


def precision_flags(precision: str) -> tuple[str, ...]:
    """iree-compile flags for `precision` (none for fp32)."""
    return _FLAGS[precision]
