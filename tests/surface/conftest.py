"""Fixtures of the surface tests: fresh names, surfaces cleaned up after each test, a child process."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from onecopy.surface import SHM_DIR

NAME_RULE = "use 1 to 128 characters from A-Z a-z 0-9 _ . - (e.g. 'camera0')."
ROOT = Path(__file__).resolve().parents[2]
RUN = f"test-{os.getpid()}"  # every name this process makes starts so, and only those are cleaned or checked


def shm_files() -> set[str]:
    # Only this process's names: other test runs may share /dev/shm at the same time.
    mine = (f"onecopy-{RUN}", f".onecopy-tmp-{os.getpid()}-")
    return {f for f in os.listdir(SHM_DIR) if f.startswith(mine)}


@pytest.fixture(autouse=True)
def leaves_nothing_in_shm():
    before = shm_files()
    yield
    assert shm_files() == before


@pytest.fixture
def name(request):
    """A fresh surface name; its /dev/shm file is removed after the test whatever made it."""
    chosen = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{RUN}-{request.node.name}")[:100]
    yield chosen
    Path(SHM_DIR, f"onecopy-{chosen}").unlink(missing_ok=True)


def child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tests.surface.surface_child", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )


class Holder:
    """A child process that holds the surface's lock until it is killed."""

    def __init__(self, name: str, mode: str) -> None:
        cmd = [sys.executable, "-m", "tests.surface.surface_child", "hold", name, mode]
        self.process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> Holder:
        ready, _, _ = select.select([self.process.stdout], [], [], 60)
        line = self.process.stdout.readline() if ready else ""
        if line.strip() != "locked":
            self.__exit__()
            pytest.fail(f"the child did not take the lock: {line!r} {self.process.stderr.read()}")
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def __exit__(self, *exc_info) -> None:
        self.process.kill()
        self.process.communicate()  # reaps it and closes both pipes
