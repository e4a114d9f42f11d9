"""A second process for the surface tests: opens a surface by name and writes to it or holds its lock.

    python -m tests.surface.surface_child write NAME VALUE [--no-close]  fill the frame with VALUE, write-locked
    python -m tests.surface.surface_child hold NAME read|write            lock, print "locked", sleep until killed
    python -m tests.surface.surface_child count NAME N                    N times under the write lock: read the
                                                                          first value, write it back plus one

`write` prints one line: the generation after its writable unlock. With --no-close it exits without closing the
surface, as a crashing process would.
"""

import argparse
import os
import sys
import time

from onecopy.surface import Surface


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=("write", "hold", "count"))
    parser.add_argument("name")
    parser.add_argument("value")
    parser.add_argument("--no-close", action="store_true")
    args = parser.parse_args()

    surface = Surface.open(args.name)
    if args.action == "write":
        with surface.lock() as frame:
            frame[:] = float(args.value)
        print(surface.generation, flush=True)
        if args.no_close:
            os._exit(0)
        surface.close()
    elif args.action == "count":
        for _ in range(int(args.value)):
            with surface.lock(timeout=60) as frame:
                value = frame[0, 0]  # read, then write: an update lost to another writer shows in the total
                frame[0, 1] = value + 1
                frame[0, 0] = value + 1
        surface.close()
    else:
        with surface.lock(readonly=args.value == "read"):
            print("locked", flush=True)
            time.sleep(600)
    sys.exit(0)


if __name__ == "__main__":
    main()
