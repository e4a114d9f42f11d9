"""A second process for the shared-model stress test: load, run and close shared models from several threads.

    python -m tests.delegate.shared_stress_child PROGRAM CYCLES

Each cycle loads the program twice with share_multifunction_model (one shared model, four delegates), runs every
method from two threads at once while one program is closed under them (its calls finish or are refused with a
clear error; the other program keeps the model), checks the outputs against the first cycle's, then closes the
other program from a helper thread (the last release, which unloads the model and unmaps its weights). A crash
(a segfault, an abort from the engine, a GIL error) ends this process with a signal; the test sees the return
code. Prints "ok <cycles>" on success.
"""

import gc
import sys
import threading

import numpy as np

from onecopy import Runtime
from onecopy.errors import DelegateError, ExecutionError

SHARE = {"IreeBackend": {"share_multifunction_model": True}}


def main() -> None:
    path, cycles = sys.argv[1], int(sys.argv[2])
    runtime = Runtime()
    inputs = {"forward": np.ones((1, 64), np.float32), "prefill": np.full((16, 64), 0.5, np.float32)}
    expected: dict[str, np.ndarray] = {}
    for cycle in range(cycles):
        programs = [runtime.load_program(path, backend_options=SHARE) for _ in range(2)]
        methods = [(p.load_method(name), name) for p in programs for name in p.method_names]
        failures: list[str] = []

        def work(assigned):
            for method, name in assigned:
                for _ in range(3):
                    try:
                        (y,) = method.execute([inputs[name]])
                    except (ExecutionError, DelegateError) as e:  # its program was closed under it: refused
                        if "closed" not in str(e) and "destroyed" not in str(e):
                            failures.append(f"cycle {cycle}: {name}: {e}")
                        break
                    if name in expected and not np.array_equal(y, expected[name]):
                        failures.append(f"cycle {cycle}: {name} differs")
                    expected.setdefault(name, y)

        threads = [threading.Thread(target=work, args=(methods[i::2],)) for i in range(2)]
        for t in threads:
            t.start()
        # Close from this thread and from a helper, in an order that changes every cycle.
        order = programs if cycle % 2 else programs[::-1]
        order[0].close()
        for t in threads:
            t.join()
        closer = threading.Thread(target=order[1].close)
        closer.start()
        closer.join()
        del methods, programs, order
        if cycle % 5 == 0:
            gc.collect()
        if failures:
            raise SystemExit("; ".join(failures))
    print(f"ok {cycles}")


if __name__ == "__main__":
    main()
