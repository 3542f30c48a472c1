"""Across files: two dumps of one job (diff), the ranks of one job, limits for CI (check)."""
