"""CompileSpec: how a program's partitions are packaged and for which compute units and targets."""

from __future__ import annotations

from dataclasses import dataclass

from onecopy.delegate.manifest import PACKAGINGS
from onecopy.delegate.precision import aot_precision
from onecopy.delegate.targets import COMPUTE_UNITS, TARGETS, host_cpu_target
from onecopy.errors import InvalidArgument
from onecopy.runtime.backend_options import DEFAULT_PRECISION, PRECISIONS
from onecopy.export.rewrites import DEFAULT_REWRITES, REWRITES

__all__ = ["CompileSpec", "DELEGATES"]

# Engines a program can carry: IREE runs every method; OpenVINO is an alternative for methods IREE runs whole.
DELEGATES = ("iree", "openvino")


@dataclass(frozen=True)
class CompileSpec:
    """
    Args:
        packaging: "mlir" (portable MLIR bytecode, compiled for the local machine on load) or "vmfb" (compiled
            now, once per target).
        compute_units: "cpu", "gpu" or "all" (best available); can be overridden at load.
        targets: for "vmfb" only: which targets to compile for, e.g. ("x86_64", "aarch64"). Default: this
            machine's CPU.
        check_compiles: for "mlir": compile each module at export as its first load will (this machine's CPU,
            the same flags), so that an op IREE cannot compile fails the export, naming it, instead of the first
            load (or runs on a registered host kernel). On by default; off only to save a compile where the
            program is known to compile (`vmfb` always compiles at export).
        rewrites: graph rewrites applied to each method before lowering (onecopy.export.rewrites), in order:
            "space_to_depth" (a strided convolution over few channels, an image's stem, as a stride-1
            convolution over the image's blocks stacked on channels), "depthwise_nhwc" (depthwise convolutions as
            channels-last multiply-adds), "max_pool_nhwc" (max pooling as the maximum of shifted channels-last
            views), "split_softmax" (a softmax, attention's too, as max, sum of exponentials and a scale by the
            reciprocal), "stem_nhwc" (asked for by name: an image network's stem convolution as
            a channels-last matmul, its max pooling channels-last; faster at B=1 in fp32, slower at B=8 or in
            bf16). `rewrites=()` turns them off.
        delegates: which engines the program carries for each method: "iree" (always, first) and "openvino" (an
            alternative OpenVINO IR of each method that IREE runs whole, over the same weights store; needs
            `pip install 'onecopy[openvino]'` at export, and at a load with `prefer="latency"`). With "openvino",
            eval-mode batch norms are folded into their convolutions for both delegates, so both read one copy of
            the same weights.
        precisions: for "vmfb" only: the precisions each target's code is compiled in, "fp32" (always, first)
            and "bf16" (contractions on bf16 inputs, f32 accumulation; compiled for a CPU baseline with native
            bf16, e.g. x86-64-v4 + AVX512-BF16, so only such CPUs load it): `load_program(precision=...)` picks
            one. An "mlir" program is compiled on the device, in whatever precision a load asks for.

    Example:
        CompileSpec(packaging="vmfb", targets=("x86_64", "aarch64"), precisions=("fp32", "bf16"))
    """

    packaging: str = "mlir"
    compute_units: str = "cpu"
    targets: tuple[str, ...] = ()
    check_compiles: bool = True
    rewrites: tuple[str, ...] = DEFAULT_REWRITES
    delegates: tuple[str, ...] = ("iree",)
    precisions: tuple[str, ...] = (DEFAULT_PRECISION,)

    def __post_init__(self) -> None:
        object.__setattr__(self, "delegates", _names("delegates", "delegate", self.delegates, DELEGATES))
        if not self.delegates or self.delegates[0] != "iree" or len(set(self.delegates)) != len(self.delegates):
            raise InvalidArgument(
                f"CompileSpec.delegates {self.delegates} must start with 'iree' and name each delegate once, "
                "e.g. delegates=('iree', 'openvino')."
            )
        if type(self.check_compiles) is not bool:
            raise InvalidArgument(f"CompileSpec.check_compiles expects bool, got {type(self.check_compiles).__name__}.")
        object.__setattr__(self, "rewrites", _names("rewrites", "rewrite", self.rewrites, REWRITES))
        if self.packaging not in PACKAGINGS:
            raise InvalidArgument(f"Unsupported packaging '{self.packaging}'; expected mlir or vmfb.")
        if self.compute_units not in COMPUTE_UNITS:
            raise InvalidArgument(
                f"CompileSpec: unknown compute units '{self.compute_units}'; expected one of {', '.join(COMPUTE_UNITS)}."
            )
        object.__setattr__(self, "targets", _names("targets", "target", self.targets, TARGETS))
        if self.packaging == "mlir" and self.targets:
            raise InvalidArgument(
                "CompileSpec: targets apply to packaging='vmfb' only; an mlir program is compiled on the device."
            )
        if len(set(self.targets)) != len(self.targets):
            raise InvalidArgument(f"CompileSpec: targets {self.targets} name a target twice.")
        object.__setattr__(self, "precisions", _names("precisions", "precision", self.precisions, PRECISIONS))
        if not self.precisions or self.precisions[0] != DEFAULT_PRECISION or len(set(self.precisions)) != len(self.precisions):
            raise InvalidArgument(f"CompileSpec.precisions {self.precisions} must start with '{DEFAULT_PRECISION}' (what "
                                  "a load gets by default) and name each precision once, e.g. ('fp32', 'bf16').")
        if self.packaging == "mlir" and len(self.precisions) > 1:
            raise InvalidArgument("CompileSpec: precisions apply to packaging='vmfb' only; an mlir program is compiled "
                                  "on the device in the precision each load asks for (load_program(precision=...)).")
        if self.packaging == "vmfb":
            if not self.targets:
                object.__setattr__(self, "targets", (host_cpu_target().name,))
            for precision in self.precisions[1:]:
                cannot = [t for t in self.targets if aot_precision(t, precision) is None]
                if cannot:
                    raise InvalidArgument(f"CompileSpec: precision '{precision}' is compiled ahead of time for CPU "
                                          f"targets only (x86_64, aarch64), not {', '.join(cannot)}; drop it from "
                                          "precisions or from targets.")
            units = {TARGETS[t].compute_unit for t in self.targets}
            if self.compute_units != "all" and self.compute_units not in units:
                raise InvalidArgument(
                    f"CompileSpec: compute units '{self.compute_units}' but targets {self.targets} run on "
                    f"{', '.join(sorted(units))}; add a matching target or use compute_units='all'."
                )


def _names(field: str, kind: str, value, known) -> tuple[str, ...]:
    """A CompileSpec field that lists names from a registry: a tuple (a bare string is the usual slip), each known."""
    if isinstance(value, str):
        raise InvalidArgument(f"CompileSpec.{field} is a tuple of {kind} names; write {field}=('{value}',).")
    names = tuple(value)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise InvalidArgument(
            f"CompileSpec: unknown {kind}(s) {', '.join(map(repr, unknown))}; known: {', '.join(known)}."
        )
    return names
