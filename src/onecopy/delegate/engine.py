"""The engine adapter: everything that touches IREE's compiler and runtime lives here.

Thread-safety: the VM instance and HAL devices are process-wide and safe to share. A `LoadedModel` (code module,
parameters) is immutable and safe to share; each call runs in a VM context checked out for that call alone.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from logging import DEBUG
from pathlib import Path
from typing import Any

import numpy as np

from onecopy.delegate import caller_wait, quarantine
from onecopy.delegate.binding import SurfaceBinding
from onecopy.delegate.cpus import worker_count
from onecopy.delegate.manifest import PARAMETER_SCOPE
from onecopy.delegate.targets import Target
from onecopy.errors import DelegateError, ExecutionError
from onecopy.runtime.backend import RunReport
from onecopy.runtime.copy_stats import CopyStats

__all__ = [
    "compiler_version", "runtime_version", "vm_instance", "hal_device", "parameter_provider",
    "LoadedModel", "EngineFunction", "dense",
]

log = logging.getLogger("onecopy")

ENCODED_SCOPE = "encoded"  # parameters encoded (packed) for this machine at specialization

_lock = threading.Lock()
_instance: Any = None
_devices: dict[str, Any] = {}


@functools.lru_cache(maxsize=1)
def compiler_version() -> str:
    """The IREE compiler's version, read from its version file without importing the compiler: that import costs
    ~30 ms, which a warm load (a cache restore) must not pay."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("iree.compiler")
    if spec is None or spec.origin is None:
        raise DelegateError("The IREE compiler (iree-base-compiler) is not installed; it is needed to specialize mlir "
                            "programs. Install it, or load a vmfb program.")
    text = (Path(spec.origin).parent / "version.py").read_text()
    found = re.search(r"""^VERSION\s*=\s*["']([^"']+)["']""", text, re.M)
    return found.group(1) if found else hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def runtime_version() -> str:
    """The IREE runtime's version: what runs a `vmfb` program's parameter encoder at load (no compiler there)."""
    from iree.runtime.version import VERSION

    return str(VERSION)


def vm_instance() -> Any:
    import iree.runtime as ireert

    global _instance
    with _lock:
        if _instance is None:
            _instance = ireert.VmInstance()
        return _instance


# Per-worker "local memory" of IREE's task executor: scratch that a dispatch may declare (workgroup memory). IREE
# reserves the CPU's L2 size per worker by default, resident: 2 workers x 2 MiB = +4 MiB of private memory in
# every process, most of what a process adds beyond the weights it shares (4 processes on one program: 4.1x the
# anonymous memory of one). onecopy's CPU code declares none (LLVM CPU codegen keeps tiles on the stack), so it
# reserves IREE's originally intended 64 KiB; a dispatch that needed more would fail with IREE's error naming the
# amount. IREE_PY_RUNTIME_FLAGS with --task_worker_local_memory still decides, when a user sets it.
TASK_WORKER_LOCAL_MEMORY = 64 * 1024


def task_executor_flags(user_flags: str, workers: int | None = None) -> list[str]:
    """The flags onecopy gives IREE's task executor, unless the user's IREE_PY_RUNTIME_FLAGS set their own.

    Workers unpinned (`--task_topology_group_count`): IREE pins one worker to each core by default, and the
    calling thread shares those cores. Measured on 2 cores: a pinned worker whose core the caller (or anything
    else) holds waits a scheduler tick, so 15-25% of calls took 3-4 ms instead of 1.5 (builtin prefill: mean
    2.1-2.3 ms pinned, 1.5-1.7 ms unpinned; forward: 1.19-1.34 vs 0.94-1.02; benchmarks/latency.py had the same
    tails). One worker per physical core the process may run on, no more than its cgroup CPU quota
    (`onecopy.delegate.cpus`).
    """
    flags = []
    if "--task_worker_local_memory" not in user_flags:
        flags.append(f"--task_worker_local_memory={TASK_WORKER_LOCAL_MEMORY}")
    if workers is not None:  # the backend option `threads` asked for this many: it wins over the environment
        flags.append(f"--task_topology_group_count={workers}")
    elif "--task_topology" not in user_flags:
        flags.append(f"--task_topology_group_count={worker_count()}")
    else:  # the user's own, again: a device made before with `threads` left its count in IREE's global flags
        flags += [flag for flag in user_flags.split() if flag.startswith("--task_topology")]
    return flags


