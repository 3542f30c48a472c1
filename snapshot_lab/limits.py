"""Defaults that bound the size of an output, in a module that imports nothing: the command line
reads them when it defines its options, before any analysis is imported."""

from __future__ import annotations

DEFAULT_MAX_SLICES = 10_000  # allocation slices per device in a Perfetto trace
