"""Parallel jobs: which strategy a snapshot came from, the rank's place, and pipeline stages."""
