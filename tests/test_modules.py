"""Memory by module (issue #16): exact from module tags, approximate from stacks, and the totals
add up to the bytes allocated at the peak.

Truth: the GPU job (sample_snapshots/jobs/integrations_gpu.py) replayed each tagged snapshot's
trace with plain Python and stored the live bytes per tag at the peak (``live_bytes_per_tag_at_peak``,
the 25 largest) and the peak (``peak_live_bytes_in_trace``, checked there against torch's own
requested-bytes peak). Three models, two stack modes: GPT-2 with Python stacks; the hold-outs, a
Llama with activation checkpointing and C++ stacks (``stacks='all'``), whose backward runs with
autograd frames where GPT-2's has none, and a ResNet-50 (BatchNorm, in-place ReLU, SGD) tagged
process-wide as ``snaplab run`` does (``ResNet.layer1.0.conv1``: no root module ``''``). The
untagged twins are the same runs without tags.
"""

from __future__ import annotations

import json

import pytest

from snapshot_lab import SnapshotFormatError, api, load_frames
from snapshot_lab.metrics.attribution.modules import BEFORE_ROW, OUTSIDE_ROW, UNKNOWN_BACKWARD, module_breakdown
from snapshot_lab.metrics.comparison.compare import diff_summaries
from snapshot_lab.module_tags import NEEDS, parse_tag

from .conftest import block, event, make_snapshot, sample_path, sample_truth, segment

# three families, two stack modes, both ways of naming modules (model-relative and process-wide)
TAGGED = ["modtags_gpt2_python", "modtags_llama_ckpt_all", "modtags_resnet50_process"]
FRAMEWORKS = ["hf_trainer_end", "lightning_fit_end", "hf_trainer_step3", "lightning_fit_step6"]


@pytest.mark.parametrize("name", TAGGED)
def test_every_tag_at_the_peak_equals_the_replayed_truth(real_frames, name):
    w = sample_truth(name)["workload"]
    mb = module_breakdown(real_frames(name), 0)
    assert mb.source == "tags"
    assert mb.peak_bytes == w["peak_live_bytes_in_trace"]
    assert mb.outside_bytes == w["outside_any_module_at_peak"]
    rows = {r.module: r for r in mb.rows}
    checked = 0
    for tag, truth in w["live_bytes_per_tag_at_peak"].items():
        if tag == "":
            continue
        phase, fqn = parse_tag(tag)
        assert rows[fqn].by_phase.get(phase, 0) == truth, tag
        checked += 1
    assert checked >= 12


@pytest.mark.parametrize("name", TAGGED + FRAMEWORKS)
def test_modules_plus_outside_plus_before_the_trace_equal_the_peak(real_frames, name):
    mb = module_breakdown(real_frames(name), 0)
    assert mb.source == "tags"  # the Lightning and HF callbacks tag too
    assert mb.module_bytes + mb.outside_bytes + mb.before_trace_bytes == mb.peak_bytes
    assert mb.module_bytes > 0 and mb.phase_totals["fwd"] > 0 and mb.phase_totals["bwd"] > 0
    assert sum(sum(r.by_phase.values()) for r in mb.rows) == mb.module_bytes  # every tag snaplab wrote has a phase
    assert sum(sum(r.by_category.values()) for r in mb.rows) == mb.module_bytes


def test_inclusive_bytes_nest_and_the_root_holds_every_module(real_frames):
    mb = module_breakdown(real_frames("modtags_gpt2_python"), 0)
    rows = {r.module: r for r in mb.rows}
    assert rows[""].inclusive_bytes == mb.module_bytes  # tag_modules(model): '' is the model
    block0 = rows["transformer.h.0"]
    inside = [r for n, r in rows.items() if n.startswith("transformer.h.0.")]
    assert block0.inclusive_bytes == block0.self_bytes + sum(r.self_bytes for r in inside)
    assert rows["transformer.h.0.mlp.act"].depth == 5 and rows["transformer"].depth == 1 and rows[""].depth == 0
    assert rows["transformer.h.0.mlp.act"].self_bytes == 88080384  # the job replayed tag fwd:transformer.h.0.mlp.act
    # its own peak (over the whole trace) is above what is alive at the global peak
    assert rows["transformer.h.0.mlp.act"].peak_bytes > rows["transformer.h.0.mlp.act"].self_bytes


