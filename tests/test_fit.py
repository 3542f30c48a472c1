"""snaplab fit (issue #20): what makes a job fit, predicted from one snapshot, against real
H100 runs of two families (``sample_snapshots/fit_truth.json``, from
``sample_snapshots/workloads_fit.py``: GPT-2 from a config with AdamW, torchvision's ResNet-50
with SGD momentum; every batch of a list spanning 16x under four levers, and the largest batch
whose two whole steps ran under a 6 GiB per-process cap).

The rules are the same for both families; nothing is fitted to a recording.
"""

from __future__ import annotations

import inspect
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from snapshot_lab import api, cli
from snapshot_lab.cli import app
from snapshot_lab.errors import EXIT_BAD_INPUT, EXIT_USAGE
from snapshot_lab.metrics.allocator.model import AllocatorSettings
from snapshot_lab.metrics.fit import compute_fit, predict_step
from snapshot_lab.metrics.fit.evidence import BlockSpan
from snapshot_lab.metrics.fit.levers import checkpoint
from snapshot_lab.metrics.fit.search import largest_batch
from snapshot_lab.metrics.fit.tape import NEVER, make_tape, peak_allocated, simulate
from snapshot_lab.render.fit import format_fit

from .conftest import SAMPLES, sample_path
from .fit_known_misses import IN_DOCS, TALLIES, BatchMiss, Tally, check_exact, check_tally, tally

runner = CliRunner()
TRUTH = json.loads((SAMPLES / "fit_truth.json").read_text())
CAP = TRUTH["cap_bytes"]
LEVERS = {"plain": (False, False), "ckpt": (True, False), "bf16": (False, True), "ckpt+bf16": (True, True)}
OUR_NAMES = {"plain": "as recorded", "ckpt": "checkpointing", "bf16": "bf16", "ckpt+bf16": "checkpointing+bf16"}
COMPLETE = {
    "gpt2": ("fit_gpt2_b4_complete_python", 4, None),
    "resnet50": ("fit_resnet50_b16_complete_python", 16, None),
}
OOM = {
    "gpt2": ("fit_gpt2_b32_oom_python", 32, "adamw"),
    # ran out inside its first bottleneck: the blocks are read from the parameters
    "resnet50": ("fit_resnet50_b512_oom_python", 512, "sgd-momentum"),
}
MiB = 1 << 20


def _cases(snapshots: dict[str, tuple[str, int, str | None]]) -> list[tuple[str, str, str, int]]:
    out = []
    for family, (name, _, _) in snapshots.items():
        for lever in LEVERS:
            for batch, measured in TRUTH["families"][family]["levers"][lever]["uncapped"].items():
                if measured.get("ok"):
                    out.append((family, name, lever, int(batch)))
    return out


# --------------------------------------------------------------------------- unit: the tape


def _tape():
    """Parameters (100), a forward of two blocks saving 10 per sample each, its backward, a step."""
    return make_tape(
        start=np.array([0, 1, 2, 3, 4, 9, 10]),
        end=np.array([NEVER, 8, 7, 6, 5, NEVER, 11]),
        fixed=np.array([100, 0, 0, 0, 0, 100, 50]),
        per_batch=np.array([0, 10, 10, 10, 10, 0, 0]),
        category=np.array(["parameter", "activation", "activation", "activation", "activation", "gradient", "x"]),
        phase=np.array(["setup", "forward", "forward", "forward", "backward", "step", "step"]),
        block=np.array([-1, 0, 0, 1, -1, -1, -1]),
    )


def test_the_peak_allocated_follows_the_batch():
    t = _tape()
    assert peak_allocated(t, 1.0) == 5 * 512  # five blocks of 512 bytes, the smallest the allocator makes
    big = make_tape(np.array([0, 1]), np.array([NEVER, 2]), np.array([1 << 20, 0]), np.array([0, 1 << 20]), "a")
    assert peak_allocated(big, 3.0) == 4 << 20
    assert simulate(big, 3.0, AllocatorSettings()).peak_allocated_bytes == 4 << 20


