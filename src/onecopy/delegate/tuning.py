"""Tuned specialization: compile a module in a few configurations, time each here, keep the fastest correct one.

No single set of compiler flags is fastest for every model on CPU (measured, see docs/DESIGN "CPU speed by model
family"): data tiling of convolutions takes a ResNet-18 from 7.6x ONNX Runtime to 2.2x but makes a pointwise
1x1 convolution 12.7x slower; the channels-last preprocessing pass helps dense 3x3 convolutions; IREE's matmul
microkernel is slower than its generated code for attention's batch matmuls on AVX-512. So when a module holds
convolutions, or batch matmuls (`plan`), specialization builds each candidate, runs every public function of it
on the same random inputs, checks the results against those of today's configuration (the reference) and keeps the
fastest: each candidate is timed side by side with the configuration kept so far, rounds alternating, and replaces
it when the median of their rounds' ratios says it is clearly faster (a VM's speed moves between windows of
seconds: timed one after the other, a 1.4x faster candidate lost). Any other module has one candidate: its first load costs what it did without tuning; a module holding
state (an LLM) is not tuned (onecopy.delegate.resolution.tunes says why).

Shapes: each function's argument types come from the bundle's MLIR signature. A dynamic dimension (`?`) takes
size 1, the B=1 (or one-token) call a device makes most; were 1 outside a symbol's range, the reference call
fails like every other and the default configuration is kept.

Budget: the whole tuning stays within `BUDGET_FACTOR` times a plain specialization (the default candidate's
compile and encode): before each further candidate, the cost of the costliest build so far plus its timing run
must still fit, else the remaining candidates are recorded as skipped.

The choice and every candidate's figures (`Tuning.record()`) are stored in the cache entry: tuning is paid once
per machine, a restore reads what was chosen and tunes nothing.
"""

from __future__ import annotations

import logging
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onecopy.delegate.conv_tiles import CONV_DATA_TILING_FLAG, DATA_TILED_OPS
from onecopy.delegate.transpose_tiles import CHANNELS_LAST_FLAG
from onecopy.errors import DelegateError

__all__ = ["BATCH_MATMULS", "BUDGET_FACTOR", "CANDIDATES", "CHANNELS_LAST", "CHANNELS_LAST_DATA_TILING",
           "CHANNELS_LAST_PAD_FUSION", "CHANNELS_LAST_PAD_FUSION_NO_UKERNELS", "CONV_DATA_TILING", "DEEP_CHANNELS",
           "DEFAULT", "NO_UKERNELS",
           "ONE_CONFIGURATION", "RTOL", "RTOL_BY_PRECISION", "Build", "Candidate", "Runner", "Signature",
           "Tuning", "candidates", "deep_convolution_share", "has_batch_matmul", "has_convolution",
           "has_depthwise_nhwc", "plan", "signatures", "tune", "with_fp32"]

log = logging.getLogger("onecopy")

BUDGET_FACTOR = 3.0
RTOL = 1e-3  # candidates reorder floating-point sums (tiles, layouts); results agree to ~1e-5 relative here
# In bf16 a reordered f32 sum can round the next layer's bf16 input the other way (a step of 2^-8 relative), and
# such flips compound through the layers; a wrong candidate (bad layout, wrong tile) is off by the whole scale.
RTOL_BY_PRECISION = {"fp32": RTOL, "bf16": 3e-2}
_MIN_RUNS, _MAX_RUNS = 3, 50
# A candidate replaces the one kept only when clearly faster: timings on a busy machine wander by a few percent.
_MIN_GAIN = 0.03


@dataclass(frozen=True)
class Candidate:
    """A compiler configuration: today's flags plus `flags`, in the specialization's precision, or in
    `precision` when set (`in_fp32`)."""

    name: str
    flags: tuple[str, ...] = ()
    precision: str | None = None

    def in_fp32(self) -> "Candidate":
        return Candidate(f"{self.name} in fp32", self.flags, "fp32")


