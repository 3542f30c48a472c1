"""The optional compiled replay of the allocator model (``snapshot_lab/metrics/allocator/_replay.c``).

Everything else is in pyproject.toml. The extension is optional: without a C compiler or
Python's headers the build skips it and snaplab runs its pure-Python model, with the same
results (``snapshot_lab.metrics.allocator.native`` says which path is in use).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "snapshot_lab.metrics.allocator._replay",
            sources=["snapshot_lab/metrics/allocator/_replay.c"],
            optional=True,
            extra_compile_args=["-O2"] if __import__("os").name == "posix" else [],
        )
    ]
)
