"""diff: the rows that share a site label are one row, the bytes and blocks of its call paths
summed, and the headline speaks of that row (a line reached through many call paths, such as a
forward hook of every layer, is one line that grew by the sum, not fifteen lines)."""

from __future__ import annotations

from collections import Counter

import pytest

from snapshot_lab import api
from snapshot_lab.metrics.comparison.compare import diff_summaries
from snapshot_lab.render.compare import format_diff

from .conftest import sample_path

HF_LINE = "sample_snapshots/jobs/integrations_gpu.py:327 in transformers_part"


@pytest.fixture(scope="module")
def hf_pair():
    """Two dumps of one Hugging Face Trainer job (step 3 and the end): its training line is
    reached through 8 call paths (8 site rows in the first file, 4 in the second)."""
    return api.summarize_file(sample_path("hf_trainer_step3")), api.summarize_file(sample_path("hf_trainer_end"))


def _sum(rows, site, key):
    return sum(r[key] for r in rows if r["site"] == site)


def test_a_label_on_several_rows_is_one_row_with_the_sums(hf_pair):
    before, after = hf_pair
    paths = {r["detail"] for r in [*before.sites, *after.sites] if r["site"] == HF_LINE}
    assert len(paths) == 8 and Counter(r["site"] for r in before.sites)[HF_LINE] == 8
    d = diff_summaries(before, after)
    assert Counter(s.site for s in d.sites)[HF_LINE] == 1
    (row,) = [s for s in d.sites if s.site == HF_LINE]
    assert row.paths == 8
    assert (row.before_bytes, row.after_bytes) == (
        _sum(before.sites, HF_LINE, "bytes"),
        _sum(after.sites, HF_LINE, "bytes"),
    )
    assert (row.before_bytes, row.after_bytes) == (64_593_408, 64_559_104)
    assert (
        (row.before_blocks, row.after_blocks)
        == (93, 86)
        == (
            _sum(before.sites, HF_LINE, "blocks"),
            _sum(after.sites, HF_LINE, "blocks"),
        )
    )
    assert row.delta_bytes == -34_304 and row.status == "shrunk"
    assert sum(s.delta_bytes for s in d.sites) == sum(r["bytes"] for r in after.sites) - sum(
        r["bytes"] for r in before.sites
    )  # nothing lost in the grouping
    assert f"{HF_LINE} (8 call paths)  shrunk" in format_diff(d)


def test_the_headline_names_the_grown_line_with_all_its_paths():
    """single_mlp -> single_transformer (one script, a larger model): the script's main line is
    reached by 2 call paths; the headline gives their sum."""
    before = api.summarize_file(sample_path("single_mlp"))
    after = api.summarize_file(sample_path("single_transformer"))
    line = "sample_snapshots/jobs/train_parallel.py:581 in main"
    grown = _sum(after.sites, line, "bytes") - _sum(before.sites, line, "bytes")
    assert grown == 315_617_280  # 301.00 MiB
    d = diff_summaries(before, after)
    assert d.sites[0].site == line and d.sites[0].delta_bytes == grown and d.sites[0].paths == 2
    (head,) = [line for line in format_diff(d).splitlines() if line.startswith("Reserved ")]
    assert head.endswith(f"largest growth at {line} (+301.00 MiB over 2 call paths).")