DEFAULT = Candidate("default")
ONE_CONFIGURATION = "no convolution: one configuration"  # why a module is not tuned
BATCH_MATMULS = "batch matmuls and no convolution: tried no-ukernels"  # why one without convolutions is
# Its compile also distributes the input image's NCHW -> NHWC transposes over whole rows
# (onecopy.delegate.transpose_tiles, keyed on this flag).
CHANNELS_LAST = Candidate("channels-last", (CHANNELS_LAST_FLAG,))
# The flag names the op families data tiling annotates, and naming replaces its default set {matmul, scaled_matmul}:
# `=convolution` alone left every matmul (1x1 convolutions in channels-last, the classifier) without data tiling,
# on IREE's generic matmul code (a 49x4608 by 4608x512 matmul took 7.9 ms instead of 2.4). All three families:
# ResNet-18 (space_to_depth stem) in channels-last + conv data tiling, Xeon: B=1 24.6 -> 24.1 ms (its matmuls are
# small: 1x1 downsampling convolutions and the classifier), B=8 unchanged.
# With convolutions among them, the compile also sets the vector tiles of convolutions over narrow rows
# (onecopy.delegate.conv_tiles, keyed on CONV_DATA_TILING_FLAG).
CONV_DATA_TILING = Candidate("conv-data-tiling", (f"{DATA_TILED_OPS}=matmul", f"{DATA_TILED_OPS}=scaled_matmul",
                                                  CONV_DATA_TILING_FLAG))
CHANNELS_LAST_DATA_TILING = Candidate("channels-last+conv-data-tiling", CHANNELS_LAST.flags + CONV_DATA_TILING.flags)
# Channels-last with each padding fused into the operation reading it: no dispatch copying a padded activation into a
# larger buffer (IREE's `slow_memcpy`), at the cost of bounds checks in the reader's loads. Pays where pads feed
# depthwise convolutions (the depthwise_nhwc rewrite pads in NHWC), costs where they feed dense ones. Measured on a
# Xeon (AVX-512), iree-benchmark-module, ms a call:
#                                   channels-last  +pad-fusion
#   MobileNetV3-small B=1               3.13          2.94
#   MobileNetV3-small B=8               16.6          15.1      (copies 1.43 ms gone, convolutions 1.0 ms slower)
#   ResNet-18 B=1                       44.9          49.5
# With conv data tiling it does not compile (a dispatch needs more than IREE's 32 KB of stack).
CHANNELS_LAST_PAD_FUSION = Candidate("channels-last+pad-fusion", CHANNELS_LAST.flags + (
    "--iree-dispatch-creation-enable-fuse-padding-into-linalg-consumer-ops",))
# Data-tiled matmuls as IREE's generated code instead of its mmt4d microkernel (the default flags name `all`
# microkernels; the last flag given wins). Which is faster depends on the CPU and the shapes: the microkernels were
# measured faster on an AVX2 CPU, while on a Xeon with AVX-512 the generated code ran attention's batch matmuls
# (activations on both sides, packed at every call) 1.4x faster. Measured there, through onecopy, interleaved:
#                                                       default   no-ukernels
#   transformer encoder (4 layers, d=256, T=128) B=1     5.72 ms    5.27
#   the same at B=16                                    94.5       86.4
#   the built-in MLP (8 x Linear(1024)), B=1 / B=16      1.14/2.92  1.12/2.89 (not tuned: no batch matmul)
# A module with convolutions does not try it alone: conv data tiling lost to the default configuration without them
# (ResNet-18 B=1 21.9 -> 90 ms); channels-last+pad-fusion+no-ukernels below is its form for convolutions.
NO_UKERNELS = Candidate("no-ukernels", ("--iree-llvmcpu-enable-ukernels=none",))
# Channels-last with pad fusion, its data-tiled matmuls (MobileNet's 1x1 convolutions, the classifier) as IREE's
# generated code, as no-ukernels runs attention's. Not with conv data tiling, whose convolutions the microkernels
# make fast (ResNet-18 21.9 -> 90 ms without them), so a candidate of its own. Measured through onecopy, interleaved,
# one process, ms (the AVX2 row: code for haswell run on the same Xeon):
#                                   channels-last+pad-fusion   +no-ukernels
#   MobileNetV3-small B=1, AVX-512          2.81                  2.61
#   MobileNetV3-small B=8, AVX-512          17.5                  16.0
#   the same compiled for AVX2 (haswell)    3.29 / 22.0           3.13 / 20.6
# so it is tried first where the depthwise_nhwc rewrite's convolutions are (`plan`), pad fusion with microkernels
# next.
CHANNELS_LAST_PAD_FUSION_NO_UKERNELS = Candidate("channels-last+pad-fusion+no-ukernels",
                                                 CHANNELS_LAST_PAD_FUSION.flags + NO_UKERNELS.flags)