def test_checkpointing_keeps_the_blocks_output_and_recomputes_the_rest():
    mib = 1 << 20
    t = make_tape(
        start=np.array([0, 1, 2, 3, 10]),
        end=np.array([NEVER, 20, 21, 11, 12]),
        fixed=np.zeros(5),
        per_batch=np.array([0, 8, 8, 8, 1]) * mib,
        category="activation",
        phase=np.array(["setup", "forward", "forward", "forward", "backward"]),
        block=np.array([-1, 0, 0, 0, -1]),
    )
    block = BlockSpan(0, 0, 1.0, 3.0, 19.5, 21.0, 0)
    ck = checkpoint(t, (block,))
    assert peak_allocated(t, 1.0) == 25 * mib  # three saved tensors and the backward's first
    # the output (the first saved tensor the backward frees) is kept; the two others go when the
    # block's forward ends and are made again just before its backward
    assert peak_allocated(ck, 1.0) == 24 * mib
    assert len(ck) == len(t) + 2
    again = ck.select(np.arange(len(ck)) >= len(t))
    assert (again.start >= 19).all() and (again.start < 19.5).all()
    assert list(again.end) == [20.0, 21.0]


def test_the_search_steps_down_from_the_allocated_bound():
    from snapshot_lab.metrics.fit.search import _down_from

    tried = []

    def fits(n):
        tried.append(n)
        return n <= 37

    assert _down_from(40, fits) == 37
    assert tried[:3] == [40, 39, 38]
    assert _down_from(5, lambda n: False) == 0


def test_largest_batch_is_the_last_that_fits():
    mib = 1 << 20
    t = make_tape(np.array([0, 1]), np.array([NEVER, 2]), np.array([64 * mib, 0]), np.array([0, 32 * mib]), "a")
    # 64 MiB fixed + 8 MiB per sample (recorded batch 4): 256 MiB fits 24 samples
    assert largest_batch(t, 4, AllocatorSettings(), 256 * mib) == 24


# --------------------------------------------------------------------------- real: accuracy


@pytest.mark.parametrize(("family", "name", "lever", "batch"), _cases(COMPLETE))
def test_whole_step_from_a_complete_recording_within_10_percent(real_frames, family, name, lever, batch):
    recorded = COMPLETE[family][1]
    ckpt, bf16 = LEVERS[lever]
    allocated, _ = predict_step(real_frames(name), batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16)
    measured = TRUTH["families"][family]["levers"][lever]["uncapped"][str(batch)]["peak_process_bytes"]
    assert abs(allocated / measured - 1) <= 0.10


@pytest.mark.parametrize(("family", "name", "lever", "batch"), _cases(OOM))
def test_whole_step_from_an_oom_in_the_first_forward_within_15_percent(real_frames, family, name, lever, batch):
    _, recorded, optimizer = OOM[family]
    ckpt, bf16 = LEVERS[lever]
    frames = real_frames(name)
    allocated, _ = predict_step(
        frames, batch_scale=batch / recorded, checkpointing=ckpt, bf16=bf16, optimizer=optimizer
    )
    measured = TRUTH["families"][family]["levers"][lever]["uncapped"][str(batch)]["peak_process_bytes"]
    assert abs(allocated / measured - 1) <= 0.15


# --------------------------------------------------------------------------- real: under the cap


@pytest.fixture(scope="module")
def under_the_cap(real_frames):
    """The largest batch per lever under the 6 GiB cap, from every snapshot that supports it."""
    out = {}
    for family, (name, recorded, optimizer) in [*COMPLETE.items(), *OOM.items()]:
        r = compute_fit(
            real_frames(name), memory_limit=CAP, recorded_batch=recorded, optimizer=optimizer, parallel=False
        )
        out[name] = (family, r)
    return out


# measured under the cap (fit_truth.json) -> what the model says today; the exact answer is the
# acceptance goal, these are within a few batches of it (see the report of issue #20)
NEAR = 0.4  # or one batch


@pytest.mark.parametrize("lever", list(LEVERS))
def test_largest_batch_under_the_cap_is_near_the_measured_one(under_the_cap, lever):
    for name, (family, r) in under_the_cap.items():
        measured = TRUTH["families"][family]["levers"][lever]["largest_batch_under_cap"]
        predicted = r.largest_batch[OUR_NAMES[lever]]
        assert predicted is not None
        assert abs(predicted - measured) <= max(1, NEAR * measured), (name, lever, predicted, measured)


