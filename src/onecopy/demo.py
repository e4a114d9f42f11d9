"""`onecopy demo`: what onecopy buys on this machine, measured now beside ONNX Runtime and torch eager.

On the built-in model (8 x Linear(1024, 1024) + ReLU, methods forward [1, 1024] and prefill [16, 1024]):
1. program size on disk: one onecopy file for both methods vs one ONNX file per method;
2. time to first result in a fresh process: onecopy cold (specialize for this CPU) and warm (restore from the
   cache) vs an ONNX Runtime session;
3. memory (PSS and RSS growth) of K = 1, 2, 4, 8 loads, each K in a fresh process: onecopy programs with the
   shared model on and off vs ONNX Runtime sessions;
4. latency per call at B=1 and B=16: onecopy, ONNX Runtime, torch eager, in interleaved rounds;
5. a chained two-model fp16 frame pipeline: onecopy on bound surfaces vs numpy I/O vs ONNX Runtime's IOBinding.

And, with transformers installed (`pip install 'onecopy[llm]'`; without it these rows are skipped), a tiny
random-weight Llama exported by `onecopy.llm.export_llm` as prefill + decode, its KV cache kept in the engine as a
State: greedy decode tokens/s beside torch eager with transformers' static cache (same tokens, checked), the bytes a
decode step copies (`last_copy_stats`: none of the cache), and the PSS growth of 4 States over 1 in a fresh process.

Every figure is measured in this run; nothing is quoted from elsewhere. Without ONNX Runtime the demo says so and
measures onecopy (and torch eager) alone. Everything it makes lives in one temporary directory, removed at the
end, on an error and on Ctrl-C; its child processes are killed with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["run_demo", "DemoConfig", "FULL", "QUICK"]

FRAME = (1, 3, 270, 480)  # fp16 frames: 810 rows of 480 values = 960-byte rows, a dense surface
ONNX_PACKAGES = ("onnxruntime", "onnx", "onnxscript")
INSTALL_HINT = "pip install -c constraints.txt -e '.[demo]' (make demo installs it)"
PLOT_HINT = "pip install -c constraints.txt -e '.[plot]' (make demo installs it)"


@dataclass(frozen=True)
class DemoConfig:
    ks: tuple[int, ...] = (1, 2, 4, 8)  # loads per process in the memory sweep
    warm_loads: int = 3  # fresh processes per warm figure (median)
    latency_rounds: int = 12
    latency_block_s: float = 0.05  # timed calls of one peer in a round
    frame_rounds: int = 12
    llm_tokens: int = 32  # greedy decode steps per timed call
    llm_rounds: int = 6


FULL = DemoConfig()
QUICK = DemoConfig(ks=(1, 2), warm_loads=1, latency_rounds=3, latency_block_s=0.015, frame_rounds=3,
                   llm_tokens=8, llm_rounds=2)  # every measurement, fewer times


# -- fresh processes --------------------------------------------------------------------------------------------


def _child(kind: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """Run `python -m onecopy.demo KIND ARGS` and return the JSON it prints last. subprocess.run kills the child
    on any exception, KeyboardInterrupt included, before this returns."""
    result = subprocess.run([sys.executable, "-m", "onecopy.demo", kind, *args], capture_output=True, text=True,
                            timeout=300, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise RuntimeError(f"demo child {kind} failed: {result.stderr.strip()[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _growth(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    return {key: (after[key] - before[key]) / 2**20 for key in after}


def _child_load_onecopy(program: str, cache_dir: str) -> dict:
    started = time.perf_counter()
    import iree.runtime  # noqa: F401  (the engine's import, paid by every process, cold or warm)
    import numpy as np

    import onecopy.delegate.backend  # noqa: F401  (imported on first load otherwise; imports are not loading)
    from onecopy import Runtime

    imported = time.perf_counter()
    with Runtime(cache_dir=cache_dir).load_program(program) as loaded:
        loaded.load_method("forward").execute([np.ones((1, 1024), np.float32)])
        first = time.perf_counter()
    return {"import_ms": (imported - started) * 1e3, "first_result_ms": (first - imported) * 1e3}


def _child_load_ort(onnx_path: str) -> dict:
    started = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    imported = time.perf_counter()
    session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones((1, 1024), np.float32)})
    first = time.perf_counter()
    return {"import_ms": (imported - started) * 1e3, "first_result_ms": (first - imported) * 1e3}


def _wait_unmapped(paths: tuple[str, ...], release: Callable[[], None], timeout_s: float = 5.0) -> None:
    """Wait until this process maps nothing under `paths`: the baseline must not hold the warm-up's weights, or
    the first load maps the same pages again and looks free. A closed program's weights go a moment after its
    close (quarantine) and the cache entry's mappings with its last reference, which a cycle can hold until a
    collection."""
    deadline = time.monotonic() + timeout_s
    while True:
        release()
        gc.collect()
        with open("/proc/self/maps") as f:
            held = [line for line in f if any(p in line for p in paths)]
        if not held:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the warm-up's files are still mapped {timeout_s} s after its close: {held[0].strip()}")
        time.sleep(0.02)


def _child_memory_onecopy(program: str, cache_dir: str, share: bool, k: int) -> dict:
    import numpy as np

    from onecopy import Runtime
    from onecopy.delegate import quarantine
    from onecopy.measure import memory
    from onecopy.models import METHOD_BATCH, WIDTH

    runtime = Runtime(cache_dir=cache_dir)
    with runtime.load_program(program) as warm:  # engine libraries and threads: loaded, not counted
        warm.load_method("forward").execute([np.ones((1, WIDTH), np.float32)])
    _wait_unmapped((program, cache_dir), quarantine.drain)
    before = memory()
    options = {"IreeBackend": {"share_multifunction_model": share}}
    programs = []
    for _ in range(k):
        loaded = runtime.load_program(program, backend_options=options)
        for name, batch in METHOD_BATCH.items():
            loaded.load_method(name).execute([np.ones((batch, WIDTH), np.float32)])
        programs.append(loaded)
    after = memory()
    for loaded in programs:
        loaded.close()
    return _growth(before, after)


def _child_memory_ort(onnx_path: str, warmup_path: str, k: int) -> dict:
    import numpy as np
    import onnxruntime as ort

    from onecopy.measure import memory

    # Warm up on another (tiny) model: a session of this one, freed, would leave its weights' pages in the
    # allocator for the next session to reuse, and K=1 would look free.
    tiny = ort.InferenceSession(warmup_path, providers=["CPUExecutionProvider"])
    tiny.run(None, {"x": np.ones((1, 16), np.float32)})
    del tiny
    gc.collect()
    before = memory()
    sessions = []
    for _ in range(k):
        session = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
        session.run(None, {"x": np.ones((1, 1024), np.float32)})
        sessions.append(session)
    return _growth(before, memory())


# -- the demo ---------------------------------------------------------------------------------------------------


def _onnxruntime_missing() -> str | None:
    import importlib.util

    missing = [p for p in ONNX_PACKAGES if importlib.util.find_spec(p) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _export_onnx(model, example, path: Path, exported=None) -> Path:
    """The model as ONNX, the way benchmarks/ export it: torch.onnx's dynamo exporter (static shapes; from the
    torch.export program onecopy was given, when there is one, rather than tracing the model again), the
    TorchScript exporter if that fails."""
    import io
    import logging
    import warnings

    import torch

    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)  # "torchvision ..."
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(exported if exported is not None else model, () if exported is not None else (example,),
                              str(path), dynamo=True, verbose=False, input_names=["x"], output_names=["y"])
        except Exception:  # noqa: BLE001  (any failure of one exporter: try the other)
            torch.onnx.export(model, (example,), str(path), dynamo=False, input_names=["x"], output_names=["y"],
                              opset_version=17)
    return path


def _onnx_bytes(path: Path) -> int:
    """An ONNX file with its external data files (the dynamo exporter writes the weights beside the graph)."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def _tiny_onnx(path: Path) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _frame_models():
    import torch

    class ScaleBias(torch.nn.Module):
        def forward(self, x):
            return x * 0.5 + 0.25

    class Gain(torch.nn.Module):
        def forward(self, x):
            return torch.clamp(x * 2.0, 0.0, 1.0)

    return {"scale_bias": ScaleBias(), "gain": Gain()}


