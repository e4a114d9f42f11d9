"""The manifest of an IREE delegate: what it runs and where its bundle lives in the program's named data.

Example (a portable delegate of a single-function module):

    {"version": 1, "packaging": "mlir", "export_hash": "9f2c…", "bundle": {"portable": "bundle/9f2c….mlirbc"},
     "function": "main", "input_names": ["x"], "output_names": ["relu_7"], "compute_units": "cpu",
     "parameters": {"l_0_weight": "param/3a1e…"}}

`outputs_in_place: true` marks a destination-passing `function` (outputs as trailing arguments, written in
place), exported for caller-provided outputs. `bundle` has one key per target for `vmfb` packaging (`{"x86_64": …, "aarch64": …}`) and the single key
`portable` for `mlir`. `parameters` maps each engine parameter name (scope `model`) to its named data key.

A `vmfb` program compiled in more precisions than fp32 (`CompileSpec(precisions=...)`) holds each target's code in
each: key `x86_64` is the fp32 code, `x86_64@bf16` the bf16 code (`bundle_key`). A reader that knows no precisions
sees a key that names no target and ignores it.

`encoders` (optional, `vmfb` only; absent means none) maps a target of `bundle` to the named data key of that
target's parameter encoder: a small `.vmfb` compiled at export beside the data-tiled bundle. The bundle then reads
its packed weights from the parameter scope `encoded`; the loader runs the encoder once per machine and caches its
output (see `onecopy.delegate.specialize`). A target without an encoder (not a CPU, data tiling fell back, or an
older program) packs nothing ahead of time.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgspec
import numpy as np

from onecopy.errors import DelegateError
from onecopy.runtime.backend_options import DEFAULT_PRECISION, PRECISIONS

__all__ = ["BACKEND", "MANIFEST_VERSION", "bundle_key", "split_bundle_key", "PACKAGINGS", "PORTABLE", "PARAMETER_SCOPE", "READ_STATES", "RESET_STATES",
           "STATE_FUNCTIONS", "WRITE_STATES", "FunctionSignature", "Manifest", "StateEntry", "parse_manifest",
           "missing_named_data"]

BACKEND = "IreeBackend"  # the backend that reads these manifests: `DelegateDef.backend`
MANIFEST_VERSION = 1
PACKAGINGS = ("mlir", "vmfb")
PORTABLE = "portable"  # the bundle key of an `mlir` delegate
PARAMETER_SCOPE = "model"
# The functions a module holding state exports beside its methods (onecopy.export.state), which the host calls to
# read, write and reset its states (onecopy.delegate.state).
READ_STATES, WRITE_STATES, RESET_STATES = "onecopy_read_states", "onecopy_write_states", "onecopy_reset_states"
STATE_FUNCTIONS = (READ_STATES, WRITE_STATES, RESET_STATES)


class StateEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A program state held by the module as a mutable global (see onecopy.export.state): served as a zero splat
    of `nbytes` under `parameter` (scope `model`); `initial` names the parameter its reset copies in (absent:
    zeros). Read, written and reset, all states of the module at once in the order of the manifest's list, by its
    functions `onecopy_read_states`, `onecopy_write_states` and `onecopy_reset_states`."""

    name: str
    parameter: str
    shape: list[int]
    dtype: str
    nbytes: int
    initial: str | None = None