EXACT = {  # (snapshot, lever) the model gets exactly right today
    ("fit_gpt2_b4_complete_python", "plain"),  # new segments placed top-down, as the driver does
    ("fit_gpt2_b32_oom_python", "bf16"),
    # the optimizer state made per parameter as torch makes it (AdamW: two tensors its size, not one
    # twice its size, which split the cached logits segments): 4 -> 3
    ("fit_gpt2_b32_oom_python", "plain"),
    # bf16 casts the layer norms' outputs, not their statistics, for the linear layers: 4 -> 5
    ("fit_gpt2_b4_complete_python", "bf16"),
    # the head's cuBLAS workspaces, which an OOM in the first block never reached: 70 -> 69
    ("fit_resnet50_b512_oom_python", "plain"),
}
# no longer exact: ResNet-50's bf16 from the complete recording, 134 -> 133, since max pooling's int64
# indices are no longer halved by bf16 (ResNet-18's bf16 went from -6.9% to within 2.7%): at 134 its
# whole-step peak allocated is within 0.4% of the real run's, and the allocator replayed places one less


_NOT_EXACT = "the allocator under the cap is not exact yet"
_WORKSPACES = (
    "cuDNN's workspaces: the replay fails the step on a convolution's workspace, where the real run catches the "
    "error and runs another algorithm (docs/fit.md, Known gaps)"
)
NOT_EXACT = {  # (snapshot, lever) -> the known miss: today's answer and the real run's largest batch
    ("fit_gpt2_b4_complete_python", "ckpt"): BatchMiss(28, 27, _NOT_EXACT),
    ("fit_gpt2_b4_complete_python", "ckpt+bf16"): BatchMiss(29, 28, _NOT_EXACT),
    ("fit_gpt2_b32_oom_python", "ckpt"): BatchMiss(29, 27, _NOT_EXACT),
    ("fit_gpt2_b32_oom_python", "ckpt+bf16"): BatchMiss(30, 28, _NOT_EXACT),
    ("fit_resnet50_b16_complete_python", "plain"): BatchMiss(68, 69, _NOT_EXACT),
    ("fit_resnet50_b16_complete_python", "ckpt"): BatchMiss(154, 162, _WORKSPACES),
    ("fit_resnet50_b16_complete_python", "bf16"): BatchMiss(133, 134, _NOT_EXACT),
    ("fit_resnet50_b16_complete_python", "ckpt+bf16"): BatchMiss(269, 299, _NOT_EXACT),
    ("fit_resnet50_b512_oom_python", "ckpt"): BatchMiss(160, 162, _NOT_EXACT),
    ("fit_resnet50_b512_oom_python", "bf16"): BatchMiss(135, 134, _NOT_EXACT),
    ("fit_resnet50_b512_oom_python", "ckpt+bf16"): BatchMiss(310, 299, _NOT_EXACT),
}


@pytest.mark.parametrize("lever", list(LEVERS))
@pytest.mark.parametrize("name", [v[0] for v in [*COMPLETE.values(), *OOM.values()]])
def test_largest_batch_under_the_cap_exactly(under_the_cap, name, lever):
    """Exactly, but the known misses, each no further from the real run than today (and a miss
    that becomes exact says so)."""
    family, r = under_the_cap[name]
    measured = TRUTH["families"][family]["levers"][lever]["largest_batch_under_cap"]
    predicted = r.largest_batch[OUR_NAMES[lever]]
    assert not (EXACT & set(NOT_EXACT))
    check_exact(predicted, measured, NOT_EXACT.get((name, lever)), f"{name}, {lever}")
    if (name, lever) in EXACT:
        assert predicted == measured


def test_the_largest_batch_tables_counts(under_the_cap):
    """GPT-2's and ResNet-50's rows of docs/fit.md's table: exact, within one, in the range."""
    rows = []
    for family, r in under_the_cap.values():
        for lever in LEVERS:
            real = TRUTH["families"][family]["levers"][lever]["largest_batch_under_cap"]
            ours = OUR_NAMES[lever]
            rows.append(
                (r.largest_batch_no_retry.get(ours), r.largest_batch[ours], real, r.largest_batch_at_most[ours])
            )
    check_tally(tally(rows), TALLIES["tests/test_fit.py"], "GPT-2 and ResNet-50")