def _configure_task_executor(workers: int | None) -> None:
    import iree.runtime.flags as flags

    chosen = task_executor_flags(os.environ.get("IREE_PY_RUNTIME_FLAGS", ""), workers)
    if chosen:
        flags.parse_flags(*chosen)


def parameter_provider(buffers: Mapping[str, Any], scope: str, *, writable: bool = False,
                       zeros: Mapping[str, int] | None = None) -> Any:
    """An IREE parameter provider serving `buffers` (name -> buffer) under `scope`. The index keeps a reference to
    each buffer and reads (or, `writable`, writes) it in place: no copy. `zeros` (name -> bytes) are served as
    zero splats, which is what a mutable global (program state) must start from: IREE writes a mutable global
    served from a buffer into that buffer itself, shared by every context."""
    return _parameter_index(buffers, writable=writable, zeros=zeros).create_provider(scope=scope)


def _parameter_index(buffers: Mapping[str, Any], *, writable: bool = False,
                     zeros: Mapping[str, int] | None = None) -> Any:
    import iree.runtime as ireert

    index = ireert.ParameterIndex()
    for name, buffer in buffers.items():
        index.add_buffer(name, buffer, writable=writable)
    for name, nbytes in (zeros or {}).items():
        index.add_splat(name, np.zeros(1, np.uint8), nbytes)
    return index


# The CPU drivers, whose devices get a caching allocator (see hal_device).
CPU_DRIVERS = ("local-task", "local-sync")


def hal_device(driver: str, workers: int | None = None) -> Any:
    """One device per driver (and, for `local-task`, per number of task `workers` asked; None: one per physical
    core, see task_executor_flags) per process: creating a `local-task` device starts a thread pool.

    A CPU device allocates through IREE's caching allocator: the buffers a call allocates (its inputs, results
    and transients) go back to a pool when freed and serve the next call, instead of a malloc and free each.
    Measured on the built-in model, raw calls paired by round: 1.6% (B=1) to 4.7% (B=16) faster on IREE's workers,
    0.4-1.6% inline; the pool is per device, so per process, not per load (ResNet-18 at B=8: +4 MiB). A result
    never aliases a pooled buffer: results are copied out (or written into the caller's own storage) before
    their engine buffer is freed, so a result the caller keeps is never overwritten by a later call."""
    import iree.runtime as ireert

    key = f"{driver}:{workers}" if driver == "local-task" and workers is not None else driver
    with _lock:
        device = _devices.get(key)
        if device is None:
            if driver == "local-task":
                _configure_task_executor(workers)  # read when an executor is made: set before each local-task device
            allocators = ["caching"] if driver in CPU_DRIVERS else None
            device = ireert.get_driver(driver).create_default_device(allocators=allocators)
            _devices[key] = device
        return device


class ModelClosed(ExecutionError):
    """A call needed a new VM context of a model that was closed meanwhile (its program closed during the call)."""


