"""Capture side, without a GPU: the recording logic against a stand-in for torch.

The same code ran for real on H100/H200 GPUs (see sample_snapshots/capture_*.pickle.xz and
test_real_captures below)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from snapshot_lab import api, load_frames, stats
from snapshot_lab.capture import CaptureError, recording, snapshot_name
from snapshot_lab.cli import app

from .fake_torch import FakeTorch

runner = CliRunner()
NAME_RE = re.compile(r"^snapshot_rank(\d+)_([A-Za-z0-9.-]+)_(\d{8}-\d{6})(?:_([a-z0-9]+))?\.pickle$")


def test_names():
    n = snapshot_name("snapshot", 3, "node 7/a", 0.0, "oom")
    assert NAME_RE.match(n) and n.startswith("snapshot_rank3_node-7-a_") and n.endswith("_oom.pickle")


def test_recording_enables_dumps_and_restores(torch, tmp_path):
    with recording(tmp_path, max_entries=1234, stacks="python") as rec:
        assert torch.history_calls[-1] == (
            (),
            {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 1234},
        )
    assert torch.history_calls[-1] == ((), {"enabled": None})  # recording stopped again
    (path,) = rec.written
    assert NAME_RE.match(path.name).group(1) == "0"
    meta = json.loads(path.with_name(path.name.replace(".pickle", ".meta.json")).read_text())
    assert meta["reason"] == "exit" and meta["world_size"] == 1 and meta["torch_version"] == "2.11.0"
    assert meta["memory_stats"]["0"]["reserved_bytes.all.current"] == 2097152
    # what capture wrote is a snapshot snaplab reads, sidecar included
    s = stats(path)
    assert s.torch_stats["reserved_bytes.all.current"] == 2097152
    assert s.file["capture"]["reason"] == "exit"


def test_rank_from_torchrun_environment(torch, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with recording(tmp_path) as rec:
        pass
    assert NAME_RE.match(rec.written[0].name).group(1) == "5"


def test_oom_observer_dumps_once(torch, tmp_path):
    with recording(tmp_path, dump_on_exit=False) as rec:
        (observer,) = torch.observers
        observer(0, 2**34, 80 * 2**30, 1 * 2**30)
        observer(0, 2**34, 80 * 2**30, 1 * 2**30)  # unwinding can OOM again: one dump is enough
    (path,) = rec.written
    assert NAME_RE.match(path.name).group(4) == "oom"
    meta = json.loads(path.with_name(path.name.replace(".pickle", ".meta.json")).read_text())
    assert meta["oom"] == {"device": 0, "alloc_bytes": 2**34, "limit_bytes": 80 * 2**30, "device_free_bytes": 2**30}


def _meta(path):
    return json.loads(path.with_name(path.name.replace(".pickle", ".meta.json")).read_text())


def test_exception_dump_of_an_oom_names_its_incident(torch, tmp_path):
    """The observer's file shows the failing request; the file written after the
    OutOfMemoryError unwound says it is the same incident (issue #12, section 4)."""

    class OutOfMemoryError(RuntimeError):
        pass

    with pytest.raises(OutOfMemoryError), recording(tmp_path) as rec:
        torch.observers[0](0, 2**30, 3 * 2**30, 10 * 2**30)
        raise OutOfMemoryError("CUDA out of memory")
    oom, exc = rec.written
    assert oom.name.endswith("_oom.pickle") and exc.name.endswith("_exception.pickle")
    assert _meta(exc)["incident"] == {"same_as": oom.name, "moment": "after the out-of-memory error unwound"}
    # the limit the OOM happened under travels with it, so the analysis of either file knows it
    assert (
        _meta(exc)["oom"]
        == _meta(oom)["oom"]
        == {
            "device": 0,
            "alloc_bytes": 2**30,
            "limit_bytes": 3 * 2**30,
            "device_free_bytes": 10 * 2**30,
        }
    )
    assert "incident" not in _meta(oom)
    assert _meta(oom)["device_total_bytes"] == {"0": 80 * 2**30}


def test_exception_dump_without_an_oom_names_no_incident(torch, tmp_path):
    with pytest.raises(ValueError), recording(tmp_path) as rec:
        raise ValueError("not a memory error")
    assert "incident" not in _meta(rec.written[0])


def test_run_marks_the_unwound_dump_of_an_oom(torch, tmp_path):
    script = _script(
        tmp_path,
        """
        import torch
        class OutOfMemoryError(RuntimeError):
            pass
        torch._C._observer_for_test(0, 2**30, 3 * 2**30, 10 * 2**30)
        raise OutOfMemoryError("CUDA out of memory")
    """,
    )
    torch.module._C._observer_for_test = lambda *a: torch.observers[0](*a)
    assert api.run(str(script), out=tmp_path / "snaps") == 1
    exc = next((tmp_path / "snaps").glob("*_exception.pickle"))
    oom = next((tmp_path / "snaps").glob("*_oom.pickle"))
    assert _meta(exc)["incident"]["same_as"] == oom.name


def test_every_n_steps(torch, tmp_path):
    with recording(tmp_path, every_n_steps=2, dump_on_exit=False) as rec:
        for _ in range(5):
            rec.step()
    assert [NAME_RE.match(p.name).group(4) for p in rec.written] == ["step2", "step4"]


def test_dump_failure_never_crashes_the_job(tmp_path, monkeypatch, caplog):
    FakeTorch(fail_snapshot=True).install(monkeypatch)
    with recording(tmp_path) as rec:
        assert rec.dump("manual") is None
    assert rec.written == []
    assert "could not write a memory snapshot" in caplog.text


def test_nested_recording_restores_the_outer_settings(torch, tmp_path):
    with recording(tmp_path / "a", max_entries=10, dump_on_exit=False):
        with recording(tmp_path / "b", max_entries=99, dump_on_exit=False):
            pass
        assert torch.history_calls[-1][1]["max_entries"] == 10
    assert torch.history_calls[-1] == ((), {"enabled": None})


def test_torch_20_uses_the_boolean_api(tmp_path, monkeypatch):
    fake = FakeTorch(version="2.0.1")
    fake.install(monkeypatch)
    with recording(tmp_path, max_entries=50, dump_on_exit=False):
        pass
    assert fake.history_calls[0] == ((True,), {"trace_alloc_max_entries": 50, "trace_alloc_record_context": True})
    assert fake.history_calls[-1] == ((False,), {})


def test_decorator_form(torch, tmp_path):
    @recording(tmp_path)
    def train():
        return 42

    assert train() == 42
    assert len(list(tmp_path.glob("*.pickle"))) == 1


@pytest.mark.parametrize("kwargs", [{"stacks": "cpp"}, {"context": "x"}, {"max_entries": 0}, {"every_n_steps": 0}])
def test_bad_arguments(kwargs):
    with pytest.raises(CaptureError):
        recording("x", **kwargs)


def _script(tmp_path, body: str):
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(body))
    return p