# In the order tried when dense convolutions over wide inputs do not carry most of the work (`plan` puts
# channels-last+conv-data-tiling first when they do). The budget often leaves room for one candidate only, so the
# order is the guess. Measured on a Xeon with AVX-512, every candidate timed (ms):
#                                       default  channels-last  cl+conv-data-tiling  conv-data-tiling
#   ResNet-18, 3x224x224                 95.2       41.4            27.2               73.0
#   MobileNetV3-small (depthwise_nhwc)    3.05       2.52            4.17               4.43
#   3 dense 3x3 convs (32 ch) + 1x1, 64x64 1.59      0.78            1.08               1.29
#   3 ResNet-50 bottlenecks (64/256 ch), 56x56 16.6   8.87            9.26              22.2
#   two 1x1 convs (64/128 ch), 56x56      0.77       0.85            0.94               2.74
# Conv data tiling pays where the convolutions are deep (ResNet-18's 128-512 channel 3x3 convs at 28x28 to 7x7, its
# micro kernel's tiles full) and costs where they are wide and shallow, or pointwise (a 1x1 conv 12.7x slower alone).
CANDIDATES: tuple[Candidate, ...] = (DEFAULT, CHANNELS_LAST, CHANNELS_LAST_DATA_TILING, CONV_DATA_TILING,
                                     CHANNELS_LAST_PAD_FUSION, CHANNELS_LAST_PAD_FUSION_NO_UKERNELS)
# Dense (kernel > 1x1, not depthwise) convolutions reading at least this many channels a group are "deep" here.
DEEP_CHANNELS = 128

# Operation names as they appear in a bundle (torch dialect from export; linalg where an op is lowered further, as
# the depthwise_nhwc rewrite's op is). MLIR bytecode stores each operation name as a plain string without its
# dialect ("aten.convolution" of dialect torch, "depthwise_conv_2d_nhwc_hwc" of linalg), so a byte search finds them
# in bytecode and text alike without parsing the module (~0.2 s).
_CONVOLUTION_OPS = (b"aten.convolution", b"conv_1d", b"conv_2d", b"conv_3d")


def has_convolution(source: bytes | memoryview) -> bool:
    data = bytes(source)
    return any(op in data for op in _CONVOLUTION_OPS)


# Batch matmuls as torch.export's core ATen writes attention (scaled_dot_product_attention's math, a matmul of
# 3-d or more operands): activations on both sides, found as has_convolution finds convolutions.
_BATCH_MATMUL_OPS = (b"aten.bmm", b"aten.baddbmm")


def has_batch_matmul(source: bytes | memoryview) -> bool:
    data = bytes(source)
    return any(op in data for op in _BATCH_MATMUL_OPS)


def has_depthwise_nhwc(source: bytes | memoryview) -> bool:
    """Whether the bundle holds the depthwise_nhwc rewrite's convolutions (linalg's, found as has_convolution finds
    them)."""
    return b"depthwise_conv_2d_nhwc" in bytes(source)


def candidates(source: bytes | memoryview) -> list[Candidate]:
    """The configurations worth trying for `source`, in the order tried: see `plan`."""
    return plan(source)[0]