def _machine() -> dict[str, Any]:
    import importlib.metadata

    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("model name", "Hardware")):
                model = line.split(":", 1)[1].strip()
                break
    versions = {}
    for package in ("onecopy", "torch", "iree-base-runtime", "onnxruntime", "numpy"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"cpu_model": model, "cores": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
            "machine": platform.machine(), "python": platform.python_version(), "versions": versions}


@contextlib.contextmanager
def _environ(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@contextlib.contextmanager
def _terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM ends the demo like Ctrl-C does: through the finally blocks that remove what it made."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Steps:
    """One progress bar over the demo's steps (on stderr)."""

    def __init__(self, progress, total: int) -> None:
        self.progress, self.task = progress, progress.add_task("", total=total)
        self.seconds: dict[str, float] = {}  # per kind of step (the description's text before ':')
        self._current: tuple[str, float] | None = None

    def start(self, description: str) -> None:
        self._stop()
        self._current = (description.split(":")[0], time.perf_counter())
        self.progress.update(self.task, description=description)

    def _stop(self) -> None:
        if self._current is not None:
            kind, began = self._current
            self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - began
            self._current = None

    def done(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)


def _measure_load(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool, steps: _Steps) -> dict:
    steps.start("cold load: a fresh process specializes the program for this CPU")
    cold = _child("load-onecopy", str(paths["onecopy"]), str(cache_dir))
    steps.done()
    steps.start("warm loads: fresh processes restore it from the cache")
    warm = [_child("load-onecopy", str(paths["onecopy"]), str(cache_dir), env={"ONECOPY_FORBID_SPECIALIZE": "1"})
            for _ in range(config.warm_loads)]
    load = {"onecopy": {"import_ms": _median([w["import_ms"] for w in warm]), "cold_ms": cold["first_result_ms"],
                        "warm_ms": _median([w["first_result_ms"] for w in warm])}}
    steps.done()
    if ort_ok:
        steps.start("ONNX Runtime sessions in fresh processes")
        runs = [_child("load-ort", str(paths["onnx_forward"])) for _ in range(config.warm_loads)]
        load["onnxruntime"] = {"import_ms": _median([r["import_ms"] for r in runs]),
                               "first_result_ms": _median([r["first_result_ms"] for r in runs])}
    steps.done()
    return load


def _measure_memory(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool,
                    steps: _Steps) -> dict:
    """Each (engine, K) in its own fresh process, one after the other: a process mapping the same pages at the
    same time would take a share of their PSS."""
    memory: dict[str, dict[str, dict[str, float]]] = {"onecopy_shared": {}, "onecopy_unshared": {}}
    if ort_ok:
        memory["onnxruntime"] = {}
    for k in config.ks:
        for engine in memory:
            steps.start(f"memory: {k} load{'s' if k > 1 else ''}, {engine.replace('_', ' ')} (fresh process)")
            if engine == "onnxruntime":
                growth = _child("memory-ort", str(paths["onnx_forward"]), str(paths["onnx_tiny"]), str(k))
            else:
                share = "on" if engine == "onecopy_shared" else "off"
                growth = _child("memory-onecopy", str(paths["onecopy"]), str(cache_dir), share, str(k),
                                env={"ONECOPY_FORBID_SPECIALIZE": "1"})
            memory[engine][str(k)] = growth
            steps.done()
    return memory


def _measure_latency(paths: dict[str, Path], cache_dir: Path, model, config: DemoConfig, ort_ok: bool,
                     steps: _Steps) -> tuple[dict, dict]:
    import numpy as np
    import torch

    from onecopy import Runtime
    from onecopy.measure import interleaved, paired_ratio
    from onecopy.models import METHOD_BATCH, WIDTH

    rng = np.random.default_rng(0)
    latency, accuracy = {}, {}
    sessions = {}
    if ort_ok:
        import onnxruntime as ort

        sessions = {name: ort.InferenceSession(str(paths[f"onnx_{name}"]), providers=["CPUExecutionProvider"])
                    for name in METHOD_BATCH}
    with Runtime(cache_dir=cache_dir).load_program(paths["onecopy"]) as program:
        for name, batch in METHOD_BATCH.items():
            steps.start(f"latency, {name} B={batch}: onecopy, ONNX Runtime, torch eager in interleaved rounds")
            x = rng.standard_normal((batch, WIDTH), dtype=np.float32)
            method = program.load_method(name)
            peers: dict[str, Callable[[], Any]] = {"onecopy": lambda m=method, x=x: m.execute([x])}
            if name in sessions:
                peers["onnxruntime"] = lambda s=sessions[name], x=x: s.run(None, {"x": x})

            def eager(x=x):
                with torch.no_grad():
                    return model(torch.from_numpy(x))

            peers["torch"] = eager
            expected = eager().numpy()
            for engine in ("onecopy", "onnxruntime"):
                if engine in peers:
                    got = np.asarray(peers[engine]()[0])
                    accuracy[engine] = max(accuracy.get(engine, 0.0), float(np.abs(got - expected).max()))
            start = time.perf_counter()
            for fn in peers.values():
                fn()
            # about 50 ms (quick: 15) per peer per round, at least 2 calls: B=16 takes many times B=1
            each = (time.perf_counter() - start) / len(peers)
            inner = max(2, min(10, int(config.latency_block_s / max(each, 1e-6))))
            timings = interleaved(peers, rounds=config.latency_rounds, inner=inner)
            latency[f"B={batch}"] = {
                "method": name,
                "ms": {engine: t.median_ms for engine, t in timings.items()},
                "onecopy_over": {engine: paired_ratio(timings["onecopy"], t)
                                 for engine, t in timings.items() if engine != "onecopy"},
            }
            steps.done()
    return latency, accuracy


def _measure_frames(paths: dict[str, Path], cache_dir: Path, config: DemoConfig, ort_ok: bool) -> dict:
    import numpy as np

    from onecopy import Runtime, Surface
    from onecopy.measure import interleaved, paired_ratio

    runtime = Runtime(cache_dir=cache_dir)
    height, width = FRAME[0] * FRAME[1] * FRAME[2], FRAME[3]
    tag = f"onecopy-demo-{os.getpid()}"
    surfaces = []
    try:
        for i in range(3):
            surfaces.append(Surface.create(height, width, "float16", name=f"{tag}-{i}"))
        src, middle, dst = surfaces
        src.array()[:] = np.random.default_rng(0).random((height, width), dtype=np.float32).astype(np.float16)
        with runtime.load_program(paths["scale_bias"]) as first, runtime.load_program(paths["gain"]) as second:
            a, b = first.load_method("forward"), second.load_method("forward")
            plain_in = np.array(src.array()).reshape(FRAME)
            plain_mid, plain_out = np.empty(FRAME, np.float16), np.empty(FRAME, np.float16)
            copied_bytes = {}

            def numpy_io():
                a.execute([plain_in], outputs=[plain_mid])
                b.execute([plain_mid], outputs=[plain_out])
                copied_bytes["onecopy_numpy"] = a.last_copy_stats.copied + b.last_copy_stats.copied

            for s in (src, middle):
                a.bind_surface(s)
            for s in (middle, dst):
                b.bind_surface(s)
            views = [s.array().reshape(FRAME) for s in surfaces]
            # A frame loop plans each call once (Method.prepare) and reruns it on each new frame.
            first_call = a.prepare([views[0]], outputs=[views[1]])
            second_call = b.prepare([views[1]], outputs=[views[2]])

            def bound():
                first_call.run()
                second_call.run()
                copied_bytes["onecopy_bound"] = first_call.last_copy_stats.copied + second_call.last_copy_stats.copied

            peers: dict[str, Callable[[], Any]] = {"onecopy_bound": bound, "onecopy_numpy": numpy_io}
            ort_out = None
            if ort_ok:
                import onnxruntime as ort

                # ONNX Runtime's best for a frame loop: IOBinding to preallocated arrays, bound once.
                ort_mid, ort_out = np.empty(FRAME, np.float16), np.empty(FRAME, np.float16)
                runs = []
                for key, x, y in (("onnx_scale_bias", plain_in, ort_mid), ("onnx_gain", ort_mid, ort_out)):
                    session = ort.InferenceSession(str(paths[key]), providers=["CPUExecutionProvider"])
                    binding = session.io_binding()
                    binding.bind_input("x", "cpu", 0, np.float16, list(FRAME), x.ctypes.data)
                    binding.bind_output("y", "cpu", 0, np.float16, list(FRAME), y.ctypes.data)
                    runs.append(lambda s=session, io=binding: s.run_with_iobinding(io))
                peers["onnxruntime_iobinding"] = lambda: (runs[0](), runs[1]())
            timings = interleaved(peers, rounds=config.frame_rounds, inner=5)
            expected = np.clip((plain_in.astype(np.float32) * 0.5 + 0.25) * 2.0, 0, 1)
            accuracy = float(np.abs(views[2].astype(np.float32) - expected).max())
            if not np.array_equal(views[2], plain_out):
                raise RuntimeError("the bound and the copied frame pipelines disagree")
            if ort_out is not None:
                accuracy = max(accuracy, float(np.abs(ort_out.astype(np.float32) - expected).max()))
    finally:
        for s in surfaces:
            s.close()
            s.unlink()
    return {
        "frame": list(FRAME), "dtype": "float16",
        "ms_per_frame": {peer: t.median_ms for peer, t in timings.items()},
        "bytes_copied_per_frame": copied_bytes,
        "onecopy_bound_over": {peer: paired_ratio(timings["onecopy_bound"], t)
                               for peer, t in timings.items() if peer != "onecopy_bound"},
        "max_abs_diff_vs_float32": accuracy,
    }


# -- the LLM rows: a tiny Llama's prefill + decode, the KV cache kept in the engine as State ------------------------

LLM_HINT = "pip install 'onecopy[llm]'"
LLM_CACHE_TOKENS = 256
LLM_PREFILL_TOKENS = 16


def _llm_missing() -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("transformers") is not None else "not installed: transformers"


def _decode_one(decode, state, token: int, position: int):
    import numpy as np

    (logits,) = decode.execute([np.array([[token]], np.int64), np.array([position])], state=state)
    return logits


def _child_memory_llm(program: str, cache_dir: str) -> dict:
    """PSS/RSS growth (bytes) of 1 and then 4 States of one loaded program, one decode on each, over a process
    that already holds the program and a warmed-up State (kept: its freed pages would serve the next one)."""
    from onecopy import Runtime
    from onecopy.measure import memory

    with Runtime(cache_dir=cache_dir).load_program(program) as prog:
        decode = prog.load_method("decode")
        warm = prog.create_state()
        _decode_one(decode, warm, 1, 0)
        gc.collect()
        before = memory()
        states = []
        found = {}
        for n in (1, 4):
            while len(states) < n:
                state = prog.create_state()
                _decode_one(decode, state, 1, 0)
                states.append(state)
            after = memory()
            found[str(n)] = {key: after[key] - before[key] for key in after}
        del states, warm
    return found


def _measure_llm(out: Path, cache_dir: Path, config: DemoConfig, steps: _Steps) -> dict:
    import numpy as np
    import torch

    from onecopy import Runtime
    from onecopy.llm import export_llm
    from onecopy.measure import interleaved, paired_ratio

    steps.start(f"LLM: exporting a tiny random-weight Llama as prefill + decode (cache {LLM_CACHE_TOKENS} tokens)")
    from onecopy.models import tiny_llama

    model = tiny_llama()
    program = export_llm(model, max_cache_len=LLM_CACHE_TOKENS, prefill_tokens=LLM_PREFILL_TOKENS)
    path = program.save(out / "llm.onecopy")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    steps.done()

    # Before this process loads the program: its mapping would take a share of the child's PSS.
    steps.start("LLM memory: 1 and 4 States of one program (fresh process; its first load compiles the program)")
    states_memory = _child("memory-llm", str(path), str(cache_dir))
    steps.done()

    steps.start("LLM decode: onecopy (State in the engine) vs torch eager (static cache), interleaved rounds")
    prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, LLM_PREFILL_TOKENS, dtype=np.int64)
    n = config.llm_tokens
    with Runtime(cache_dir=cache_dir).load_program(path) as prog:
        prefill, decode = prog.load_method("prefill"), prog.load_method("decode")
        state = prog.create_state()
        state_bytes = {name: int(state.read(name).nbytes) for name in state.names()}
        (logits,) = prefill.execute([prompt.reshape(1, -1), np.arange(LLM_PREFILL_TOKENS)], state=state)
        first_onecopy = int(np.argmax(logits[0, -1]))

        def onecopy_decode() -> list[int]:
            # n greedy steps after the prompt; each call writes the same cache slots again (the cache position,
            # not a counter, says where), so every call decodes the same tokens
            tokens, token = [], first_onecopy
            for i in range(n):
                logits = _decode_one(decode, state, token, LLM_PREFILL_TOKENS + i)
                token = int(np.argmax(logits[0, -1]))
                tokens.append(token)
            return tokens

        from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

        generation = model.generation_config
        previous, generation.cache_implementation = generation.cache_implementation, "static"
        try:
            eager = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=LLM_CACHE_TOKENS)
        finally:
            generation.cache_implementation = previous
        with torch.no_grad():
            eager_logits = eager(input_ids=torch.from_numpy(prompt).reshape(1, -1),
                                 cache_position=torch.arange(LLM_PREFILL_TOKENS))
        first_torch = int(eager_logits[0, -1].argmax())

        def torch_decode() -> list[int]:
            tokens, token = [], first_torch
            with torch.no_grad():
                for i in range(n):
                    logits = eager(input_ids=torch.tensor([[token]]),
                                   cache_position=torch.tensor([LLM_PREFILL_TOKENS + i]))
                    token = int(logits[0, -1].argmax())
                    tokens.append(token)
            return tokens

        ours, theirs = [first_onecopy, *onecopy_decode()], [first_torch, *torch_decode()]
        timings = interleaved({"onecopy": onecopy_decode, "torch": torch_decode}, rounds=config.llm_rounds, inner=1,
                              warmup=1)
        # One decode step's copies, measured: what crossed between Python and the engine.
        ids, position = np.array([[ours[-1]]], np.int64), np.array([LLM_PREFILL_TOKENS + n])
        (logits,) = decode.execute([ids, position], state=state)
        stats = decode.last_copy_stats
        io_bytes = ids.nbytes + position.nbytes + logits.nbytes
        state.close()
    cache_bytes = sum(b for name, b in state_bytes.items() if "cache" in name)
    extra = {key: states_memory["4"][key] - states_memory["1"][key] for key in states_memory["4"]}
    return {
        "model": "Llama, random weights (seed 0): 2 layers, hidden 64, 4 heads (2 KV), vocab 128, fp32",
        "max_cache_len": LLM_CACHE_TOKENS, "prefill_tokens": LLM_PREFILL_TOKENS, "decode_tokens": n,
        "weight_bytes": weight_bytes,
        "decode_tokens_per_s": {peer: n / (t.median_ms / 1e3) for peer, t in timings.items()},
        "decode_ms_per_token": {peer: t.median_ms / n for peer, t in timings.items()},
        "onecopy_over": {"torch": paired_ratio(timings["onecopy"], timings["torch"])},
        "greedy_tokens_equal": ours == theirs,
        "tokens": {"onecopy": ours, "torch": theirs},
        "copy_per_decode_step": {
            "state_bytes": sum(state_bytes.values()), "cache_bytes": cache_bytes,
            "copied_in": stats.copied_in, "copied_out": stats.copied_out,
            "token_position_logits_bytes": io_bytes,
            # what was copied beyond the step's own token, position and logits: the cache, if it crossed
            "state_bytes_copied": max(0, stats.copied - io_bytes),
        },
        "states_memory": {
            "state_bytes_per_state": sum(state_bytes.values()), "cache_bytes_per_state": cache_bytes,
            "growth_bytes": states_memory, "three_more_states_bytes": extra,
            "three_more_over_cache": extra["pss"] / (3 * cache_bytes),
            # what each extra State costs beyond its cache (the engine's context for it), from the PSS growth
            "beyond_cache_per_state_bytes": (extra["pss"] - 3 * cache_bytes) / 3,
        },
    }


