"""Allocator what-if: the model reproduces real runs, and predicts other settings' real runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_USAGE
from snapshot_lab.metrics.allocator.model import AllocatorSettings, allocation_size, round_size
from snapshot_lab.metrics.allocator.whatif import analyse_whatif, apply_conf, recorded_settings, settings_label

from .conftest import SAMPLES, sample_names, sample_path, sample_truth

runner = CliRunner()
MiB = 2**20
SETTINGS = ("default", "expandable", "maxsplit", "roundup", "gc")
CAPS = json.loads((SAMPLES / "whatif_caps.json").read_text())["caps"]


def _cap(name: str) -> int | None:
    workload = sample_truth(name)["workload"]
    return workload.get("memory_cap_bytes", workload.get("cap_bytes"))


# --------------------------------------------------------------------------- the model's rules


@pytest.mark.parametrize(
    ("size", "divisions", "expected"),
    [
        (100, 0, 512),
        (512, 0, 512),
        (513, 0, 1024),
        (1048577, 0, 1049088),
        # torch 2.11 with roundup_power2_divisions:4 (measured, see SNAPSHOT_FORMAT.md section 8)
        (1048577, 4, 1310720),
        (15728647, 4, 16777216),
        (20971521, 4, 25165824),
        (2**24, 4, 2**24),
    ],
)
def test_round_size(size, divisions, expected):
    assert round_size(size, AllocatorSettings(roundup_power2_divisions=(divisions,) * 16)) == expected


def test_allocation_size():
    assert allocation_size(512) == 2 * MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(15 * MiB + 1) == 16 * MiB


def test_apply_conf():
    s = apply_conf(
        AllocatorSettings(), ["expandable_segments:True", "max_split_size_mb:128,roundup_power2_divisions:4"]
    )
    assert s.expandable_segments and s.max_split_size == 128 * MiB and s.roundup_power2_divisions == (4,) * 16
    for bad in (
        "max_split_size_mb:10",
        "garbage_collection_threshold:1.5",
        "roundup_power2_divisions:3",
        "nonsense:1",
        "expandable_segments:maybe",
        "novalue",
    ):
        with pytest.raises(ValueError):
            apply_conf(AllocatorSettings(), [bad])


# --------------------------------------------------------------------------- replay check on real runs

# private pools are not modelled: a CUDA graph's, and a MemPool's (issue #37's pool_* recordings)
REPLAYABLE = [n for n in sample_names() if n not in ("state_only", "cuda_graph") and not n.startswith("pool_")]


@pytest.mark.parametrize("name", REPLAYABLE)
def test_replay_reproduces_every_real_run(real_frames, name):
    """Under the recorded settings, the model ends with the snapshot's segments: same reserved
    bytes, same segments, same blocks in each, every device."""
    fr = real_frames(name)
    limit = _cap(name)
    if fr.info.capture and fr.info.capture.get("oom"):
        limit = fr.info.capture["oom"]["limit_bytes"]
    for dev in fr.info.devices:
        w = analyse_whatif(fr, dev, [], limit)
        assert w.replay_check.exact, (name, dev, w.replay_check.reasons)
        truth = sample_truth(name)["memory_stats"][str(dev)]
        assert w.replay_check.replayed_reserved_bytes == truth["reserved_bytes.all.current"]


@pytest.mark.parametrize(
    "name", ["ring_wrapped", "twin_wrapped", "twin_expandable_wrapped", "late_gpt2_python", "bulk_release_python"]
)
def test_traces_that_start_mid_run_replay_from_the_rebuilt_start(real_frames, name):
    """A ring buffer that wrapped, or recording started after the model was built: the state at
    the trace's first event is rebuilt backwards from the dump, and the replay ends exactly on
    the snapshot (issue #12, section 5)."""
    check = analyse_whatif(real_frames(name), 0, [], None).replay_check
    assert check.exact, check.reasons
    assert check.start.startswith("rebuilt from the snapshot backwards")


def test_wrapped_twin_replays_like_its_complete_recording(real_frames):
    """The same deterministic job, recorded completely and with a 2,500-entry ring buffer: both
    replays end on the same state, and each on its own snapshot."""
    for kind in ("twin", "twin_expandable"):
        complete = analyse_whatif(real_frames(f"{kind}_complete"), 0, [], None).replay_check
        wrapped = analyse_whatif(real_frames(f"{kind}_wrapped"), 0, [], None).replay_check
        assert complete.exact and wrapped.exact
        assert complete.start.startswith("empty")
        assert wrapped.replayed_reserved_bytes == complete.replayed_reserved_bytes
        assert wrapped.replayed_segments == complete.replayed_segments


def test_replay_says_what_it_does_not_model(real_frames):
    graph = analyse_whatif(real_frames("cuda_graph"), 0, [], None).replay_check
    assert not graph.exact and any("private pools" in r for r in graph.reasons)


# --------------------------------------------------------------------------- predicting other runs


@pytest.mark.parametrize("cap", ["uncapped", "capA", "capB"])
def test_default_trace_predicts_each_settings_run(real_frames, cap):
    """The same deterministic job recorded under five settings and three memory limits: replaying
    the default run's complete trace under each setting and limit predicts that run's reserved
    bytes (peak, and at the end or at its OOM) within 1% and its OOM outcome exactly."""
    fr = real_frames("whatif_default_uncapped")
    scenarios = [recorded_settings(real_frames(f"whatif_{k}_uncapped").info.allocator_settings) for k in SETTINGS]
    limit = None if cap == "uncapped" else CAPS[cap]
    w = analyse_whatif(fr, 0, scenarios, limit, True)
    for k, sc in zip(SETTINGS, w.scenarios, strict=True):
        truth = sample_truth(f"whatif_{k}_{cap}")
        stats = truth["memory_stats"]["0"]
        assert bool(sc.ooms) == bool(truth["workload"].get("oom_observed")), k
        assert sc.final_reserved_bytes == pytest.approx(stats["reserved_bytes.all.current"], rel=0.01), k
        assert sc.peak_reserved_bytes == pytest.approx(stats["reserved_bytes.all.peak"], rel=0.01), k


@pytest.mark.parametrize("cap", ["capA", "capB"])
def test_every_trace_predicts_the_oom_outcomes(real_frames, cap):
    """Each of the five complete traces, replayed under every setting and limit, gets every run's
    OOM outcome right (a trace that itself ends in an OOM says nothing of what came after)."""
    scenarios = [recorded_settings(real_frames(f"whatif_{k}_uncapped").info.allocator_settings) for k in SETTINGS]
    for src in SETTINGS:
        w = analyse_whatif(real_frames(f"whatif_{src}_uncapped"), 0, scenarios, CAPS[cap], True)
        for k, sc in zip(SETTINGS, w.scenarios, strict=True):
            assert bool(sc.ooms) == bool(sample_truth(f"whatif_{k}_{cap}")["workload"].get("oom_observed")), (src, k)


GC_SETTINGS = ("default", "gc06", "gc08", "split64gc06", "split128gc08")
GC_CAPS = json.loads((SAMPLES / "gcwhatif_caps.json").read_text())["caps"]


@pytest.mark.parametrize("cap", ["uncapped", "capH", "capM", "capL"])
def test_garbage_collection_runs_are_predicted(real_frames, cap):
    """Hold-out for issue #12, section 2: another deterministic GPT-2 job (other widths, lengths
    and batch than the family above) under garbage_collection_threshold 0.6 and 0.8, alone and
    with max_split_size_mb, under three per-process caps. The default run's trace predicts each
    run's peak and final reserved bytes within 1% and its OOM outcome exactly."""
    fr = real_frames("gcwhatif_default_uncapped")
    scenarios = [recorded_settings(real_frames(f"gcwhatif_{k}_uncapped").info.allocator_settings) for k in GC_SETTINGS]
    assert scenarios[1].garbage_collection_threshold == 0.6 and scenarios[4].max_split_size == 128 * MiB
    limit = None if cap == "uncapped" else GC_CAPS[cap]
    w = analyse_whatif(fr, 0, scenarios, limit)
    for k, sc in zip(GC_SETTINGS, w.scenarios, strict=True):
        truth = sample_truth(f"gcwhatif_{k}_{cap}")
        stats = truth["memory_stats"]["0"]
        assert bool(sc.ooms) == bool(truth["workload"].get("oom_observed")), k
        assert sc.final_reserved_bytes == pytest.approx(stats["reserved_bytes.all.current"], rel=0.01), k
        assert sc.peak_reserved_bytes == pytest.approx(stats["reserved_bytes.all.peak"], rel=0.01), k


def test_garbage_collection_runs_only_under_a_cap(real_frames):
    """The allocator garbage-collects only under a per-process cap: the same limit taken as the
    device's capacity changes nothing for garbage_collection_threshold."""
    fr = real_frames("gcwhatif_default_uncapped")
    gc = apply_conf(AllocatorSettings(), ["garbage_collection_threshold:0.6"])
    capped = analyse_whatif(fr, 0, [gc], GC_CAPS["capH"], limit_is_cap=True).scenarios[0]
    device = analyse_whatif(fr, 0, [gc], GC_CAPS["capH"], limit_is_cap=False).scenarios[0]
    plain = analyse_whatif(fr, 0, [AllocatorSettings()], GC_CAPS["capH"], limit_is_cap=False).scenarios[0]
    assert device.peak_reserved_bytes == plain.peak_reserved_bytes
    assert capped.cuda_free_calls > device.cuda_free_calls


def test_a_retry_that_succeeded_is_not_an_empty_cache_call(real_frames):
    """whatif_default_capB's trace holds an out-of-memory retry that freed the cache and then got
    its segment: the allocator's doing, which a setting that avoids the retry does not repeat."""
    from snapshot_lab.metrics.allocator.releases import find_releases

    fr = real_frames("whatif_default_capB")
    causes = [r.cause for r in find_releases(fr, 0)]
    assert "empty_cache" not in causes and causes
    limit = sample_truth("whatif_default_capB")["workload"]["memory_cap_bytes"]
    from snapshot_lab.metrics.allocator.whatif import _program, _replay

    base = recorded_settings(fr.info.allocator_settings)
    *_, explicit = _replay(_program(fr, 0), base, limit)
    assert explicit == set()
    # the explicit empty_cache() calls of a real loop are the program's, seen in their stacks
    assert {r.cause for r in find_releases(real_frames("empty_cache_churn"), 0)} == {"empty_cache"}


def test_fragmentation_oom_is_avoided_by_expandable_segments(real_frames):
    fr = real_frames("oom_fragmentation")
    limit = sample_truth("oom_fragmentation")["workload"]["memory_cap_bytes"]
    base = recorded_settings(fr.info.allocator_settings)
    w = analyse_whatif(fr, 0, [base, apply_conf(base, ["expandable_segments:True"])], limit, True)
    recorded, expandable = w.scenarios
    assert recorded.ooms and recorded.recorded_oom_avoided is False
    assert not expandable.ooms and expandable.recorded_oom_avoided is True


# --------------------------------------------------------------------------- command line


def test_whatif_cli_json():
    r = runner.invoke(
        app, ["whatif", str(sample_path("whatif_default_uncapped")), "--json", "--set", "expandable_segments:True"]
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    (dev,) = out["devices"]
    assert out["replay_check"] == dev["replay_check"] and out["scenarios"] == dev["scenarios"]
    assert dev["replay_check"]["exact"] is True
    _, scenario = dev["scenarios"]
    assert scenario["settings"]["expandable_segments"] is True
    truth = sample_truth("whatif_expandable_uncapped")["memory_stats"]["0"]
    assert scenario["peak_reserved_bytes"] == pytest.approx(truth["reserved_bytes.all.peak"], rel=0.01)
    assert set(scenario) >= {
        "settings",
        "peak_reserved_bytes",
        "final_reserved_bytes",
        "final_allocated_bytes",
        "cuda_malloc_calls",
        "alloc_retries",
        "ooms",
    }


def test_whatif_grid_and_text():
    r = runner.invoke(app, ["whatif", str(sample_path("oom_fragmentation"))])
    assert r.exit_code == 0
    assert "replay check under the recorded settings: exact" in r.stdout
    assert "expandable_segments:True" in r.stdout


@pytest.mark.parametrize("args", [["--set", "max_split_size_mb:5"], ["--memory-limit", "lots"], ["--set", "x"]])
def test_whatif_usage_errors(args):
    r = runner.invoke(app, ["whatif", str(sample_path("cnn_clean")), *args])
    assert r.exit_code == EXIT_USAGE and r.stderr.startswith("snaplab: error:")


def test_report_names_the_better_setting(tmp_path):
    html = api.report(sample_path("transformer_varlen"), output=tmp_path / "r.html").read_text()
    assert "allocator-settings" in html and "expandable_segments:True" in html
    assert "Other allocator settings (what-if)" in html and "exact" in html
    # an OOM under a per-process cap the snapshot does not record: the claim is made under a
    # stated assumption (the cap inferred as the peak reserved before the OOM)
    oom = api.report(sample_path("oom_fragmentation"), output=tmp_path / "o.html").read_text()
    assert "allocator-settings" in oom and "This assumes a per-process cap of" in oom


def test_defaults_without_settings_include_the_plain_defaults(real_frames):
    """Issue #12, section 6: --defaults with no --set compares PyTorch's plain defaults too when
    the recording used other settings (whatif_gc_uncapped ran with garbage_collection_threshold)."""
    r = runner.invoke(app, ["whatif", str(sample_path("whatif_gc_uncapped")), "--defaults", "--json"])
    assert r.exit_code == 0, r.output
    labels = [settings_label(s["settings"]) for s in json.loads(r.stdout)["scenarios"]]
    assert labels[0] == "garbage_collection_threshold:0.6" and "(defaults)" in labels[1:]


def test_an_oom_under_an_unrecorded_cap_gets_a_labelled_grid(real_frames):
    """Issue #12, section 6: oom_fragmentation ran under set_per_process_memory_fraction, which the
    snapshot does not record (the device had room). The grid runs anyway under the inferred cap,
    labelled as such, and the OOM finding names the settings that served the failing request."""
    from snapshot_lab.metrics import compute_stats
    from snapshot_lab.metrics.diagnose import diagnose

    fr = real_frames("oom_fragmentation")
    dg = diagnose(fr, compute_stats(fr), False)
    w = dg.whatifs[0]
    assert w.memory_limit_inferred and w.memory_limit_source.startswith("inferred")
    true_cap = sample_truth("oom_fragmentation")["workload"]["memory_cap_bytes"]
    assert w.memory_limit_bytes <= true_cap  # no round size between the bounds: the peak reserved
    (oom,) = [f for f in dg.findings if f.id == "oom-fragmentation"]
    assert "expandable_segments:True" in oom.evidence["settings_that_serve_the_request"]
    assert "assuming it was" in oom.advice and oom.evidence["memory_limit_inferred"] is True


RETRY_SETTINGS = ("default", "gc06", "gc08", "split64gc06")
RETRY_CAPS = json.loads((SAMPLES / "gcretry_caps.json").read_text())["caps"]


@pytest.mark.parametrize(("source", "cap"), [*[("uncapped", c) for c in sorted(RETRY_CAPS)], ("cap990", "cap990")])
def test_runs_whose_retries_succeeded_are_predicted(real_frames, source, cap):
    """Issue #12, section 2. Caps just under the default run's peak: at cap990 the default run
    survives three out-of-memory retries, garbage_collection_threshold:0.6 survives without any,
    0.8 runs out. Replaying the default run's trace (uncapped, or the capped one with its retries)
    under each setting predicts peak and final reserved bytes within 1%, the retries and the OOM
    outcome. The simpler rule "frees then a new segment without GC or max_split_size are an
    empty_cache() call" replays the capped trace's retries as empty_cache() calls and predicts a
    final reserved 32% below the real GC 0.6 run (1,746 MiB for 2,564 MiB)."""
    fr = real_frames(f"gcretry_default_{source}")
    scenarios = [
        recorded_settings(real_frames(f"gcretry_{k}_uncapped").info.allocator_settings) for k in RETRY_SETTINGS
    ]
    w = analyse_whatif(fr, 0, scenarios, RETRY_CAPS[cap])
    for k, sc in zip(RETRY_SETTINGS, w.scenarios, strict=True):
        truth = sample_truth(f"gcretry_{k}_{cap}")
        stats = truth["memory_stats"]["0"]
        assert bool(sc.ooms) == bool(truth["workload"].get("oom_observed")), k
        assert sc.alloc_retries == stats["num_alloc_retries"], k
        assert sc.final_reserved_bytes == pytest.approx(stats["reserved_bytes.all.current"], rel=0.01), k
        assert sc.peak_reserved_bytes == pytest.approx(stats["reserved_bytes.all.peak"], rel=0.01), k
    if cap == "cap990":
        assert sample_truth("gcretry_default_cap990")["memory_stats"]["0"]["num_alloc_retries"] == 3
        assert not w.scenarios[0].ooms and not w.scenarios[1].ooms and w.scenarios[2].ooms