def plan(source: bytes | memoryview) -> tuple[list[Candidate], str]:
    """The configurations worth trying for `source`, in the order tried, and why that order. Every candidate
    when it holds a convolution (what the candidates change), else the default and no-ukernels where batch
    matmuls are (attention), else the default alone; right after the default,
    channels-last+conv-data-tiling when deep dense convolutions carry at least half of the multiply-adds
    (`deep_convolution_share`), else channels-last+pad-fusion (without microkernels, then with them) when the
    depthwise_nhwc rewrite's convolutions are there (`has_depthwise_nhwc`)."""
    if not has_convolution(source):
        if has_batch_matmul(source):
            return [DEFAULT, NO_UKERNELS], BATCH_MATMULS
        return [DEFAULT], ONE_CONFIGURATION
    share = deep_convolution_share(source)
    first, rest = CANDIDATES[0], list(CANDIDATES[1:])
    leads = ((CHANNELS_LAST_DATA_TILING,) if share >= 0.5 else
             (CHANNELS_LAST_PAD_FUSION_NO_UKERNELS, CHANNELS_LAST_PAD_FUSION) if has_depthwise_nhwc(source) else ())
    rank = {c.name: i for i, c in enumerate(leads)}
    rest.sort(key=lambda c: rank.get(c.name, len(leads)))  # stable: the others keep their order
    depthwise = " and depthwise_nhwc convolutions" if CHANNELS_LAST_PAD_FUSION in leads else ""
    return [first, *rest], (f"{share:.0%} of the multiply-adds in dense convolutions over >= {DEEP_CHANNELS} "
                            f"channels{depthwise}: tried {rest[0].name} first" if rest else "")


def with_fp32(options: list[Candidate], precision: str) -> list[Candidate]:
    """`options` for a specialization in `precision`, with the lead candidate (the first after the default) also
    tried in fp32, second, when `precision` is not fp32 and there is something to choose between.

    precision="bf16" allows bf16, for speed: where the CPU's bf16 dot products are no faster than its fp32 FMAs
    (a Xeon with AMX, Sapphire Rapids class: VDPBF16PS issues on one port, FMA on two, and IREE has no AMX
    kernels), the demotions, im2col in bf16 and the packing of bf16 activations are pure cost. Measured there,
    ResNet-18 B=1: fp32 tuned 22.7 ms, bf16 tuned 50.5 ms (its 49x4608 @ 4608x512 matmuls 4.0 ms against 1.5 in
    fp32, each activation's demotion and packing a dispatch of its own); MobileNetV3-small 3.3 vs 5.9 ms. Where
    bf16 pays (the built-in MLP here: B=1 1.05 -> 0.88 ms, memory-bound; Zen 4's 2x faster bf16 dot products)
    the bf16 candidates win the timing, as before. Second, not last: the budget often leaves room for two."""
    if precision == "fp32" or len(options) < 2:
        return options
    return [options[0], options[1].in_fp32(), *options[1:]]


_MATMULS = {"torch.aten.mm": 0, "torch.aten.bmm": 0, "torch.aten.matmul": 0, "torch.aten.addmm": 1,
            "torch.aten.linear": 0}


def deep_convolution_share(source: bytes | memoryview) -> float:
    """The share of the module's multiply-adds (torch-dialect convolutions and matmuls, dynamic dimensions as 1)
    in dense convolutions over at least DEEP_CHANNELS input channels a group. 0.0 for a bundle that does not
    parse or has no such ops."""
    try:
        module = _parsed(source)
    except ValueError:
        return 0.0
    deep = total = 0

    def shape(value: Any) -> tuple[int, ...] | None:
        try:
            dims = _argument(str(value.type))[0]
        except ValueError:
            return None
        return tuple(1 if d is None else d for d in dims)

    def visit(op: Any) -> None:
        nonlocal deep, total
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    inner = inner.operation
                    name = inner.name
                    if name == "torch.aten.convolution" and len(inner.operands) > 1 and inner.results:
                        weight, out = shape(inner.operands[1]), shape(inner.results[0])
                        if weight and out and len(weight) == 4 and len(out) == 4:
                            macs = int(np.prod(out)) * weight[1] * weight[2] * weight[3]
                            total += macs
                            if weight[2] * weight[3] > 1 and weight[1] >= DEEP_CHANNELS:
                                deep += macs
                    elif name in _MATMULS and len(inner.operands) > _MATMULS[name] and inner.results:
                        left, out = shape(inner.operands[_MATMULS[name]]), shape(inner.results[0])
                        if left and out:
                            total += int(np.prod(out)) * left[-1]
                    visit(inner)

    visit(module.operation)
    return deep / total if total else 0.0


@dataclass(frozen=True)
class Signature:
    """A public function of the module: its arguments (shape with `None` where dynamic, numpy dtype) and results."""

    name: str
    arguments: tuple[tuple[tuple[int | None, ...], str], ...]
    results: int