class LoadedModel:
    """An engine module with its parameters on one device: immutable, shared by delegates and threads.

    The code module, the parameter provider and the HAL device are read-only once built and safe to use from
    several threads. What is not (an IREE fact) is a VM context; so each concurrent call checks out a context of
    its own from a small pool, grown only as far as the concurrency actually reached. Calls from different
    threads therefore run at the same time, with no lock held while the engine computes.
    """

    def __init__(
        self,
        vmfb: bytes | memoryview,
        parameters: Mapping[str, memoryview],
        target: Target,
        where: str,
        *,
        encoded: Mapping[str, memoryview] | None = None,
        keepalive: Any = None,
        state_zeros: Mapping[str, int] | None = None,
        driver: str | None = None,
        workers: int | None = None,
    ):
        import iree.runtime as ireert

        self.where = where
        self.target = target
        self._instance = vm_instance()
        self.driver = driver or target.driver  # a CPU target's executor may pick local-sync (targets.CPU_EXECUTORS)
        self.workers = workers  # task workers asked for (backend option threads); None: one per physical core
        self.device = hal_device(self.driver, workers)
        providers = [parameter_provider(parameters, PARAMETER_SCOPE, zeros=state_zeros)]
        self.encoded_bytes = sum(memoryview(view).nbytes for view in (encoded or {}).values())  # packed once, shared
        if encoded:
            # Weights packed once at specialization (scope `encoded`): every context reads this one mapped copy
            # instead of packing its own at initialization.
            providers.append(parameter_provider(encoded, ENCODED_SCOPE))
        try:
            module = ireert.VmModule.wrap_buffer(self._instance, vmfb)
        except ValueError:  # not aligned for in-place use (e.g. fresh compiler output): take a copy
            module = ireert.VmModule.copy_buffer(self._instance, vmfb)
        # Hold the bytes (and the cache entry they map) so the wrapped module is never freed under the engine.
        self._vmfb = vmfb
        self._keepalive = keepalive
        self._parameters, self._encoded, self._state_zeros = parameters, encoded, state_zeros  # for `on`
        # Everything IREE may still release from its own threads after a close (see quarantine.py).
        self.handed_to_engine = [vmfb, *parameters.values(), *(encoded or {}).values(), keepalive]
        quarantine.track(self)
        self.module = module
        self._modules = [
            ireert.create_hal_module(self._instance, self.device),
            ireert.create_io_parameters_module(self._instance, *providers),
            module,
        ]
        # Free VM contexts. list.pop/append are atomic under the GIL, so checking one out takes no lock of ours:
        # the check-in runs right after the engine has left the interpreter's caches cold (see invocation.py).
        self._pool: list[Any] = []
        self._count_lock = threading.Lock()
        self.contexts_created = 0
        self.load_state = "restored"  # or "specialized": how the backend obtained the code, for its log
        self._pool.append(self._new_context())  # fail at load, not at the first call

    def _new_context(self) -> Any:
        import iree.runtime as ireert

        modules = self._modules  # read once: `close` may empty it meanwhile
        if not modules:
            # Closed (its program's `close`) while a call was past the method's closed check, and the pool it
            # found empty: a context without the modules would run a function whose module may already be
            # freed (a segfault), or fail with IREE's NOT_FOUND. `EngineFunction.new_context` names the caller.
            raise ModelClosed(f"{self.where}: the program was closed while this call ran; load the program again.")
        try:
            context = ireert.VmContext(self._instance, modules=modules)
        except (RuntimeError, ValueError) as e:
            if f"scopes like '{ENCODED_SCOPE}'" in str(e):  # IREE: "no provider registered that handles scopes like"
                raise DelegateError(
                    f"{self.where}: the {self.target.name} bundle reads weights packed ahead of time (parameter scope "
                    f"'{ENCODED_SCOPE}') but nothing produced them: its manifest names no parameter encoder for "
                    f"{self.target.name}. Re-export the program. (IREE: {str(e).strip()})"
                ) from e
            raise DelegateError(f"{self.where}: IREE could not initialize the module: {e}") from e
        with self._count_lock:
            self.contexts_created += 1
        if self.driver == "local-task" and caller_wait.enabled():
            # The caller waits for the workers without preempting them (onecopy.delegate.caller_wait).
            return caller_wait.BatchWaitContext(context)
        return context

    def checkout(self) -> Any:
        """A VM context for one call alone (made when none is free); give it back with `checkin`. Raises
        `ModelClosed` once the model is closed and no context is free."""
        try:
            return self._pool.pop()
        except IndexError:
            return self._new_context()

    def checkin(self, context: Any) -> None:
        self._pool.append(context)

    def function(self, name: str, *, outputs_in_place: bool = False,
                 result_dtypes: Sequence[str] = (), where: str | None = None) -> "EngineFunction":
        """Function `name` of this model; `where` names the delegate calling it in errors (None: the model's own
        `where`, which for a shared model is the delegate that loaded it first, another method's)."""
        where = where if where is not None else self.where
        vm_function = self.module.lookup_function(name)
        if vm_function is None:
            raise DelegateError(
                f"{where}: the bundle has no function '{name}'; it has {', '.join(self.module.function_names)}. "
                "Re-export the program."
            )
        return EngineFunction(self, vm_function, name, outputs_in_place, result_dtypes, where)

    def on(self, driver: str) -> "LoadedModel":
        """The same code, weights and packed weights on another executor's device (`driver`): a second module
        and its own VM contexts over the very same bytes, nothing copied (IREE imports the mapped weights on a CPU
        device, as every unshared load of a program already does). It holds no cache entry: this model's does,
        so this model must be closed after it (onecopy.delegate.model_set)."""
        twin = LoadedModel(self._vmfb, self._parameters, self.target, self.where, encoded=self._encoded,
                           state_zeros=self._state_zeros, driver=driver, workers=self.workers)
        twin.load_state = "restored"
        return twin

    def write_for_tools(self, directory: Path) -> tuple[Path, dict[str, Path]]:
        """This model as IREE's command-line tools take it, written into `directory`: the module's bytes and each
        parameter scope as an IRPA archive (scope -> path). For tools that run the module in a child process
        (onecopy.delegate.dispatch_profile): the archives are a copy of the weights, there while the directory is.
        Program state starts as the engine's does, zeros."""
        module = directory / "module.vmfb"
        module.write_bytes(self._vmfb)
        archives = {PARAMETER_SCOPE: directory / f"{PARAMETER_SCOPE}.irpa"}
        _parameter_index(self._parameters, zeros=self._state_zeros).create_archive_file(str(archives[PARAMETER_SCOPE]))
        if self._encoded:
            archives[ENCODED_SCOPE] = directory / f"{ENCODED_SCOPE}.irpa"
            _parameter_index(self._encoded).create_archive_file(str(archives[ENCODED_SCOPE]))
        return module, archives

    def huge_page_bytes(self) -> int:
        """How much of the packed weights this process maps with huge pages (page_map): reads /proc/self/smaps,
        a few milliseconds, so asked for by the verbose load log and by tools, not on every load."""
        from onecopy.delegate.page_map import huge_mapped_bytes

        return sum(huge_mapped_bytes(memoryview(view)) for view in (self._encoded or {}).values())

    def close(self) -> None:
        """Drop the contexts and modules; the cache entry (if any) is released after them."""
        self._pool.clear()
        self._modules = []
        self.module = None
        # IREE's workers may drop their references to our buffers a moment after the last call returned. This
        # model keeps only the module's bytes and the cache entry (see below); the weights go with the quarantine.
        handed, self.handed_to_engine = self.handed_to_engine, [self._vmfb, self._keepalive]
        quarantine.hold(handed)
        # The cache entry's lock is released now; the entry itself (its mappings) stays referenced until this
        # model is collected, so no engine object can outlive the memory it reads.
        keepalive = self._keepalive
        if keepalive is not None and hasattr(keepalive, "close"):
            keepalive.close()