@pytest.mark.parametrize(("untagged", "tagged"), [(f"{t}_untagged", t) for t in TAGGED])
def test_without_tags_the_stacks_give_an_approximation_that_adds_up(real_frames, untagged, tagged):
    """A simpler rule, 'backward = allocations on autograd's thread', breaks on GPT-2 with Python
    stacks: autograd's thread records no frames at all there, and its 192 MiB of backward
    buffers would count as outside any module. Counting stackless allocations as backward
    too gives the tagged twin's 'outside any module' exactly, in both stack modes."""
    mb = module_breakdown(real_frames(untagged), 0)
    twin = module_breakdown(real_frames(tagged), 0)
    assert mb.source == "stacks" and mb.to_dict()["approximate"] is True
    assert "Approximated from the stacks" in mb.note
    assert mb.module_bytes + mb.outside_bytes + mb.before_trace_bytes == mb.peak_bytes
    assert mb.peak_bytes == twin.peak_bytes
    assert mb.outside_bytes == twin.outside_bytes
    rows = {r.module: r for r in mb.rows}
    assert rows[UNKNOWN_BACKWARD].self_bytes > 0 and set(rows[UNKNOWN_BACKWARD].by_phase) == {"bwd"}
    forward_lines = [r for r in mb.rows if r.module != UNKNOWN_BACKWARD]
    assert forward_lines and all(" in forward" in r.module for r in forward_lines)


def test_older_torch_says_what_per_module_attribution_needs(tmp_path):
    """No user_metadata key at all (torch < 2.10): the note says what is needed."""
    st = [{"filename": "train.py", "line": 3, "name": "step"}]
    snap = make_snapshot(
        [segment(0x1000, [block(1 << 20, frames=st)])],
        [[event("alloc", 0x1000, 1 << 20, 1, st), event("alloc", 0x1000 + (1 << 20), 512, 2, st)]],
    )
    p = tmp_path / "old.pickle"
    p.write_bytes(__import__("pickle").dumps(snap))
    mb = module_breakdown(load_frames(p), 0)
    assert mb.source == "stacks" and NEEDS in mb.note
    assert mb.outside_bytes == (1 << 20) + 512 and mb.rows == ()


def _tagged_snapshot(tags: list[object]) -> dict:
    st = [{"filename": "train.py", "line": 3, "name": "step"}]
    trace = [event("alloc", 0x1000 + i * 4096, 1024 * (i + 1), i, st, user_metadata=t) for i, t in enumerate(tags)]
    live = [block(4096, requested=1024 * (i + 1), frames=st) for i in range(len(tags))]
    rest = block((1 << 20) - 4096 * len(tags), state="inactive", frames=[])
    return make_snapshot([segment(0x1000, [*live, rest])], [trace])


def test_the_programs_own_metadata_is_a_row_of_its_own_and_hostile_names_are_escaped(tmp_path):
    tags = ["fwd:enc.<script>alert(1)</script>", "my own label", "", "bwd:enc"]
    p = tmp_path / "m.pickle"
    p.write_bytes(__import__("pickle").dumps(_tagged_snapshot(tags)))
    mb = module_breakdown(load_frames(p), 0)
    rows = {r.module: r for r in mb.rows}
    assert rows["metadata 'my own label'"].self_bytes == 2048 and rows["metadata 'my own label'"].by_phase == {}
    assert rows["enc"].by_phase == {"bwd": 4096}
    assert rows["enc.<script>alert(1)</script>"].self_bytes == 1024
    assert rows["enc"].inclusive_bytes == 4096 + 1024  # the hostile name is still a child of 'enc'
    assert mb.outside_bytes == 3072 and mb.module_bytes + mb.outside_bytes == mb.peak_bytes == 10240
    html = api.report(p, output=tmp_path / "r.html").read_text()
    assert "<script>alert(1)</script>" not in html and "enc.&lt;script&gt;alert(1)&lt;/script&gt;" in html