_TENSOR = re.compile(r"^!torch\.vtensor<\[([^\]]*)\],(\w+)>$|^tensor<((?:[0-9?]+x)*)(\w+)>$")
_DTYPES = {"f32": "float32", "f64": "float64", "f16": "float16", "si64": "int64", "si32": "int32", "i64": "int64",
           "i32": "int32", "si8": "int8", "ui8": "uint8", "i8": "int8", "i1": "bool"}


def _argument(text: str) -> tuple[tuple[int | None, ...], str]:
    found = _TENSOR.match(text.strip())
    if found is None:
        raise ValueError(f"argument type {text} is not a tensor")
    dims, element = (found.group(1), found.group(2)) if found.group(2) else (found.group(3).rstrip("x"), found.group(4))
    if element not in _DTYPES:
        raise ValueError(f"element type {element} has no numpy equivalent")
    sep = "," if found.group(2) else "x"
    shape = tuple(None if d.strip() == "?" else int(d) for d in dims.split(sep) if d.strip())
    return shape, _DTYPES[element]


def _parsed(source: bytes | memoryview) -> Any:
    """An MLIR bundle (bytecode or text) as a module. Raises ValueError when it does not parse."""
    from iree.compiler import ir

    context = ir.Context()
    context.allow_unregistered_dialects = True  # the torch dialect is not registered in the compiler's Python API
    try:
        return ir.Module.parse(bytes(source), context)
    except ir.MLIRError as e:
        raise ValueError(f"the bundle does not parse: {e}") from e


def signatures(source: bytes | memoryview) -> list[Signature]:
    """The public functions of an MLIR bundle (bytecode or text) and their argument types. Raises ValueError when
    it does not parse or an argument is not a tensor numpy can make."""
    from iree.compiler import ir

    module = _parsed(source)
    found = []
    for op in module.body.operations:
        op = op.operation
        if op.name != "func.func" or "sym_visibility" in op.attributes:
            continue
        kind = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        name = ir.StringAttr(op.attributes["sym_name"]).value
        found.append(Signature(name, tuple(_argument(str(t)) for t in kind.inputs), len(kind.results)))
    return found


def example_inputs(signature: Signature, rng: np.random.Generator) -> list[np.ndarray]:
    """Random inputs of `signature`'s shapes (dynamic dimensions: 1); integers small, so that indices stay valid."""
    arrays = []
    for shape, dtype in signature.arguments:
        concrete = tuple(1 if d is None else d for d in shape)
        if np.issubdtype(np.dtype(dtype), np.floating):
            arrays.append(rng.standard_normal(concrete).astype(dtype))
        elif dtype == "bool":
            arrays.append(rng.integers(0, 2, concrete).astype(bool))
        else:
            arrays.append(rng.integers(0, 4, concrete).astype(dtype))
    return arrays


@dataclass
class Trial:
    """One candidate's figures: its build time, its latency (every function once, fastest run), or why not."""

    candidate: Candidate
    build_s: float | None = None
    latency_ms: float | None = None
    error: str | None = None
    ratio: float | None = None  # over the configuration kept when it was timed, side by side (`_time_against`)

    def record(self) -> dict[str, Any]:
        return {"name": self.candidate.name, "flags": list(self.candidate.flags), "build_s": self.build_s,
                "latency_ms": self.latency_ms, "error": self.error,
                **({"ratio_to_kept": self.ratio} if self.ratio is not None else {}),
                **({"precision": self.candidate.precision} if self.candidate.precision else {})}


@dataclass
class Tuning:
    """What tuning decided, as stored in the cache entry (`record()`)."""

    chosen: Candidate
    trials: list[Trial] = field(default_factory=list)
    elapsed_s: float = 0.0
    budget_s: float | None = None
    note: str = ""
    precision: str = "fp32"  # the specialization's: the reference's, and every candidate's but `in_fp32` ones
    order: str = ""  # why the candidates were tried in their order (`plan`)

    def record(self) -> dict[str, Any]:
        return {"chosen": self.chosen.name, "flags": list(self.chosen.flags), "precision": self.precision,
                "chosen_precision": self.chosen.precision or self.precision,
                "elapsed_s": round(self.elapsed_s, 3),
                "budget_s": None if self.budget_s is None else round(self.budget_s, 3), "note": self.note,
                "order": self.order,
                "candidates": [t.record() for t in self.trials]}