def test_run_passes_arguments_and_exit_code(torch, tmp_path):
    script = _script(
        tmp_path,
        """
        import sys
        print("args", sys.argv[1:])
        sys.exit(3)
    """,
    )
    r = runner.invoke(app, ["run", "--out", str(tmp_path / "snaps"), str(script), "--lr", "0.1", "-x"])
    assert r.exit_code == 3
    assert "args ['--lr', '0.1', '-x']" in r.stdout
    assert len(list((tmp_path / "snaps").glob("*.pickle"))) == 1


def test_run_reports_the_programs_exception(torch, tmp_path, capsys):
    script = _script(
        tmp_path,
        """
        def f():
            raise ValueError("boom in training")
        f()
    """,
    )
    code = api.run(str(script), out=tmp_path / "snaps")
    assert code == 1
    assert "ValueError: boom in training" in capsys.readouterr().err
    (p,) = (tmp_path / "snaps").glob("*.pickle")
    assert p.name.endswith("_exception.pickle")


def test_run_module(torch, tmp_path, monkeypatch):
    pkg = tmp_path / "mytrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys; sys.exit(0 if sys.argv[1:] == ['a'] else 9)")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert api.run("mytrain", ["a"], module=True, out=tmp_path / "s") == 0


def test_run_missing_script(torch, tmp_path):
    r = runner.invoke(app, ["run", str(tmp_path / "nope.py")])
    assert r.exit_code == 2 and "no such script" in r.stderr


