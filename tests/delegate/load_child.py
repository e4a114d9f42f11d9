"""A second process for the cache tests: loads a program's methods and prints what each delegate load did.

    python -m tests.delegate.load_child PROGRAM CACHE_DIR [--hang-at compile|publish] [--marker FILE]

Prints one JSON line: {"states": ["specialized", "restored", ...], "sums": [...]}. With --hang-at, it writes
--marker and sleeps when it reaches that point, for the parent to kill it there.
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
    args = parser.parse_args()

    import onecopy.delegate.specialize as backend
    import onecopy.delegate.cache as cache

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

    sums = []
    with Runtime(cache_dir=args.cache_dir).load_program(args.program) as program:
        for name in program.method_names:
            method = program.load_method(name)
            x = np.ones([int(d) for d in method.method_meta.inputs[0].shape], np.float32)
            sums.append(float(method.execute([x])[0].sum()))
    print(json.dumps({"states": collect.states, "sums": sums}))


if __name__ == "__main__":
    main()