# build(candidate) -> (what specialization keeps, a runner): the runner calls a function by name on arrays and
# returns its results. Raises DelegateError when the candidate does not compile (or encode).
Runner = Callable[[str, list[np.ndarray], int], list[np.ndarray]]
Build = Callable[[Candidate], tuple[Any, Runner]]


def _time(runner: Runner, calls: list[tuple[Signature, list[np.ndarray]]], budget_s: float) -> tuple[list, float]:
    """Outputs of every call, and the fastest of the runs (each runs them all) that fit `budget_s`: the machine's
    other work only ever adds time, so the fastest run is the fairest comparison between configurations (under
    load the median picked the default once in three over a candidate 1.3x faster)."""
    outputs = [runner(s.name, arrays, s.results) for s, arrays in calls]  # also the warm-up run
    runs: list[float] = []
    spent = 0.0
    while len(runs) < _MIN_RUNS or (len(runs) < _MAX_RUNS and spent < budget_s):
        started = time.perf_counter()
        for s, arrays in calls:
            runner(s.name, arrays, s.results)
        runs.append(time.perf_counter() - started)
        spent += runs[-1]
    return outputs, min(runs)


def _time_against(kept: Runner, candidate: Runner, calls: list[tuple[Signature, list[np.ndarray]]],
                  budget_s: float) -> tuple[list, float, float]:
    """The candidate's outputs, its fastest run, and the median over rounds of its run's time over the kept
    configuration's in the same round. Each round runs both, their order alternating, until at least _MIN_RUNS
    rounds ran and `budget_s` is spent (_MAX_RUNS at most). Timed side by side because this machine's speed moves
    between windows of seconds: on a 2-vCPU VM (AMD EPYC) MobileNetV3-small's tuned code read 10.9 ms in one
    specialization and 19.2 in another of the same process, nothing else running, and timed alone after the
    default (15.7 ms, read earlier), it lost to it."""
    outputs = [candidate(s.name, arrays, s.results) for s, arrays in calls]  # also its warm-up run
    for s, arrays in calls:  # the kept one's caches went cold while the candidate was built
        kept(s.name, arrays, s.results)
    ratios: list[float] = []
    fastest = math.inf
    spent = 0.0
    while len(ratios) < _MIN_RUNS or (len(ratios) < _MAX_RUNS and spent < budget_s):
        times = {}
        for name, runner in ((("kept", kept), ("candidate", candidate)) if len(ratios) % 2 == 0
                             else (("candidate", candidate), ("kept", kept))):
            started = time.perf_counter()
            for s, arrays in calls:
                runner(s.name, arrays, s.results)
            times[name] = time.perf_counter() - started
        ratios.append(times["candidate"] / times["kept"])
        fastest = min(fastest, times["candidate"])
        spent += times["candidate"] + times["kept"]
    return outputs, fastest, statistics.median(ratios)


def _agrees(outputs: list[list[np.ndarray]], reference: list[list[np.ndarray]], rtol: float = RTOL) -> str | None:
    """None when every result matches the reference's to `rtol` of its scale, else where it does not."""
    for i, (got, want) in enumerate(zip(outputs, reference)):
        if len(got) != len(want):
            return f"call {i} returned {len(got)} results, the reference {len(want)}"
        for j, (a, b) in enumerate(zip(got, want)):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                return f"result {j} of call {i} has shape {a.shape}, the reference {b.shape}"
            if a.dtype.kind in "fc":
                scale = float(np.max(np.abs(b))) if b.size else 0.0
                error = float(np.max(np.abs(a - b))) if a.size else 0.0
                if not np.isfinite(error) or error > rtol * max(scale, 1e-6):
                    return f"result {j} of call {i} differs by {error:.3g} (scale {scale:.3g})"
            elif not np.array_equal(a, b):
                return f"result {j} of call {i} differs"
    return None