def test_no_torch_is_one_clear_line(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("print('never runs')")
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from snapshot_lab.cli import main\n"
        f"sys.argv = ['snaplab', 'run', {str(script)!r}]\n"
        "main()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "snaplab: error: recording needs PyTorch with CUDA: pip install torch (snaplab's analysis commands do not "
        "need it)"
    ]
    assert "never runs" not in r.stdout


def test_analysis_never_imports_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import snapshot_lab, snapshot_lab.report, snapshot_lab.cli\n"
        "print(snapshot_lab.stats('sample_snapshots/oom_fragmentation.pickle').oom.cause)\n"
    )
    from .conftest import ROOT

    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "fragmentation"


def test_loader_ignores_broken_sidecar(tmp_path):
    from .conftest import sample_path

    src = sample_path("oom_fragmentation")
    dst = tmp_path / "x.pickle"
    dst.write_bytes(src.read_bytes())
    (tmp_path / "x.meta.json").write_text("{not json")
    assert load_frames(dst).info.capture is None


# --------------------------------------------------------------------------- real captures
# Made on a 2-GPU H200 machine by sample_snapshots/jobs/run_capture_tests.sh: `snaplab run` over a
# GPT-2 job (a snapshot every 2 steps), a job that runs out of memory, and 2-rank DDP under
# torchrun. Their counters are checked against the sidecars' memory_stats in
# test_real_snapshots.py like every sample; here, what capture itself promised.


def test_real_capture_series():
    from .conftest import sample_path, sample_truth

    metas = [
        json.loads((sample_path(n).parent / f"{n}.meta.json").read_text())
        for n in ("capture_single_step2", "capture_single_step4", "capture_single_step6", "capture_single_exit")
    ]
    assert [(m["reason"], m["step"]) for m in metas] == [("step2", 2), ("step4", 4), ("step6", 6), ("exit", 6)]
    assert all(m["rank"] == 0 and m["world_size"] == 1 for m in metas)
    assert metas[0]["argv"][0].endswith("train_single.py")
    # the series is one job: its trace only grows, and stats see the sidecar
    s2, s6 = stats(sample_path("capture_single_step2")), stats(sample_path("capture_single_step6"))
    assert s6.file["trace_entries"] > s2.file["trace_entries"]
    assert s6.file["capture"]["reason"] == "step6"
    truth = sample_truth("capture_single_step6")["memory_stats"]["0"]
    assert truth["reserved_bytes.all.current"] == s6.torch_stats["reserved_bytes.all.current"]


def test_real_capture_oom():
    from .conftest import sample_path

    path = sample_path("capture_oom_rank0")
    meta = json.loads(path.with_name("capture_oom_rank0.meta.json").read_text())
    s = stats(path)
    assert meta["reason"] == "oom" and s.oom is not None
    assert s.oom.cause == "capacity"
    assert s.oom.device_free_bytes == meta["oom"]["device_free_bytes"]
    assert meta["oom"]["limit_bytes"] == 2 * 2**30 - 1 or meta["oom"]["limit_bytes"] == 2 * 2**30


def test_real_capture_ddp_one_file_per_rank_and_the_big_rank_flagged():
    from .conftest import sample_path

    rows, errors = api.ranks([sample_path("capture_ddp_rank0"), sample_path("capture_ddp_rank1")], jobs=1)
    assert errors == {}
    by_rank = {r.rank: r for r in rows}
    assert by_rank[0].summary.devices == [0] and by_rank[1].summary.devices == [1]
    assert by_rank[0].flags == []
    assert any("its peer's" in f for f in by_rank[1].flags)  # rank 1 ran a 3x batch


def test_run_module_from_the_command_line(torch, tmp_path, monkeypatch):
    pkg = tmp_path / "cli_train"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text("import sys; sys.exit(7 if sys.argv[1:] == ['--epochs', '2'] else 9)")
    monkeypatch.syspath_prepend(str(tmp_path))
    r = runner.invoke(app, ["run", "--out", str(tmp_path / "s"), "-m", "cli_train", "--epochs", "2"])
    assert r.exit_code == 7, r.output
    assert len(list((tmp_path / "s").glob("*.pickle"))) == 1