def test_the_pinned_counts_are_the_docs():
    """docs/fit.md's sentences on its table of largest batches are the sum of the tables' pins
    (tests/fit_known_misses.py), each pinned where its answers are checked."""
    import re

    text = " ".join((SAMPLES.parent / "docs" / "fit.md").read_text().split())
    total = sum((TALLIES[table] for table in IN_DOCS), Tally())
    said = re.search(r"Of these (\d+) answers, (\d+) are exact \(bold\) and (\d+) more within one batch", text)
    assert said and tuple(map(int, said.groups())) == (total.answers, total.exact, total.within_one), total
    ranges = re.search(
        r"the real run's largest batch lies within the range in (\d+), and at or above the range's "
        r"first batch in (\d+)",
        text,
    )
    assert ranges and tuple(map(int, ranges.groups())) == (total.in_range, total.sure_runs), total
    below = re.search(r"In (\d+) of the (\d+) answers the real run's largest batch is below", text)
    assert below and tuple(map(int, below.groups())) == (total.answers - total.sure_runs, total.answers), total


@pytest.mark.parametrize("lever", list(LEVERS))
def test_the_step_from_the_oom_grows_per_sample_as_the_complete_recordings(real_frames, lever):
    """Between half the real largest batch and it, the peak allocated of the step extrapolated from
    GPT-2's OOM grows per sample as that of the complete recording of the same job (the difference
    is the extrapolation alone): within 3% under every lever (+1.3, -2.1, +0.7, +0.0%). The simpler
    extrapolation (blocks cut at their last submodule call, saved tensors freed one gradient late,
    gradients of their forward tensor's dtype) was off by -1.7, +11.9, -4.8 and -7.2% (ViT's,
    tests/test_fit_holdout.py: -35.8% with both)."""
    from snapshot_lab.metrics.fit.model import step_evidence
    from snapshot_lab.metrics.fit.result import requested_tape
    from snapshot_lab.metrics.fit.search import PeakCurve

    real = TRUTH["families"]["gpt2"]["levers"][lever]["largest_batch_under_cap"]
    growth = []
    for name, recorded, optimizer in (COMPLETE["gpt2"], OOM["gpt2"]):
        curve = PeakCurve(requested_tape(step_evidence(real_frames(name), 0, optimizer), *LEVERS[lever]))
        growth.append(curve.peak(real / recorded) - curve.peak(real / 2 / recorded))
    assert abs(growth[1] / growth[0] - 1) <= 0.03, growth


def test_bf16_casts_the_norms_output_for_the_linear_layer_not_its_statistics(real_frames):
    """Autocast casts a linear layer's float32 input and the layer saves the bfloat16 copy. A layer
    norm makes its mean and deviation after its output: taking the tensor made just before the
    linear layer's output for its input (the simpler rule) halved a statistic (4 KiB a sample) in
    place of each of the 25 norms' outputs (3 MiB a sample) of each pass, and GPT-2's bf16 answer
    was 4 where 5 ran (ViT's 65 and 67 where 71 ran, tests/test_fit_holdout.py). Per pass and
    block, the inputs are the two norms' outputs (3 MiB) and the MLP's activation (12 MiB), and
    the final norm's output. The values the attention reads from the KV cache were counted too
    (3 MiB a block) until the cache's copies took the dtype of the key they copy: bfloat16 in
    GPT-2 (its projection's output), so autocast casts nothing there."""
    from collections import Counter

    from snapshot_lab.metrics.fit.levers import _matmul_inputs
    from snapshot_lab.metrics.fit.model import step_evidence

    tape = step_evidence(real_frames("fit_gpt2_b4_complete_python"), 0).tape
    per_sample = Counter((tape.per_batch[_matmul_inputs(tape)] / 4).tolist())
    assert per_sample == {3 * MiB: 2 * (12 * 2 + 1), 12 * MiB: 2 * 12}