def tune(source: bytes | memoryview | None, build: Build, where: str, *,
         options: list[Candidate] | None = None, precision: str = "fp32", order: str = "",
         release: Callable[[Any], None] | None = None, functions: list[Signature] | None = None,
         timing_s: float | None = None, budget_s: float | None = None) -> tuple[Any, Tuning]:
    """Build `source` in each candidate configuration (`options` in their order, default `plan(source)`), keep
    the fastest whose results agree with the default's. `precision`: what `build` compiles every candidate in
    unless the candidate names its own (the default does not, so the reference is in it); it sets the tolerance
    (RTOL_BY_PRECISION). `order`: why the options are in their order, for the record. `release(made)` is called
    on what `build` made for a candidate as soon as it is out of the running, so that no more than two
    candidates' code and encoded weights are held at once (an LLM's weights are its size again per candidate).
    `functions`: what is timed (default: the signatures of `source`'s public functions). Each candidate is timed
    for `timing_s` (default a tenth of the default's build), all of it bounded by `budget_s` (default
    BUDGET_FACTOR times that build): a choice between codes compiled ahead of time (a `vmfb` program's precisions)
    builds in a fraction of a second and needs times of its own.
    Returns what `build` made for the chosen one, and the tuning."""
    drop = release or (lambda made: None)
    started = time.perf_counter()
    if options is None:
        assert source is not None, "tune: options are planned from the source"
        options, order = plan(source)
    first, rest = options[0], options[1:]
    kept, runner = build(first)  # a failure here is the specialization's own: let it raise
    plain_s = time.perf_counter() - started
    tuning = Tuning(first, [Trial(first, build_s=round(plain_s, 3))], precision=precision, order=order)
    if not rest:
        tuning.note = ONE_CONFIGURATION
        tuning.elapsed_s = plain_s
        return kept, tuning
    budget = BUDGET_FACTOR * plain_s if budget_s is None else budget_s
    timing = 0.1 * plain_s if timing_s is None else timing_s
    tuning.budget_s = budget if math.isfinite(budget) else None  # unbounded: nothing to show
    try:
        sigs = functions if functions is not None else signatures(source)  # type: ignore[arg-type]
        rng = np.random.default_rng(0)
        calls = [(s, example_inputs(s, rng)) for s in sigs]
        reference, seconds = _time(runner, calls, timing)
    except (ValueError, RuntimeError, DelegateError) as e:
        tuning.note = f"kept the default: its functions could not be run on example inputs ({e})"
        tuning.elapsed_s = time.perf_counter() - started
        log.info("%s: tuning skipped: %s", where, tuning.note)
        return kept, tuning
    tuning.trials[0].latency_ms = round(seconds * 1e3, 4)
    best, best_run, costliest = kept, runner, plain_s
    for candidate in rest:
        trial = Trial(candidate)
        tuning.trials.append(trial)
        elapsed = time.perf_counter() - started
        if elapsed + costliest + timing > budget:
            trial.error = "skipped: the tuning budget was spent"
            continue
        built = time.perf_counter()
        try:
            made, run = build(candidate)
        except DelegateError as e:
            trial.error = f"does not compile: {e}"
            continue
        finally:
            trial.build_s = round(time.perf_counter() - built, 3)
            costliest = max(costliest, trial.build_s)
        try:
            outputs, seconds, ratio = _time_against(best_run, run, calls, timing)
        except (ValueError, RuntimeError, DelegateError) as e:
            trial.error = f"does not run: {e}"
            drop(made)
            continue
        trial.latency_ms, trial.ratio = round(seconds * 1e3, 4), round(ratio, 4)
        wrong = _agrees(outputs, reference, RTOL_BY_PRECISION[precision])
        if wrong is not None:
            trial.error = f"wrong answer: {wrong}"
            drop(made)
            continue
        if ratio < 1 - _MIN_GAIN:
            drop(best)
            best, best_run, tuning.chosen = made, run, candidate
        else:
            drop(made)
    tuning.elapsed_s = time.perf_counter() - started
    log.info("%s: tuned in %.1f s (budget %.1f s): chose %s (%s)", where, tuning.elapsed_s, budget,
             tuning.chosen.name, ", ".join(f"{t.candidate.name} {t.latency_ms} ms" if t.latency_ms is not None
                                            else f"{t.candidate.name} {t.error}" for t in tuning.trials))
    return best, tuning