# --------------------------------------------------------------------------- the parallel layout (issue #14)


@pytest.fixture
def declared(monkeypatch):
    monkeypatch.setattr("snapshot_lab.capture._DECLARED", {})


def _parallel(torch, tmp_path, monkeypatch):
    torch.install(monkeypatch)  # again: the modules distributed() added
    with recording(tmp_path) as rec:
        pass
    return _meta(rec.written[0])["parallel"]


ONES = {"dp": 1, "fsdp": 1, "tp": 1, "pp": 1, "cp": 1}


def test_parallel_of_a_single_process(torch, tmp_path, declared):
    with recording(tmp_path) as rec:
        pass
    assert _meta(rec.written[0])["parallel"] == {
        "world_size": 1,
        "rank": 0,
        "degrees": ONES,
        "coordinates": dict.fromkeys(ONES, 0),
        "sources": dict.fromkeys(ONES, "rest"),
    }


def test_parallel_from_a_named_2d_mesh(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=3, world=4)
    root = par.DeviceMesh((2, 2), ("dp", "tp"), (1, 1))
    tp_slice = par.DeviceMesh((2,), ("tp",), (1,), root=root)  # a slice: not a mesh of its own
    p = _parallel(torch, tmp_path, monkeypatch)
    assert (p["world_size"], p["rank"]) == (4, 3)
    assert p["mesh"] == {"dim_names": ["dp", "tp"], "shape": [2, 2], "coordinate": [1, 1], "device_type": "cuda"}
    assert "meshes" not in p
    assert p["degrees"] == {**ONES, "dp": 2, "tp": 2}
    assert p["coordinates"] == {"dp": 1, "fsdp": 0, "tp": 1, "pp": 0, "cp": 0}
    assert p["sources"]["tp"] == "mesh" and p["sources"]["pp"] == "rest"
    assert p["strategies"] == ["tensor_parallel"]
    del tp_slice


def test_parallel_fsdp2_on_an_unnamed_mesh(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=1, world=2)
    mesh = par.DeviceMesh((2,), None, (1,))
    units = [par.FSDPModule(mesh, reshard=True, is_root=False) for _ in range(3)]
    units.append(par.FSDPModule(mesh, reshard=False, is_root=True))  # the root never reshards
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["mesh"]["dim_names"] is None
    assert p["fsdp"] == {"version": 2, "units": 4, "reshard_after_forward": True}
    assert p["degrees"] == {**ONES, "fsdp": 2} and p["coordinates"]["fsdp"] == 1
    assert p["sources"]["fsdp"] == "fsdp2" and p["strategies"] == ["fsdp2"]
    del units


def test_parallel_fsdp2_shards_over_a_dim_named_dp(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=0, world=2)
    mesh = par.DeviceMesh((2,), ("dp",), (0,))
    units = [par.FSDPModule(mesh, reshard=False, is_root=False)]
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["degrees"] == {**ONES, "fsdp": 2}  # the tutorial name "dp", but FSDP shards over it
    assert p["fsdp"]["reshard_after_forward"] is False
    del units


def test_parallel_hsdp(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=5, world=8)
    mesh = par.DeviceMesh((2, 4), ("replicate", "shard"), (1, 1))
    units = [par.FSDPModule(mesh, reshard=True, is_root=False, replicate_dim=0)]
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["degrees"] == {**ONES, "dp": 2, "fsdp": 4}
    assert p["coordinates"]["dp"] == 1 and p["coordinates"]["fsdp"] == 1
    del units


def test_parallel_fsdp1_and_ddp(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=1, world=2)
    units = [par.FSDP("SHARD_GRAD_OP", 2, 1, is_root=True), par.FSDP("SHARD_GRAD_OP", 2, 1, is_root=False)]
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["fsdp"] == {"version": 1, "units": 2, "sharding_strategy": "SHARD_GRAD_OP"}
    assert p["degrees"] == {**ONES, "fsdp": 2} and p["coordinates"]["fsdp"] == 1
    del units

    par = torch.distributed(rank=1, world=2)
    ddp = par.DDP(size=2, rank=1, bucket_view=True)
    p = _parallel(torch, tmp_path / "ddp", monkeypatch)
    assert p["ddp"] == {"gradient_as_bucket_view": True, "bucket_cap_bytes": 25 * 2**20}
    assert p["degrees"] == {**ONES, "dp": 2} and p["sources"]["dp"] == "ddp" and p["strategies"] == ["ddp"]
    del ddp


