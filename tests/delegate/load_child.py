"""A second process for the cache tests: loads a program's methods and prints what each delegate load did.

    python -m tests.delegate.load_child PROGRAM CACHE_DIR [--hang-at compile|publish] [--marker FILE] [--contexts N]

Prints one JSON line: {"states": ["specialized", "restored", ...], "sums": [...]}. With --hang-at, it writes
--marker and sleeps when it reaches that point, for the parent to kill it there. With --contexts N, the first
method's loaded model gets N VM contexts in all (N - 1 more), and the line adds "growth" (what those extra contexts
added to /proc/self/smaps_rollup, bytes per field) and "encoded_bytes" (the packed weights the model was given).
"""

import argparse
import json
import logging
import pathlib
import re
import time

import numpy as np


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.states = []

    def emit(self, record):
        found = re.match(r"kind=\w+ (specialized|restored)", record.getMessage())
        if found:
            self.states.append(found.group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("program")
    parser.add_argument("cache_dir")
    parser.add_argument("--hang-at", choices=("compile", "publish"))
    parser.add_argument("--marker")
    parser.add_argument("--contexts", type=int, default=0)
    args = parser.parse_args()

    import onecopy.delegate.specialize as backend
    import onecopy.delegate.cache_publish as cache

    def hang():
        pathlib.Path(args.marker).write_text("here")
        time.sleep(600)

    if args.hang_at == "compile":
        original = backend.compile_bundle

        def slow_compile(*a, **k):
            hang()
            return original(*a, **k)

        backend.compile_bundle = slow_compile
    elif args.hang_at == "publish":
        real_rename = cache.os.rename

        def rename(src, dst):
            if "entries" in str(dst):
                hang()
            return real_rename(src, dst)

        import os

        os_module = type(os)("os_patched")
        os_module.__dict__.update(os.__dict__)
        os_module.rename = rename
        cache.os = os_module

    collect = Collect()
    logger = logging.getLogger("onecopy")
    logger.setLevel(logging.INFO)
    logger.addHandler(collect)
    from onecopy import Runtime

    sums, methods, extra = [], [], {}
    with Runtime(cache_dir=args.cache_dir).load_program(args.program) as program:
        for name in program.method_names:
            methods.append(program.load_method(name))
            x = np.ones([int(d) for d in methods[-1].method_meta.inputs[0].shape], np.float32)
            sums.append(float(methods[-1].execute([x])[0].sum()))
        if args.contexts:
            extra = more_contexts(methods[0], args.contexts)
    print(json.dumps({"states": collect.states, "sums": sums, **extra}))


def smaps_rollup() -> dict:
    with open("/proc/self/smaps_rollup") as f:
        fields = (line.split() for line in f if line.rstrip().endswith("kB"))
        return {parts[0].rstrip(":"): int(parts[1]) * 1024 for parts in fields}


def more_contexts(method, n: int) -> dict:
    """Give the method's one loaded model `n` VM contexts in all (creating one runs the module's initializer,
    where a data-tiled module without encoded weights packs its own copy) and measure what the extra ones cost."""
    import gc

    (model,) = {id(d.model): d.model for d in method._delegates.values()}.values()
    gc.collect()
    before = smaps_rollup()
    held = [model._new_context() for _ in range(n - model.contexts_created)]
    gc.collect()
    after = smaps_rollup()
    growth = {field: after[field] - before[field] for field in after}
    return {"growth": growth, "encoded_bytes": model.encoded_bytes, "contexts": model.contexts_created,
            "held": len(held)}


if __name__ == "__main__":
    main()