@pytest.mark.parametrize("bad", [3, None, ["fwd:x"], {"a": 1}])
def test_user_metadata_of_another_type_is_refused_naming_the_entry(tmp_path, bad):
    p = tmp_path / "bad.pickle"
    p.write_bytes(__import__("pickle").dumps(_tagged_snapshot(["fwd:a", "fwd:b", bad])))
    with pytest.raises(SnapshotFormatError) as ei:
        load_frames(p)
    assert "device_traces[0][2].user_metadata: expected a string" in ei.value.reason


def test_stats_json_report_and_diff_carry_the_module_view(tmp_path):
    tagged, llama = sample_path("modtags_gpt2_python"), sample_path("modtags_llama_ckpt_all")
    st = api.stats(tagged).to_dict()
    m = st["devices"]["0"]["modules"]
    assert m["source"] == "tags" and m["peak_bytes"] == 1186389064
    assert m["module_bytes_at_peak"] + m["outside_any_module_bytes_at_peak"] == 1186389064
    assert {r["module"] for r in m["modules"]} >= {"", "transformer.h.3.mlp.act", "lm_head"}
    json.dumps(st)  # plain JSON
    cell = api.stats(tagged)._repr_html_()  # a notebook shows the largest modules too
    assert "transformer.h.0.mlp.act" in cell and "outside any module" in cell
    html = api.report(tagged, output=tmp_path / "r.html").read_text()
    assert "Memory by module at the peak</h3>" in html and "transformer.h.0.mlp.act" in html
    untagged_html = api.report(sample_path("modtags_gpt2_python_untagged"), output=tmp_path / "u.html").read_text()
    assert "Memory by module at the peak (approximate)</h3>" in untagged_html
    d = api.diff(tagged, llama)
    assert d.modules_source == "tags"
    moved = {c.site: c for c in d.modules}
    assert moved["transformer.h.0.mlp.act"].status == "gone" and moved["model.rotary_emb"].status == "new"
    assert moved[OUTSIDE_ROW].before_bytes == 204828676 and moved[OUTSIDE_ROW].after_bytes == 242301188


def test_module_diff_adds_up_to_the_change_of_the_peak(real_frames):
    from snapshot_lab.metrics import compute_stats
    from snapshot_lab.metrics.comparison.compare import summarize
    from snapshot_lab.metrics.diagnose import diagnose

    sums = []
    for name in ("modtags_gpt2_python", "modtags_llama_ckpt_all"):
        fr = real_frames(name)
        stats = compute_stats(fr)
        sums.append(summarize(fr, stats, diagnose(fr, stats, with_category_timelines=False)))
    d = diff_summaries(sums[0], sums[1], limit=10_000)
    assert sum(c.delta_bytes for c in d.modules) == sums[1].peak_requested_bytes - sums[0].peak_requested_bytes
    assert BEFORE_ROW not in sums[0].peak_modules  # both built their model inside the recording


def test_anomaly_mode_forward_stacks_name_backward_sites_and_modules(real_frames):
    """grad_anomaly_python (MLP, AdamW, Python stacks, autograd anomaly mode): autograd's thread
    records no frames, so without the forward stacks every gradient is '<no stack recorded:
    gradient>' and its bytes 'backward, module unknown'. The forward stack torch >= 2.11 keeps
    for each node names the user's line that ran the forward, and the Linear's forward."""
    from snapshot_lab.metrics.categories import categorize
    from snapshot_lab.metrics.comparison.compare import site_table

    fr = real_frames("grad_anomaly_python")
    truth = sample_truth("grad_anomaly_python")["workload"]
    sites = site_table(fr).set_index("site")["bytes"]
    grads = "backward of main/sample_snapshots/workloads_holdout.py:257 in grad_anomaly"
    assert grads in sites.index and not any(s.startswith("<no stack recorded") for s in sites.index)
    b = fr.blocks[fr.blocks["state"] == "active_allocated"]
    cats = categorize(fr).block_category[b.index]
    from snapshot_lab.metrics.attribution.sites import block_forward_ids, site_labels, snapshot_sites

    labels, _ = site_labels(
        b["stack_id"].to_numpy(dtype="int64", na_value=-1),
        snapshot_sites(fr),
        cats.to_numpy(object),
        block_forward_ids(b),
    )
    assert int(b["size_bytes"][(labels == grads) & (cats == "gradient").to_numpy()].sum()) == truth["grad_bytes"]
    mb = module_breakdown(fr, 0)
    rows = {r.module: r for r in mb.rows}
    assert rows[UNKNOWN_BACKWARD].self_bytes == 0  # at the peak every backward byte has its forward line
    linear = rows["nn/modules/linear.py:134 in forward"]
    assert linear.by_phase["bwd"] > 0 and linear.by_phase["fwd"] > 0
    assert mb.module_bytes + mb.outside_bytes + mb.before_trace_bytes == mb.peak_bytes


