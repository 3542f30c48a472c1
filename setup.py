"""The optional compiled parts (C, CPython's API only). Everything else is in pyproject.toml.

Each extension is optional: without a C compiler or Python's headers, ``pip install .`` still
succeeds and snaplab runs its pure-Python code, which gives the same answers (slower).
``snaplab --version`` says which is in use."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("snapshot_lab.frames._scan", ["snapshot_lab/frames/_scan.c"], optional=True),
        Extension("snapshot_lab.load._decode", ["snapshot_lab/load/_decode.c"], optional=True),
        # the allocator model's replay (metrics/allocator/native.py picks it or model.py)
        Extension(
            "snapshot_lab.metrics.allocator._replay", ["snapshot_lab/metrics/allocator/_replay.c"], optional=True
        ),
    ]
)
