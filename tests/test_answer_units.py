"""The report's answer in the user's units (issue #39 §1): one bold sentence of at most 45 words,
batches in samples where the recorded batch is known (``--batch``/``recorded_batch``, else the
capture sidecar's ``batch_size``), the method folded under it in a ``<details>`` element (HTML and
Markdown); in a file of several devices, the answer of the device that ran out of memory.

No sample records an out-of-memory error on device 1: that case adds one to the real DataParallel
recording (``dataparallel``, two devices) at the end of device 1's trace.
"""

from __future__ import annotations

import json
import lzma
import pickle
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from snapshot_lab import api
from snapshot_lab.capture import recording
from snapshot_lab.cli import app
from snapshot_lab.errors import ParameterError
from snapshot_lab.load.sidecar import load_sidecar
from snapshot_lab.metrics.fit import compute_fit
from snapshot_lab.metrics.fit.result import HEADLINE_LEVERS
from snapshot_lab.render.fit import ANSWER_WORDS, answer_sentence
from snapshot_lab.report import build_report, fit_summary

from .conftest import sample_path, sample_truth
from .fake_frameworks import FakeLightningModule, install_fake_lightning, install_fake_transformers

GPT2_OOM = "fit_gpt2_b32_oom_python"  # batch 32, under a 6 GiB cap (its truth.json)
GPT2_COMPLETE = "fit_gpt2_b4_complete_python"  # batch 4, two whole steps, no OOM
METHOD = "A whole step at batch 32 needs about 38.2 GiB"


def _words(text: str) -> int:
    return len(re.sub(r"<[^>]+>", " ", text).split())


def _html_answer(html: str) -> str:
    """The bold sentence the first screen leads with (tags stripped)."""
    section = html[html.index('id="answer"') : html.index('id="findings"')]
    found = re.search(r'<p class="verdict[^"]*"><b>(.*?)</b></p>', section, re.S)
    assert found is not None, section[:500]
    return re.sub(r"<[^>]+>", "", found.group(1))


def _md_answer(text: str) -> str:
    found = re.search(r"^\*\*(.*?)\*\*$", text, re.M)
    assert found is not None
    return found.group(1)


@pytest.fixture(scope="module")
def gpt2_reports(tmp_path_factory):
    """The OOM recorded at batch 32 under its 6 GiB cap, as HTML and Markdown, given both flags."""
    truth = sample_truth(GPT2_OOM)["workload"]
    assert (truth["batch"], truth["cap_bytes"]) == (32, 6 << 30)
    out = tmp_path_factory.mktemp("reports")
    html = api.report(sample_path(GPT2_OOM), output=out / "r.html", recorded_batch=32, memory_limit="6GiB")
    runner = CliRunner()
    flags = ["--batch", "32", "--memory-limit", "6GiB"]
    r = runner.invoke(app, ["report", str(sample_path(GPT2_OOM)), "--format", "md", "-o", str(out / "r.md"), *flags])
    assert r.exit_code == 0, r.output
    return Path(html).read_text(encoding="utf-8"), (out / "r.md").read_text(encoding="utf-8")


def test_the_html_answer_is_one_bold_sentence_in_samples(gpt2_reports):
    html, _ = gpt2_reports
    answer = _html_answer(html)
    assert _words(answer) <= ANSWER_WORDS
    assert answer.startswith("Batch 3 fits in 6 GiB (you ran 32); with checkpointing 25–35")
    assert "x the recorded batch" not in answer
    section = html[html.index('id="answer"') : html.index('id="findings"')]
    details = section[section.index("<details") : section.index("</details>")]
    assert METHOD in details and "extrapolated" in details  # the method and its caveats, folded
    assert section.index("</details>") < section.index("Out of memory: a request of 384.00 MiB")
    assert '<li class="lever fit">' not in section  # the answer is not listed again among the levers


def test_the_markdown_answer_is_one_bold_sentence_in_samples(gpt2_reports):
    _, text = gpt2_reports
    answer = _md_answer(text)
    assert _words(answer) <= ANSWER_WORDS + 1  # the status mark
    assert "Batch 3 fits in 6 GiB (you ran 32)" in answer
    folded = text[text.index("<details>") : text.index("</details>")]
    assert "<summary>" in folded and METHOD in folded
    assert text.index("</details>") < text.index("Out of memory: a request of 384.00 MiB")


def test_without_the_recorded_batch_the_answer_is_short_and_says_how_to_get_samples(real_frames):
    summary = fit_summary(real_frames(GPT2_OOM))
    assert summary is not None
    assert summary.answer.startswith("0.11x the recorded batch fits in 6 GiB; with checkpointing 0.79x–1.11x")
    assert _words(summary.answer) <= ANSWER_WORDS
    assert any("--batch N" in step for step in summary.steps)


