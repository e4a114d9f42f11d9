"""The native parts of onecopy: three small C modules on the hot path of a call on bound surfaces.

- src/onecopy/surface/_lockcore.c: a surface lock's in-process state and flocks;
- src/onecopy/runtime/_layout.c: whether a call's arrays are laid out as a kept plan's (numpy's C API);
- src/onecopy/delegate/_frame_run.c: a planned engine call on bound surfaces, run whole (locks, engine, record).

Everything else is in pyproject.toml; setuptools reads ext_modules only from here."""

import numpy
from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-Wno-cast-function-type"]

setup(
    ext_modules=[
        Extension("onecopy.surface._lockcore", sources=["src/onecopy/surface/_lockcore.c"],
                  depends=["src/onecopy/surface/_lockcore.h"], extra_compile_args=["-O2", *WARNINGS]),
        Extension("onecopy.delegate._frame_run", sources=["src/onecopy/delegate/_frame_run.c"],
                  depends=["src/onecopy/surface/_lockcore.h"], extra_compile_args=["-O2", *WARNINGS]),
        Extension("onecopy.runtime._layout", sources=["src/onecopy/runtime/_layout.c"],
                  include_dirs=[numpy.get_include()], extra_compile_args=["-O2", *WARNINGS]),
    ]
)
