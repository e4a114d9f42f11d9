"""Compute precision of a specialization: what `load_program(..., precision=)` means for IREE's CPU code.

`bf16` keeps the program fp32 at its edges (inputs, outputs, weights on disk) and has the compiler demote the
inputs of contractions (matmuls, convolutions) to bf16, accumulating in f32
(`--iree-global-opt-demote-contraction-inputs-type=bf16`). It only pays on a CPU that multiplies bf16 natively
(x86 AVX512-BF16 or AMX-BF16, Arm BF16): elsewhere the conversions cost time and buy none, so it is refused there,
naming the missing feature. It is never the default: the answers differ from fp32 by bf16 rounding (~1e-3
relative per layer).

bf16 allows bf16 rather than forcing it: a tuned module also tries its lead configuration in fp32
(onecopy.delegate.tuning.with_fp32) and runs in fp32 where that measures faster, as on a Xeon whose bf16 dot
products are no faster than its fp32 FMAs.
A different precision is different code: the flags are part of the cache key's features, so fp32 and bf16
specializations of one program coexist in the cache.

A `vmfb` program is compiled at export, so its bf16 code is too (`CompileSpec(precisions=("fp32", "bf16"))`),
for a CPU baseline that has the bf16 instructions (`aot_precision`): the fp32 baseline of x86_64 (x86-64-v3,
AVX2) has none, and its bf16 code ran 56x slower than fp32 (245 vs 4.3 ms, the built-in model at B=16), where
x86-64-v4 with AVX512-BF16 ran 3.4x faster (1.27 ms) on Zen 4.
"""

from __future__ import annotations

import platform
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from onecopy.errors import InvalidArgument
from onecopy.runtime.backend_options import DEFAULT_PRECISION

__all__ = ["AotPrecision", "aot_precision", "check_precision_runs_here", "native_bf16_flags", "precision_flags",
           "without_droppable"]

# /proc/cpuinfo flags (x86 "flags", Arm "Features") that mean bf16 dot products in hardware.
_NATIVE_BF16 = {"x86_64": ("avx512_bf16", "amx_bf16"), "aarch64": ("bf16",)}

_IM2COL = "--iree-global-opt-use-im2col-for-convs"
# Flags that make code faster, not different: a compile that fails with them is tried again without. IREE 3.13's
# im2col miscompiles a depthwise convolution in NHWC (an invalid linalg.batch_matvec), which the depthwise_nhwc
# rewrite makes of every MobileNet block: such a module runs its convolutions in bf16 without im2col.
_DROPPABLE = frozenset({_IM2COL})

_FLAGS = {
    "fp32": (),
    "bf16": (
        "--iree-global-opt-demote-contraction-inputs-type=bf16",
        "--iree-global-opt-demote-contraction-inputs-operations=all",
        # A demoted convolution stays a convolution, which has no bf16 microkernel: ResNet-18 ran as slow as in
        # fp32 (4.4x ONNX Runtime, with or without conv data tiling). As im2col + matmul it reaches the bf16
        # matmul microkernel: 1.5x (measured on Zen 4 with avx512_bf16).
        _IM2COL,
        # IREE 3.13's unpack microkernel fails to lower for some bf16 tiles (MobileNetV3-small: "failed to lower
        # micro kernel operation", iree_uk_unpack on 16x16 bf16), which threw away data tiling altogether (3.0x
        # ONNX Runtime instead of 1.6x). The matmul microkernel alone, after compiler_flags' `all` (the last one
        # given wins), keeps data tiling; packing as generated code cost ResNet-18 and the seed MLP about 3%.
        "--iree-llvmcpu-enable-ukernels=mmt4d",
    ),
}


@dataclass(frozen=True)
class AotPrecision:
    """How a target's `vmfb` code is compiled in a precision other than fp32: for which CPU baseline (`cpu`,
    `features`, iree-compile's `--iree-llvmcpu-target-cpu` and `-cpu-features`), and the /proc/cpuinfo flags a
    device needs to run it (all of them)."""

    cpu: str
    features: str
    cpu_flags: tuple[str, ...]

    def compiler_flags(self) -> tuple[str, ...]:
        # After compiler_flags()' baseline: iree-compile takes the last of a repeated flag.
        return (f"--iree-llvmcpu-target-cpu={self.cpu}", f"--iree-llvmcpu-target-cpu-features={self.features}")


_AOT = {
    ("x86_64", "bf16"): AotPrecision("x86-64-v4", "+avx512bf16",
                                     ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16")),
    ("aarch64", "bf16"): AotPrecision("generic", "+bf16", ("bf16",)),
}


def aot_precision(target: str, precision: str) -> AotPrecision | None:
    """How `target`'s ahead-of-time code is compiled in `precision`; None for fp32 (the target's own baseline)
    and for a pair onecopy cannot compile ahead of time (a GPU target)."""
    return _AOT.get((target, precision))


def native_bf16_flags(machine: str | None = None) -> tuple[str, ...]:
    """The CPU flags any one of which gives native bf16 on `machine` (default: this one)."""
    machine = (machine or platform.machine()).lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    return _NATIVE_BF16.get(machine, ())


def check_precision_runs_here(precision: str, *, compute_unit: str, cpu_flags: Collection[str], where: str,
                              needs: Collection[str] = ()) -> None:
    """Refuse a precision this load cannot honour, with the reason and the fix. `needs`: CPU flags the code
    needs besides native bf16 (a vmfb program's bf16 baseline, `AotPrecision.cpu_flags`), all of them."""
    if precision == DEFAULT_PRECISION:
        return
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
    missing = [flag for flag in needs if flag not in cpu_flags]
    if missing:
        raise InvalidArgument(
            f"{where}: the program's {precision} code was compiled for CPUs with {', '.join(needs)}; this CPU lacks "
            f"{', '.join(missing)}. Load with precision='{DEFAULT_PRECISION}', or re-export with "
            "CompileSpec(packaging='mlir') so that bf16 code is compiled for this CPU."
        )


def precision_flags(precision: str) -> tuple[str, ...]:
    """iree-compile flags for `precision` (none for fp32)."""
    return _FLAGS[precision]


def without_droppable(flags: Sequence[str]) -> tuple[str, ...]:
    """`flags` without those that only make code faster (`_DROPPABLE`): what a compile that failed tries next."""
    return tuple(flag for flag in flags if flag not in _DROPPABLE)