def test_parallel_pipeline_detected_then_declared(torch, tmp_path, monkeypatch, declared):
    from snapshot_lab.capture import describe_parallel

    par = torch.distributed(rank=1, world=2)
    stage, schedule = par.Stage(1, 2), par.Schedule1F1B(8)
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["pp"] == {"stage": 1, "num_stages": 2, "schedule": "1F1B", "microbatches": 8}
    assert p["degrees"] == {**ONES, "pp": 2} and p["coordinates"]["pp"] == 1 and p["sources"]["pp"] == "pipeline"
    assert p["strategies"] == ["pipeline"]

    describe_parallel(schedule="ZeroBubble", microbatches=16, run="r42")  # what the user says wins
    p = _parallel(torch, tmp_path / "b", monkeypatch)
    assert p["pp"] == {"stage": 1, "num_stages": 2, "schedule": "ZeroBubble", "microbatches": 16}
    assert p["declared"] == {"schedule": "ZeroBubble", "microbatches": 16, "notes": {"run": "r42"}}
    del stage, schedule


def test_parallel_declared_by_hand(torch, tmp_path, monkeypatch, declared):
    from snapshot_lab.capture import describe_parallel, parallel_layout

    torch.distributed(rank=2, world=4)
    torch.install(monkeypatch)
    assert "degrees" not in parallel_layout()  # a world of 4 and nothing to see: unknown, not guessed
    describe_parallel(pp_stage=1, pp_degree=2, schedule="1F1B", microbatches=8)
    describe_parallel(dp=2, coordinates={"dp": 0}, strategy="ddp+pp")
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["degrees"] == {**ONES, "dp": 2, "pp": 2}
    assert p["coordinates"] == {"dp": 0, "fsdp": 0, "tp": 0, "pp": 1, "cp": 0}
    assert p["pp"] == {"stage": 1, "schedule": "1F1B", "microbatches": 8, "num_stages": 2}
    assert p["sources"]["pp"] == p["sources"]["dp"] == "declared"
    assert p["strategies"] == ["ddp+pp"]


def test_parallel_detection_never_fails_the_dump(torch, tmp_path, monkeypatch, declared):
    par = torch.distributed(rank=0, world=2)

    broken = par.DeviceMesh((2,), ("tp",), (0,))
    broken.shape = None  # neither a shape nor the .mesh tensor of older torch
    half = par.DeviceMesh((2,), ("tp",), (0,))
    half.get_coordinate = lambda: 1 / 0  # a mesh whose process groups are gone
    p = _parallel(torch, tmp_path, monkeypatch)
    assert p["mesh"] == {"dim_names": ["tp"], "shape": [2], "coordinate": None, "device_type": "cuda"}
    assert "meshes" not in p and p["degrees"] == {**ONES, "tp": 2}  # the broken mesh is skipped
    assert "tp" not in p["coordinates"]

    def boom():
        raise RuntimeError("gc is broken")

    monkeypatch.setattr("snapshot_lab.capture.gc.get_objects", boom)
    with recording(tmp_path / "b") as rec:
        pass
    meta = _meta(rec.written[0])
    assert meta["parallel"] == {"world_size": 2, "rank": 0, "error": "RuntimeError: gc is broken"}
    assert meta["memory_stats"]  # the rest of the sidecar is there
    del broken, half


def test_the_sidecar_says_whether_modules_were_tagged(torch, tmp_path):
    """recording() tags allocations with their module by default; on a torch that cannot (the
    stand-in has no _set_memory_metadata), the sidecar says so and why, and recording goes on."""
    with recording(tmp_path) as rec:
        pass
    tags = _meta(rec.written[0])["module_tags"]
    assert tags["enabled"] is False and tags["reason"]
    with recording(tmp_path / "off", tag_modules=False) as rec:
        pass
    assert _meta(rec.written[0])["module_tags"] is None
