"""The native part of onecopy: the fast path of a surface's lock (src/onecopy/surface/_lockcore.c).

Everything else is in pyproject.toml; setuptools reads ext_modules only from here."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "onecopy.surface._lockcore",
            sources=["src/onecopy/surface/_lockcore.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers",
                                "-Wno-cast-function-type"],
        )
    ]
)