def test_without_a_memory_limit_the_verdict_leads(real_frames):
    """A run that did not run out of memory, with no limit known: nothing to fit in, so no
    sentence of what fits (fit's step stays among the levers)."""
    summary = fit_summary(real_frames(GPT2_COMPLETE), recorded_batch=4)
    assert summary is not None and summary.answer == "" and "No memory limit is known" in summary.verdict


def test_where_no_batch_fits_the_sentence_says_so(real_frames):
    fit = compute_fit(real_frames(GPT2_OOM), memory_limit=6 << 30, recorded_batch=32, levers=HEADLINE_LEVERS)
    none_as_is = replace(
        fit, levers=tuple(replace(o, largest_batch=0) if o.lever == "as recorded" else o for o in fit.levers)
    )
    said = answer_sentence(none_as_is)
    assert said is not None and said.startswith("No batch fits in 6 GiB as is (you ran 32); with checkpointing 25")
    nothing = replace(fit, levers=tuple(replace(o, largest_batch=0, largest_batch_no_retry=0) for o in fit.levers))
    assert answer_sentence(nothing, several_devices=True) == (
        "No batch fits in 6 GiB on device 0 (you ran 32), with or without checkpointing or bf16 autocast."
    )
    assert all(_words(text or "") <= ANSWER_WORDS for text in (said, answer_sentence(nothing)))


def _dataparallel_oom_on_device_1(tmp_path: Path) -> Path:
    raw = pickle.loads(lzma.decompress(sample_path("dataparallel").read_bytes()))
    trace = raw["device_traces"][1]
    last = trace[-1]
    trace.append(
        {
            "action": "oom",
            "addr": 0,
            "size": 64 << 30,
            "stream": 0,
            "time_us": last["time_us"] + 1,
            "frames": last.get("frames", []),
            "device_free": 1 << 30,
        }
    )
    path = tmp_path / "dataparallel_oom1.pickle"
    path.write_bytes(pickle.dumps(raw, protocol=4))
    return path


def test_a_dataparallel_oom_on_device_1_is_answered_for_device_1(tmp_path):
    assert sample_truth("dataparallel")["workload"]["devices"] == [0, 1]
    frames = api.load_frames(_dataparallel_oom_on_device_1(tmp_path))
    # device 0 has more trace and a whole step: fit's default device, whose answer led before
    summary = fit_summary(frames)
    assert summary is None or "device 0" not in summary.answer
    text = str(build_report(frames, api.compute_stats(frames), fit_answer=summary, format="md"))
    answer = _md_answer(text)
    assert "on device 1" in answer and "device 0" not in answer and _words(answer) <= ANSWER_WORDS + 1
    first = text[: text.index("### Key numbers")]
    assert "requested at the peak on device 1" in first
    assert first.index("on device 1") < first.index("Device 0:")  # the other device follows


# --------------------------------------------------------------------------- the sidecar


def test_recording_writes_the_batch_and_the_device_memory_and_the_loader_reads_them(torch, tmp_path):
    with recording(tmp_path, batch_size=32, tag_modules=False) as rec:
        pass
    (written,) = rec.written
    meta = load_sidecar(written)
    assert meta is not None and meta["batch_size"] == 32
    assert set(meta["device_total_bytes"]) == {"0"} and meta["device_total_bytes"]["0"] > 0
    with recording(tmp_path / "none", tag_modules=False) as rec:
        pass
    assert "batch_size" not in (load_sidecar(rec.written[0]) or {})


def test_a_bad_batch_size_in_a_sidecar_is_dropped(tmp_path):
    snap = tmp_path / "x.pickle"
    snap.write_bytes(b"")
    for bad in (0, -3, True, "32", 2.5):
        (tmp_path / "x.meta.json").write_text(json.dumps({"snaplab_capture": 1, "batch_size": bad}))
        assert "batch_size" not in (load_sidecar(snap) or {}), bad


def test_the_callbacks_write_the_batch_size_they_read(torch, tmp_path, monkeypatch):
    tf = install_fake_transformers(monkeypatch)
    from snapshot_lab.integrations.transformers import SnaplabCallback as HFCallback

    hf = HFCallback(out=tmp_path / "hf", tag_modules=False)
    hf_trainer = tf.Trainer(
        model=object(), args=tf.TrainingArguments(max_steps=1, per_device_train_batch_size=8), callbacks=[hf]
    )
    hf_trainer.train()
    assert load_sidecar(hf.written[-1])["batch_size"] == 8  # type: ignore[index]

    L = install_fake_lightning(monkeypatch)
    from snapshot_lab.integrations.lightning import SnaplabCallback as LightningCallback

    read = LightningCallback(out=tmp_path / "pl", tag_modules=False)
    trainer = L.Trainer(callbacks=[read], max_steps=1)
    trainer.train_dataloader = SimpleNamespace(batch_size=None, batch_sampler=SimpleNamespace(batch_size=16))
    trainer.fit(FakeLightningModule())
    assert load_sidecar(read.written[-1])["batch_size"] == 16  # type: ignore[index]

    given = LightningCallback(out=tmp_path / "given", tag_modules=False, batch_size=12)  # the option wins
    trainer = L.Trainer(callbacks=[given], max_steps=1)
    trainer.train_dataloader = SimpleNamespace(batch_size=16)
    trainer.fit(FakeLightningModule())
    assert load_sidecar(given.written[-1])["batch_size"] == 12  # type: ignore[index]