def dense(array: np.ndarray) -> np.ndarray:
    """`array` as the engine takes it: C-contiguous, its rank kept. Strided arrays (padded surface rows, views) are
    gathered; np.ascontiguousarray alone would also turn a 0-d array into a 1-d one, which a function taking a
    scalar tensor refuses (rank mismatch)."""
    return array if array.flags.c_contiguous else np.ascontiguousarray(array)


def as_recorded(host: np.ndarray, recorded: np.dtype | None) -> np.ndarray:
    """`host` (an engine buffer's view) as the dtype torch.export recorded for it, where the two differ by sign
    alone (same size, integer or bool): the same bytes, read as the program's type. Anything else is left as is."""
    if recorded is None or host.dtype == recorded or host.dtype.itemsize != recorded.itemsize:
        return host
    return host.view(recorded) if host.dtype.kind in "iub" else host


_element_types: dict[np.dtype, Any] = {}  # numpy dtype -> HAL element type, looked up once
_dtypes: dict[Any, np.dtype] = {}  # HAL element type -> numpy dtype, looked up once


class EngineFunction:
    """Calls one function of a loaded model on numpy arrays, in place where a bound surface allows it.

    `outputs_in_place`: the function is destination-passing (outputs as trailing arguments, written in place).
    A bound surface given as output storage is then handed over as is, so the engine writes the surface itself;
    other storage gets an engine buffer that is copied out after the call. The calls themselves live a layer up,
    in onecopy.delegate.invocation (`call`: `call_copied` when nothing is bound, else an `Invocation` planned and
    run); this class holds what they need: the function, its model, its bindings, and the copies in and out.
    """

    def __init__(self, model: LoadedModel, vm_function: Any, name: str, outputs_in_place: bool = False,
                 result_dtypes: Sequence[str] = (), where: str | None = None):
        import iree.runtime as ireert

        self.rt = ireert
        self.model = model
        # How errors name the delegate calling this function: its own, not the model's (a shared model's `where`
        # is that of the delegate that loaded it first, which may be another method's).
        self.where = where if where is not None else model.where
        self.name = name
        self._vm_function = vm_function
        self.outputs_in_place = outputs_in_place
        # Per result, the dtype to read an engine buffer as where it differs from the engine's by its sign alone
        # (IREE's integer types are signless: a uint8 or bool result is an i8 buffer, read as int8 otherwise,
        # 200 as -56); None where the engine's own dtype is the one.
        self.signed_as: tuple[np.dtype | None, ...] = tuple(
            np.dtype(d) if np.dtype(d).kind in "ub" else None for d in result_dtypes)
        self._memory_type = ireert.MemoryType.DEVICE_LOCAL
        self._usage = ireert.BufferUsage.DEFAULT | ireert.BufferUsage.MAPPING
        # base address -> binding; replaced (never mutated) so concurrent calls read a consistent table.
        self.bindings: dict[int, SurfaceBinding] = {}

    def new_context(self) -> Any:
        """A new VM context of the model, for a call that found none free; once the model is closed (its program
        closed during the call), an ExecutionError naming this function's delegate."""
        try:
            return self.model._new_context()
        except ModelClosed:
            raise ExecutionError(f"{self.where}: the program was closed while this call of '{self.name}' ran; "
                                 "load the program again.") from None

    def bind(self, binding: SurfaceBinding) -> None:
        self.bindings = {**self.bindings, binding.base_address: binding}

    def copied_call(
        self, inputs: Sequence[np.ndarray], outputs: int, report: RunReport | None = None
    ) -> Callable[..., list[np.ndarray] | None]:
        """`call_copied` specialized for inputs shaped as `inputs` and `outputs` results: everything that does not
        change between calls (element types, bytes in, the allocator, the bound methods) is looked up here, once,
        and held by a closure, `call(arrays, stats, state=None, outs=None)`: it runs in a context of the model's
        pool, or in a State's (`state.context`, onecopy.delegate.state), and copies its results into `outs` (the
        caller's storage, checked by the caller) or new arrays.

        With `report`, the closure is a method's whole checked call, `call(arrays, outs=...)`: it also does the
        method's bookkeeping (refuses once the program is closed, returns None when a surface was bound since,
        records its `CopyStats` in `report.local`), as a frame step does for bound surfaces.

        Such a call runs right after the previous one, with the interpreter's caches cold (the engine has just
        streamed the weights through them), where each Python frame and attribute lookup costs cache misses:
        measured call by call against the raw IREE call, the general path added ~90 us to a 4 ms `prefill`, a
        closure ~20; on the built-in model's forward (0.55 ms on IREE's workers, its 32 MB of weights streamed
        each call), the runtime's bookkeeping around this closure and its helpers' frames (dense, checkout,
        checkin, copy_out) added 20 us more, none with everything in this one frame. So the State's variant and
        the bookkeeping are branches here, not frames around it, and the helpers are written inline."""
        rt, model = self.rt, self.model
        device = model.device
        allocate = device.allocator.allocate_buffer_copy
        memory_type, usage = self._memory_type, self._usage
        element_types = tuple(self._element_type(array.dtype) for array in inputs)
        bytes_in = sum(int(np.prod(array.shape, dtype=np.int64)) * array.dtype.itemsize for array in inputs)
        vm_function, engine_error = self._vm_function, self.engine_error
        pool, new_context = model._pool, self.new_context
        take, give_back = pool.pop, pool.append
        variant_list, view_type = rt.VmVariantList, rt.HalBufferView
        dtypes, dtype_of = _dtypes, self._dtype
        signed_as = self.signed_as if any(d is not None for d in self.signed_as) else ()
        indices = range(outputs)
        count, result_count = len(inputs), max(outputs, 1)
        copyto, array_copy, gather = np.copyto, np.array, np.ascontiguousarray
        checked = report is not None
        if checked:
            assert report is not None
            is_closed, on_closed, local, record = report.closed.is_set, report.on_closed, report.local, report.record
            debug_enabled = log.isEnabledFor
        function = self
        constant: list[CopyStats] = []  # the stats of a call (the same every call of a signature), once known

        def call(arrays: Sequence[np.ndarray], stats: CopyStats | None = None, state: Any = None,
                 outs: Sequence[np.ndarray] | None = None) -> list[np.ndarray] | None:
            if checked:
                if is_closed():
                    on_closed()
                if function.bindings:  # an input may now be a bound surface: the method's planning must see it
                    return None
                debug = debug_enabled(DEBUG)
            args = variant_list(count)
            for array, element_type in zip(arrays, element_types):
                if not array.flags.c_contiguous:  # `dense`, inline: 0-d arrays are always contiguous
                    array = gather(array)
                args.push_ref(allocate(memory_type=memory_type, allowed_usage=usage, device=device,
                                       buffer=array, element_type=element_type))
            results = variant_list(result_count)
            if state is None:
                try:
                    context = take()
                except IndexError:
                    context = new_context()  # none free: a new one
            else:
                context = state.context
                if context is None:
                    raise ExecutionError(f"{state.where}: this state was closed with its program; load the program "
                                         "again.")
            try:
                context.invoke(vm_function, args, results)
            except (RuntimeError, ValueError) as e:  # ValueError: IREE refused the call
                raise engine_error(e) from e
            finally:
                if state is None:
                    give_back(context)
            produced = []
            copied_out = 0
            for i in indices:
                view = results.get_as_object(i, view_type)
                dtype = dtypes.get(view.element_type)
                if dtype is None:
                    dtype = dtype_of(view.element_type)
                host = view.map().asarray(tuple(view.shape), dtype)
                if signed_as:
                    host = as_recorded(host, signed_as[i] if i < len(signed_as) else None)
                copied_out += host.nbytes
                if outs is None:
                    produced.append(array_copy(host, copy=True))
                else:
                    copyto(outs[i], host)  # through the storage's strides
                    produced.append(outs[i])
            if not checked:
                stats.copied_in += bytes_in  # type: ignore[union-attr]  (given by every caller but a method's)
                stats.copied_out += copied_out  # type: ignore[union-attr]
                return produced
            # A stats object per signature, not per call: `Method.last_copy_stats` hands out copies.
            kept = constant[0] if constant and constant[0].copied_out == copied_out else None
            if kept is None:
                kept = CopyStats(copied_in=bytes_in, copied_out=copied_out)
                constant[:] = [kept]
            local.stats = kept
            if debug:
                record(kept, True)
            return produced

        return call

    def copy_in(self, array: np.ndarray) -> Any:
        element_type = self._element_type(array.dtype)
        device = self.model.device
        return device.allocator.allocate_buffer_copy(
            memory_type=self._memory_type, allowed_usage=self._usage, device=device, buffer=dense(array),
            element_type=element_type,
        )

    def _dtype(self, element_type: Any) -> np.dtype:
        """The numpy dtype of a HAL element type not seen before (then kept in `_dtypes`)."""
        dtype = _dtypes[element_type] = self.rt.HalElementType.map_to_dtype(element_type)
        return dtype

    def _element_type(self, dtype: np.dtype) -> Any:
        element_type = _element_types.get(dtype)
        if element_type is None:
            element_type = self.rt.array_interop.map_dtype_to_element_type(dtype)
            if element_type is None:
                raise ExecutionError(f"{self.where}: dtype {dtype} cannot be passed to the engine.")
            _element_types[dtype] = element_type
        return element_type

    def allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        """An engine buffer for an output written in place and copied out after: allocated, never filled."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        buffer = self.model.device.allocator.allocate_buffer(
            memory_type=self._memory_type, allowed_usage=self._usage, allocation_size=max(nbytes, 1)
        )
        return self.rt.HalBufferView(buffer, list(shape), self._element_type(np.dtype(dtype)))

    @property
    def vm_function(self) -> Any:
        return self._vm_function

    def engine_error(self, e: Exception) -> ExecutionError:
        """The error to raise when IREE failed running this function (RuntimeError), or refused the call
        (ValueError: arguments the function does not take, what a damaged or edited program leads to)."""
        hint = ""
        if "local memory" in str(e):  # a dispatch wants more than TASK_WORKER_LOCAL_MEMORY per worker
            hint = (" Give IREE's workers more local memory: set IREE_PY_RUNTIME_FLAGS="
                    "--task_worker_local_memory=<bytes> before the first load in this process.")
        return ExecutionError(f"{self.where}: the engine failed running '{self.name}': {e}{hint}")

    def copy_out(self, view: Any, out: np.ndarray | None, stats: CopyStats, index: int | None = None) -> np.ndarray:
        """Result `index`'s engine buffer `view` into `out` (through its strides) or a new array; `index` names the
        result whose recorded dtype it is read as (`signed_as`)."""
        dtype = _dtypes.get(view.element_type)
        if dtype is None:
            dtype = self._dtype(view.element_type)
        host = view.map().asarray(tuple(view.shape), dtype)
        if index is not None and index < len(self.signed_as):
            host = as_recorded(host, self.signed_as[index])
        stats.copied_out += host.nbytes
        if out is not None:
            if out.shape != host.shape:  # copyto would broadcast a smaller result over the storage
                raise ExecutionError(f"{self.where}: '{self.name}' returned {list(host.shape)}; the storage "
                                     f"given for it is {list(out.shape)}.")
            np.copyto(out, host)  # through `out`'s strides: padded surface rows stay padded
            return out
        return np.array(host, copy=True)