def test_the_answer_leads_the_text(under_the_cap):
    _, r = under_the_cap["fit_gpt2_b32_oom_python"]
    text = format_fit(r, "fit_gpt2_b32_oom_python.pickle.xz")
    first = text.splitlines()[0]
    assert first.startswith("A whole step at batch 32 needs about ")
    # measured: 1.16 GiB per sample between batches 8 and 16 (fit_truth.json); 1.13 before each
    # block's tail (its residual add, 3 MiB a sample) was copied with it, 1.17 while cuBLAS's
    # workspace (33 MiB, made by the one block that ran) was taken for an activation
    assert "parameters 0.34, gradients 0.34, AdamW 0.69, activations ≈ 1.16 GiB per sample" in first
    assert "Under 6.0 GiB, batch 3 as is, 5 with bf16 autocast" in first  # measured: 3 and 5
    assert "extrapolated" in text and "lever" in text


def test_an_oom_inside_the_first_block_of_a_convnet_is_extrapolated_from_its_parameters(real_frames):
    """ResNet-50 ran out on its first bottleneck's second convolution: the 16 bottlenecks, their
    widths and feature maps (56, 28, 14, 7: halved where a projection doubles the width) come
    from the parameters."""
    from snapshot_lab.metrics.categories import CODES
    from snapshot_lab.metrics.fit.convnet import conv_blocks, feature_maps
    from snapshot_lab.metrics.plan.structure import training_structure

    frames = real_frames("fit_resnet50_b512_oom_python")
    a = training_structure(frames, 0).allocs
    sizes = a.loc[a["code"] == CODES["parameter"], "size"].to_numpy()
    stem, convs = conv_blocks(sizes)
    assert stem == 64 and len(convs) == 52 and convs[-1][2] == 15
    first = 411041792 / 64  # the first bottleneck's first convolution, at batch 512: 64 x 56 x 56 floats a sample
    sides = sorted({round((x.bytes_per_channel / 4 / 512) ** 0.5) for x in feature_maps(stem, convs, sizes, first)})
    assert sides == [7, 14, 28, 56]
    r = compute_fit(frames, memory_limit=CAP, recorded_batch=512, optimizer="sgd-momentum", parallel=False)
    assert not r.complete and any("read from its parameters" in n for n in r.notes)


def test_the_optimizer_is_read_from_the_stacks_or_assumed_and_said_so(real_frames):
    full = compute_fit(real_frames("fit_resnet50_b16_complete_python"), memory_limit=CAP, recorded_batch=16)
    assert full.optimizer == "sgd-momentum" and "named in the stacks" in full.optimizer_source
    assert full.breakdown["optimizer_state_bytes"] == 102228128  # torch's SGD momentum buffers, measured
    assert "sgd-momentum" not in full.largest_batch  # no swap to itself
    oom = compute_fit(real_frames("fit_gpt2_b32_oom_python"), memory_limit=CAP, recorded_batch=32)
    assert oom.optimizer == "adamw" and oom.optimizer_source.startswith("assumed")
    assert oom.breakdown["optimizer_state_bytes"] == 2 * oom.breakdown["parameters_bytes"]


# --------------------------------------------------------------------------- CLI and API


def _invoke(*args: str):
    return runner.invoke(app, ["fit", *args])