def test_site_labels_name_a_backward_allocation_after_its_forward_site():
    """The composition rules of site_labels, for every kind of base label."""
    import numpy as np
    import pandas as pd

    from snapshot_lab.metrics.attribution.sites import StackSites, site_labels

    table = pd.DataFrame(
        {
            "label": ["AddmmBackward0 (backward)", "train.py:9 in step", "model.py:3 in forward"],
            "detail": ["aten::mm", "", ""],
            "filename": ["", "train.py", "model.py"],
            "line": [0, 9, 3],
            "name": ["", "step", "forward"],
        },
        index=[0, 1, 2],
    )
    sites = StackSites(table)
    sid = np.array([0, 1, -1, -1, 0])
    fwd = np.array([2, 2, 2, -1, -1])
    cats = np.array([None, None, "gradient", "gradient", None], dtype=object)
    labels, detail = site_labels(sid, sites, cats, fwd)
    assert list(labels) == [
        "AddmmBackward0 (backward) of model.py:3 in forward",
        "train.py:9 in step",  # a user frame of its own names it best
        "backward of model.py:3 in forward",
        "<no stack recorded: gradient>",
        "AddmmBackward0 (backward)",
    ]
    assert list(detail) == ["aten::mm", "", "", "", "aten::mm"]


def test_site_codes_number_the_labels_as_factorizing_them_does(real_frames):
    """The explorer's site codes, worked out on the distinct labels, against pd.factorize of
    site_labels' string per allocation: two stacks with one label, a stackless allocation whose
    category label is also a stack's, stack ids without a site; then a real recording."""
    import numpy as np
    import pandas as pd

    from snapshot_lab.metrics.attribution.sites import StackSites, site_codes, site_labels, snapshot_sites
    from snapshot_lab.metrics.categories import CODES, categorize
    from snapshot_lab.metrics.history.lifetimes import device_lifetimes

    table = pd.DataFrame(
        {
            "label": [
                "model.py:3 in forward",
                "train.py:9 in step",
                "model.py:3 in forward",
                "<no stack recorded: other>",
            ],
            "detail": ["", "", "", ""],
            "filename": ["model.py", "train.py", "model.py", ""],
            "line": [3, 9, 3, 0],
            "name": ["forward", "step", "forward", ""],
        },
        index=[10, 11, 12, 13],
    )
    sites = StackSites(table)
    names = ("gradient", "other")
    sid = np.array([11, -1, 12, 10, 99, 13, -1, 11])
    cat = np.array([0, 1, 0, 0, 0, 1, 0, 1])
    codes, labels = site_codes(sid, sites, cat, names)
    want_codes, want_labels = pd.factorize(pd.Series(site_labels(sid, sites, np.array(names, dtype=object)[cat])[0]))
    assert codes.tolist() == want_codes.tolist() == [0, 1, 2, 2, 3, 1, 3, 0]
    assert labels.tolist() == list(want_labels)
    fr = real_frames("transformer_varlen")
    lt = device_lifetimes(fr, 0)
    labelled = categorize(fr)
    cat = np.where(labelled.alloc_codes[0] < 0, CODES["other"], labelled.alloc_codes[0]).astype(np.int64)
    sid = lt["stack_id"].to_numpy(dtype=np.int64, na_value=-1)
    codes, labels = site_codes(sid, snapshot_sites(fr), cat, labelled.names)
    strings = site_labels(sid, snapshot_sites(fr), np.array(labelled.names, dtype=object)[cat])[0]
    want_codes, want_labels = pd.factorize(pd.Series(strings))
    assert len(labels) >= 8 and codes.tolist() == want_codes.tolist() and labels.tolist() == list(want_labels)