class FunctionSignature(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A public function of a vmfb module: its arguments (shape, None where dynamic; numpy dtype) and how many
    results it returns. What a load needs to call it on example inputs (timing its executors) without the MLIR
    the code was compiled from."""

    arguments: list[tuple[list[int | None], str]]
    results: int


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    version: int
    packaging: str
    export_hash: str
    bundle: dict[str, str]
    function: str
    input_names: list[str]
    output_names: list[str]
    compute_units: str
    # Per result, its numpy dtype as torch.export recorded it: IREE's integer buffers carry no sign (a uint8 result
    # comes back as i8), so the runtime reads them as these. Empty in programs written before it was recorded.
    output_dtypes: list[str] = []
    parameters: dict[str, str] = {}
    multifunction: bool = False
    # `function` is destination-passing: it takes its outputs' storage as trailing arguments and writes them in
    # place (so a bound surface is written by the engine itself); its return value is a 0-d placeholder.
    outputs_in_place: bool = False
    # target name (a key of `bundle`) -> named data key of its parameter encoder (vmfb only).
    encoders: dict[str, str] = {}
    # Program states the module holds (every function of a module sees the same list).
    states: list[StateEntry] = []
    # Every public function of the module (vmfb only): name -> its signature (see FunctionSignature).
    signatures: dict[str, FunctionSignature] = {}

    def to_dict(self) -> dict[str, Any]:
        """The manifest as a program header stores it (`DelegateDef.manifest`, read back by `parse_manifest`):
        fields at their default are left out, so a program file names only what its delegate uses."""
        return msgspec.to_builtins(self)


def bundle_key(target: str, precision: str = DEFAULT_PRECISION) -> str:
    """The `bundle` and `encoders` key of `target`'s vmfb code in `precision`."""
    return target if precision == DEFAULT_PRECISION else f"{target}@{precision}"


def split_bundle_key(key: str) -> tuple[str, str]:
    """(target, precision) of a vmfb `bundle` key."""
    target, _, precision = key.partition("@")
    return target, precision or DEFAULT_PRECISION


def parse_manifest(raw: Mapping[str, Any], where: str) -> Manifest:
    """Validate a manifest read from a program. Every problem is a `DelegateError` naming `where` and the field."""
    if not isinstance(raw, Mapping):
        raise DelegateError(f"{where}: the manifest is not a mapping. Re-export the program.")
    packaging = raw.get("packaging")
    if isinstance(packaging, str) and packaging not in PACKAGINGS:
        raise DelegateError(f"{where}: Unsupported packaging '{packaging}'; expected mlir or vmfb. Re-export the program.")
    try:
        manifest = msgspec.convert(dict(raw), Manifest, strict=True)
    except msgspec.ValidationError as e:
        field = str(e)
        raise DelegateError(f"{where}: invalid manifest: {field}. Re-export the program.") from e
    if manifest.version > MANIFEST_VERSION:
        raise DelegateError(
            f"{where}: manifest version {manifest.version} is newer than this onecopy reads ({MANIFEST_VERSION}); "
            "upgrade onecopy."
        )
    if manifest.packaging == "mlir" and set(manifest.bundle) != {PORTABLE}:
        raise DelegateError(f"{where}: an mlir manifest needs exactly the bundle key '{PORTABLE}'. Re-export the program.")
    if not manifest.bundle:
        raise DelegateError(f"{where}: the manifest names no bundle. Re-export the program.")
    odd = [key for key in manifest.bundle if split_bundle_key(key)[1] not in PRECISIONS]
    if manifest.packaging == "vmfb" and odd:
        raise DelegateError(f"{where}: bundle key(s) {', '.join(odd)} name an unknown precision (known: "
                            f"{', '.join(PRECISIONS)}). Re-export the program.")
    if manifest.signatures and manifest.packaging != "vmfb":
        raise DelegateError(f"{where}: field `signatures` applies to vmfb manifests only, this one is "
                            f"{manifest.packaging}. Re-export the program.")
    if manifest.encoders and manifest.packaging != "vmfb":
        raise DelegateError(f"{where}: field `encoders` applies to vmfb manifests only, this one is {manifest.packaging}. "
                            "Re-export the program.")
    for state in manifest.states:
        try:
            itemsize = np.dtype(state.dtype).itemsize
        except TypeError:
            raise DelegateError(f"{where}: state '{state.name}' has unknown dtype '{state.dtype}'. Re-export the program.") from None
        if state.nbytes != int(np.prod(state.shape, dtype=np.int64)) * itemsize or min(state.shape, default=0) < 0:
            raise DelegateError(
                f"{where}: state '{state.name}' says {state.nbytes} bytes, but {state.dtype}{state.shape} takes "
                f"{int(np.prod(state.shape, dtype=np.int64)) * itemsize}. Re-export the program."
            )
    strays = sorted(set(manifest.encoders) - set(manifest.bundle))
    if strays:
        raise DelegateError(
            f"{where}: field `encoders` names target(s) {', '.join(strays)} that `bundle` has no code for "
            f"(it has {', '.join(sorted(manifest.bundle))}). Re-export the program."
        )
    return manifest


def missing_named_data(manifest: Manifest, keys: Collection[str]) -> list[str]:
    """The manifest's references to named data (bundles, parameters, encoders) that `keys` lacks, one sentence
    each: what a load would fail on only once it reached that key."""
    wanted = [(f"bundle '{target}'", key) for target, key in manifest.bundle.items()]
    wanted += [(f"parameter '{name}'", key) for name, key in manifest.parameters.items()]
    wanted += [(f"parameter encoder for {target}", key) for target, key in manifest.encoders.items()]
    return [f"{what} names named data '{key}', which the program does not hold" for what, key in wanted
            if key not in keys]
