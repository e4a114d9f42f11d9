"""The native parts of onecopy: two small C modules on the hot path of a call on bound surfaces.

- src/onecopy/surface/_lockcore.c: a surface lock's in-process state and flocks;
- src/onecopy/runtime/_layout.c: whether a call's arrays are laid out as a kept plan's (numpy's C API).

Everything else is in pyproject.toml; setuptools reads ext_modules only from here."""

import numpy
from setuptools import Extension, setup

WARNINGS = ["-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-Wno-cast-function-type"]

setup(
    ext_modules=[
        Extension("onecopy.surface._lockcore", sources=["src/onecopy/surface/_lockcore.c"],
                  extra_compile_args=["-O2", *WARNINGS]),
        Extension("onecopy.runtime._layout", sources=["src/onecopy/runtime/_layout.c"],
                  include_dirs=[numpy.get_include()], extra_compile_args=["-O2", *WARNINGS]),
    ]
)