def test_cli_json_is_the_api():
    path = str(sample_path("fit_gpt2_b4_complete_python"))
    r = _invoke(path, "--memory-limit", "6GiB", "--recorded-batch", "4", "--batch-scale", "2", "--bf16", "--json", "-q")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    res = api.fit(path, memory_limit="6GiB", recorded_batch=4, batch_scale=2, bf16=True)
    assert out == json.loads(json.dumps(res.to_dict()))
    assert out["batch"] == 8 and out["bf16"] is True
    assert out["peak_allocated_bytes"] > 0 and out["peak_reserved_bytes"] >= out["peak_allocated_bytes"]
    assert set(out["largest_batch"]) >= {"as recorded", "checkpointing", "bf16", "checkpointing+bf16", "8-bit adam"}
    assert {"parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "workspaces_bytes"} <= set(out["breakdown"])
    assert all(lever["assumption"] for lever in out["levers"])
    acc = out["gradient_accumulation"]
    assert acc["accumulation_steps"] == -(-8 // int(acc["micro_batch"]))


def test_cli_text():
    r = _invoke(
        str(sample_path("fit_gpt2_b4_complete_python")), "--recorded-batch", "4", "-q", "--memory-limit", "6GiB"
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("A whole step at batch 4 needs about ")
    assert "largest batch" in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--memory-limit", "lots"], "--memory-limit"),
        (["--recorded-batch", "0"], "--recorded-batch must be at least 1"),
        (["--batch-scale", "0"], "--batch-scale must be positive"),
        (["--optimizer", "lion"], "unknown optimizer"),
    ],
)
def test_cli_usage_errors(args, message):
    r = _invoke(str(sample_path("fit_gpt2_b4_complete_python")), *args, "-q")
    assert r.exit_code == EXIT_USAGE, r.output
    assert message in r.output and "Traceback" not in r.output


def test_cli_bad_inputs(tmp_path):
    garbage = tmp_path / "garbage.pickle"
    garbage.write_bytes(b"not a pickle at all")
    for path in (tmp_path / "missing.pickle", garbage):
        r = _invoke(str(path), "-q")
        assert r.exit_code == EXIT_BAD_INPUT, r.output
        assert "Traceback" not in r.output
    r = _invoke(str(sample_path("oom_capacity")), "-q")  # no forward in it
    assert r.exit_code == EXIT_BAD_INPUT


def test_cli_and_api_share_names_and_defaults():
    def params(fn):
        return {n: p.default for n, p in inspect.signature(fn).parameters.items()}

    c = {k: v for k, v in params(cli.fit).items() if k not in {"json_out", "quiet", "debug"}}
    a = {k: v for k, v in params(api.fit).items() if k != "progress"}
    assert set(c) == set(a)
    for k, v in a.items():
        if v is not inspect.Parameter.empty:
            assert c[k] == v, k


def test_new_segments_go_top_down_as_the_driver_places_them(real_frames):
    """Replaying GPT-2's recorded step (scale 1) reserves what it recorded only with new segments
    placed from the top of the address space down (increasing addresses: 6.02 GiB, the
    recording: 6.08 GiB); ResNet-50's recording reserves the same either way (hold-out)."""
    from snapshot_lab.metrics.allocator.model import recorded_settings
    from snapshot_lab.metrics.fit.model import step_evidence

    for name in ("fit_gpt2_b4_complete_python", "fit_resnet50_b16_complete_python"):
        frames = real_frames(name)
        ev = step_evidence(frames, 0)
        sim = simulate(ev.tape, 1.0, recorded_settings(frames.info.allocator_settings))
        truth = json.loads((SAMPLES / f"{name}.truth.json").read_text())["memory_stats"]["0"]
        assert sim.peak_reserved_bytes == truth["reserved_bytes.all.peak"], name


def _most_alive_at_once(tape, rows) -> int:
    events = sorted([(tape.start[r], 1) for r in rows] + [(tape.end[r], -1) for r in rows], key=lambda e: (e[0], e[1]))
    alive = best = 0
    for _, step in events:
        alive += step
        best = max(best, alive)
    return best


def test_the_extrapolated_head_backward_holds_three_logits_as_the_recorded_one(real_frames):
    """The recorded GPT-2 step holds the log-softmax, its gradient and the logits' gradient at
    once (3 x 128 MiB at batch 4); the step extrapolated from the OOM does the same: the loss's
    log-softmax is a result its backward needs, freed once the gradient after its own is made.
    Freeing it with its own gradient, as what an operation saved of its input, holds two."""
    from snapshot_lab.metrics.fit.model import step_evidence

    for name, optimizer in (("fit_gpt2_b4_complete_python", None), ("fit_gpt2_b32_oom_python", "adamw")):
        tape = step_evidence(real_frames(name), 0, optimizer).tape
        size = tape.fixed + tape.per_batch
        logits = np.flatnonzero(size == size[tape.phase == "forward"].max())
        assert _most_alive_at_once(tape, logits) == 3, name


def test_checkpointing_makes_no_kv_cache_copies(real_frames):
    """transformers turns use_cache off under gradient checkpointing: GPT-2's 12 layers x 2 steps
    x (keys, values) cache copies are not made (the allocated peak from +5% to +2% at batch 16)."""
    from snapshot_lab.metrics.fit.evidence import KV_CACHE
    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(real_frames("fit_gpt2_b4_complete_python"), 0)
    cache = ev.tape.category == KV_CACHE
    assert int(cache.sum()) == 48 and (ev.tape.sizes(1.0)[cache] == 12 << 20).all()
    ck = checkpoint(ev.tape, ev.blocks)
    assert (ck.sizes(1.0)[: len(ev.tape)][cache] == 0).all()


@pytest.mark.parametrize("name", ["fit_gpt2_b32_oom_python", "fit_resnet50_b512_oom_python", "hf_trainer_end"])
def test_the_reports_headline_levers_alone_give_the_same_answer(real_frames, name):
    """The report asks fit for the four levers its first screen names (a replay of a long trace
    costs seconds each): the same headline and notes as the whole answer, fewer replays."""
    from snapshot_lab.metrics.fit.result import HEADLINE_LEVERS
    from snapshot_lab.render.fit import headline

    whole = compute_fit(real_frames(name))
    few = compute_fit(real_frames(name), levers=HEADLINE_LEVERS)
    assert [o.lever for o in few.levers] == [o.lever for o in whole.levers if o.lever in HEADLINE_LEVERS]
    assert len(few.levers) < len(whole.levers)
    assert (headline(few), few.notes) == (headline(whole), whole.notes)


@pytest.mark.parametrize(
    ("name", "blocks_ran"),
    [("fit_gpt2_b32_oom_python", 1), ("fit_bert_b32_oom_python", 7), ("fit_vit_b128_oom_python", 4)],
)
def test_the_workspaces_of_an_oom_are_fixed_and_the_backward_makes_its_own(real_frames, name, blocks_ran):
    """Every complete recording holds cuBLAS's workspaces: 32 + 1 MiB made by the forward's first
    linear layer, 32 MiB by the backward's own thread. From an OOM, the forward's are one-off
    tensors of the first block (with python stacks they have the linear layer's stack), found by
    what the second block does not keep (GPT-2's OOM ran one block: what ran of the second), and
    the backward makes one as large. Before, they were activations scaled with the batch (GPT-2's
    small batches from the OOM -2.2 to -3.7% low, now within 0.3%)."""
    import numpy as np

    from snapshot_lab.metrics.fit.model import step_evidence

    ev = step_evidence(real_frames(name), 0, "adamw")
    t = ev.tape
    fixed = (t.category == "workspace") & ~np.isfinite(t.end)
    assert sorted(zip(t.phase[fixed].tolist(), t.fixed[fixed].tolist(), strict=True)) == [
        ("backward", 32 << 20),
        ("forward", 1 << 20),
        ("forward", 32 << 20),
    ]
    assert f"; {blocks_ran} ran)" in ev.notes[0]


@pytest.mark.parametrize("name", ["fit_resnet50_b16_complete_python", "fit_gpt2_b32_oom_python"])
def test_fit_without_keeping_the_structure_answers_the_same(real_frames, name):
    """The report's answer drops the training structure once the step's evidence is built
    (``keep_structure=False``): the same result, and the structure no longer kept; a fit that
    plans strategies keeps it (it reads it after the levers)."""
    from snapshot_lab.metrics import _memo
    from snapshot_lab.metrics.fit.result import HEADLINE_LEVERS

    from .conftest import unmemoised

    def structures(frames):
        return [k for k in _memo._STORE.get(id(frames), {}) if isinstance(k, tuple) and k[0] == "plan.structure"]

    kept, lean = unmemoised(real_frames(name)), unmemoised(real_frames(name))
    full = compute_fit(kept, levers=HEADLINE_LEVERS, parallel=False)
    dropped = compute_fit(lean, levers=HEADLINE_LEVERS, parallel=False, keep_structure=False)
    assert dropped.to_dict() == full.to_dict()
    # in lever_tapes' order, though computed with the two that checkpoint last
    names = [o.lever for o in dropped.levers]
    assert names == ["as recorded", "checkpointing", "bf16", "checkpointing+bf16"][: len(names)] and len(names) >= 2
    assert structures(kept) and not structures(lean)
    planned = unmemoised(real_frames(name))
    compute_fit(planned, memory_limit=CAP, keep_structure=False)  # plans: the structure stays
    assert structures(planned)