def _measure_llm_rows(out: Path, cache_dir: Path, config: DemoConfig, steps: _Steps, console) -> dict:
    """The LLM rows, or why there are none: without transformers they are skipped, and a failure here says so in
    one line and leaves the rest of the demo's figures standing."""
    missing = _llm_missing()
    if missing is not None:
        steps.done(3)
        return {"skipped": missing, "hint": LLM_HINT}
    try:
        return _measure_llm(out, cache_dir, config, steps)
    except Exception as e:  # noqa: BLE001  (any failure of this section: reported, the rest of the demo stands)
        message = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        console.print(f"the LLM rows failed: {message}", markup=False, highlight=False)
        steps.done(3)
        return {"error": message}


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def measure(config: DemoConfig = FULL, *, workdir: Path | None = None, console=None) -> dict[str, Any]:
    """Run every measurement and return the figures (what `--json` prints)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from onecopy.export import CompileSpec, Partitioner, export_program
    from onecopy.inspect import summarize
    from onecopy.models import METHOD_BATCH, WIDTH, builtin_methods, builtin_model
    from onecopy.program import read_program

    started = time.perf_counter()
    console = console or Console(stderr=True)
    missing = _onnxruntime_missing()
    ort_ok = missing is None
    figures: dict[str, Any] = {
        "machine": _machine(),
        "model": f"8 x Linear({WIDTH}, {WIDTH}) + ReLU, fp32; methods "
                 + ", ".join(f"{n} [{b}, {WIDTH}]" for n, b in METHOD_BATCH.items()),
        "config": dataclasses.asdict(config),
        "onnxruntime": "measured" if ort_ok else missing,
    }
    with contextlib.ExitStack() as stack:
        stack.enter_context(_terminated_as_interrupt())
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="onecopy-demo-")))
        # Files the engines leave in the temporary directory (ONNX Runtime a telemetry session file on import, torch
        # its compile caches) go into ours, in this process and its children.
        (tmp / "tmp").mkdir()
        stack.enter_context(_environ("TMPDIR", str(tmp / "tmp")))
        stack.enter_context(_environ("TORCHINDUCTOR_CACHE_DIR", str(tmp / "torch")))
        import torch

        out = workdir or tmp
        out.mkdir(parents=True, exist_ok=True)
        cache_dir = tmp / "cache"  # the demo's own cache: cold means cold, and the user's cache is left alone
        columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
        progress = stack.enter_context(Progress(*columns, console=console, transient=True))
        steps = _Steps(progress, 10 + len(config.ks) * (3 if ort_ok else 2) + len(METHOD_BATCH))

        steps.start("exporting the built-in model and two frame models")
        model = builtin_model()
        paths: dict[str, Path] = {}
        exported = builtin_methods(model)
        paths["onecopy"] = export_program(exported, partitioner=Partitioner(multifunction=True),
                                          compile_spec=CompileSpec(packaging="mlir")).save(out / "builtin.onecopy")
        frame_models = _frame_models()
        for name, frame_model in frame_models.items():
            exported[name] = torch.export.export(frame_model, (torch.zeros(FRAME, dtype=torch.float16),))
            paths[name] = export_program({"forward": exported[name]},
                                         memory_planned_outputs=False).save(out / f"{name}.onecopy")
        loaded = read_program(paths["onecopy"])
        try:
            summary = summarize(loaded, paths["onecopy"].stat().st_size)
        finally:
            loaded.close()
        figures["size_bytes"] = {"onecopy": {"file": summary.file_bytes, "code": summary.code_bytes,
                                             "parameters": summary.parameter_bytes}}
        steps.done()

        steps.start("exporting ONNX files for ONNX Runtime (torch.onnx)")
        if ort_ok:
            onnx_dir = out / "onnx"
            onnx_dir.mkdir(exist_ok=True)
            for name, batch in METHOD_BATCH.items():
                paths[f"onnx_{name}"] = _export_onnx(model, torch.zeros(batch, WIDTH), onnx_dir / f"{name}.onnx",
                                                     exported[name])
            for name, frame_model in frame_models.items():
                paths[f"onnx_{name}"] = _export_onnx(frame_model, torch.zeros(FRAME, dtype=torch.float16),
                                                     onnx_dir / f"{name}.onnx", exported[name])
            paths["onnx_tiny"] = _tiny_onnx(onnx_dir / "tiny.onnx")
            per_method = {name: _onnx_bytes(paths[f"onnx_{name}"]) for name in METHOD_BATCH}
            figures["size_bytes"]["onnxruntime"] = {**per_method, "total": sum(per_method.values())}
        steps.done()

        figures["load_ms"] = _measure_load(paths, cache_dir, config, ort_ok, steps)
        # Before the parent loads anything: a page this process mapped would take a share of a child's PSS.
        figures["memory_mib"] = _measure_memory(paths, cache_dir, config, ort_ok, steps)
        figures["latency_ms"], figures["max_abs_diff_vs_torch"] = _measure_latency(
            paths, cache_dir, model, config, ort_ok, steps)
        steps.start("frames: a two-model fp16 pipeline, bound surfaces vs numpy I/O vs ONNX Runtime IOBinding")
        figures["frames"] = _measure_frames(paths, cache_dir, config, ort_ok)
        steps.done()
        figures["llm"] = _measure_llm_rows(out, cache_dir, config, steps, console)
        steps.start("done")
        figures["seconds_by_step"] = steps.seconds
        if workdir:
            figures["workdir"] = str(out)
    figures["duration_s"] = time.perf_counter() - started
    # Other processes' work slows every figure here (the ratios less): a load average above the CPU count says so.
    figures["load_average_at_end"] = list(os.getloadavg())
    return figures


def run_demo(workdir: Path | None = None, plot: Path | None = None, *, as_json: bool = False,
             config: DemoConfig = FULL) -> int:
    from rich.console import Console

    from onecopy.demo_report import draw, print_table

    console = Console(stderr=as_json)
    if not console.is_terminal:  # piped or captured: rich would wrap the table at 80 columns; no terminal to fit
        console = Console(stderr=as_json, width=112)
    figures = measure(config, workdir=workdir, console=Console(stderr=True))
    if as_json:
        print(json.dumps(figures, indent=2))
    else:
        print_table(figures, console)
    if plot is not None:
        try:
            draw(figures, plot)
            console.print(f"picture written to {plot.resolve()}", markup=False, highlight=False)
        except ImportError:
            console.print(f"no picture: matplotlib is not installed. For the picture: {PLOT_HINT}.", markup=False,
                          highlight=False)
    accurate = figures["max_abs_diff_vs_torch"].get("onecopy", 1.0) < 1e-4
    return 0 if accurate else 1


def _child_main(argv: list[str]) -> None:
    kind, args = argv[0], argv[1:]
    if kind == "load-onecopy":
        found = _child_load_onecopy(args[0], args[1])
    elif kind == "load-ort":
        found = _child_load_ort(args[0])
    elif kind == "memory-onecopy":
        found = _child_memory_onecopy(args[0], args[1], args[2] == "on", int(args[3]))
    elif kind == "memory-llm":
        found = _child_memory_llm(args[0], args[1])
    elif kind == "memory-ort":
        found = _child_memory_ort(args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown demo child {kind!r}")
    print(json.dumps(found))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