def _with_sidecar(tmp_path: Path, name: str, **meta: object) -> Path:
    copy = tmp_path / sample_path(name).name
    shutil.copyfile(sample_path(name), copy)
    (tmp_path / f"{name}.meta.json").write_text(json.dumps({"snaplab_capture": 1, **meta}))
    return copy


def test_the_report_uses_the_sidecar_without_flags_and_flags_override_it(tmp_path):
    path = _with_sidecar(tmp_path, GPT2_COMPLETE, batch_size=4, device_total_bytes={"0": 6 << 30})
    frames = api.load_frames(path)
    from_sidecar = fit_summary(frames)
    assert from_sidecar is not None and from_sidecar.answer.startswith("Batch 3 fits in 6 GiB (you ran 4)")
    given = fit_summary(frames, recorded_batch=8, memory_limit=8 << 30)
    assert given is not None and given.answer.startswith("Batch 11 fits in 8 GiB (you ran 8)")
    assert api.fit(path).recorded_batch == 4 and api.fit(path, recorded_batch=8).recorded_batch == 8
    html = Path(api.report(path, output=tmp_path / "r.html")).read_text(encoding="utf-8")
    assert _html_answer(html) == from_sidecar.answer


def test_report_and_fit_refuse_a_batch_below_one():
    with pytest.raises(ParameterError, match="recorded_batch must be at least 1"):
        api.report(sample_path(GPT2_OOM), recorded_batch=0)
    r = CliRunner().invoke(app, ["report", str(sample_path(GPT2_OOM)), "--batch", "0", "-q"])
    assert r.exit_code != 0 and "must be at least 1" in r.stderr


def test_a_range_from_nothing_says_none_without_a_retry():
    """Issue #37: a range printed "0–4" read as batches from 0 to 4; its first number says that no
    batch fits without the allocator's retry."""
    from types import SimpleNamespace

    from snapshot_lab.metrics.fit import LeverOutcome
    from snapshot_lab.render.fit import _batch_range

    def lever(best: float, sure: float, most: float | None = None) -> LeverOutcome:
        return LeverOutcome("checkpointing", "", 0, 0, best, None, sure, most)

    samples = SimpleNamespace(recorded_batch=64)
    assert _batch_range(samples, lever(4, 0)) == "none without a retry, up to 4 with one"
    assert _batch_range(samples, lever(4, 2)) == "2–4"
    assert _batch_range(samples, lever(4, 2, 6)) == "2–6"  # the top where the tensors alone fill the limit
    assert _batch_range(samples, lever(4, 4, 6)) == "4–6"
    assert _batch_range(samples, lever(4, 4)) == "4"
    multiples = SimpleNamespace(recorded_batch=None)
    assert _batch_range(multiples, lever(0.5, 0.0)) == "none without a retry, up to 0.5x the recorded batch with one"


def test_the_issues_own_case_a_mixture_of_experts_oom_at_batch_64(tmp_path):
    """The case issue #39 named (a Mixtral-config OOM at batch 64, answered in fractions of the
    recorded batch), recorded after the answer was written (tests/test_fit_moe.py): the first batch
    of each range ran in a fresh process, and the one above it as recorded, with bf16 and with both
    failed there (8, 10, 18); the ranges of the levers, which rewrite the step, end where its
    tensors alone fill the cap, and hold the real largest batches (19, 9, 17)."""
    name = "fit_mixtral_b64_oom_python"
    r = CliRunner().invoke(
        app,
        [
            "report",
            str(sample_path(name)),
            "--format",
            "md",
            "-o",
            str(tmp_path / "r.md"),
            "--batch",
            "64",
            "--memory-limit",
            "6GiB",
        ],
    )
    assert r.exit_code == 0, r.output
    answer = _md_answer((tmp_path / "r.md").read_text(encoding="utf-8"))
    assert answer.endswith(
        "Batch 7 fits in 6 GiB (you ran 64); with checkpointing 18–22, with bf16 autocast 9–10, with both 17–22."
    )
    assert _words(answer) <= ANSWER_WORDS + 1
