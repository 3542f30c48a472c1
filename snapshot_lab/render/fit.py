"""Text for ``snaplab fit``: the answer in a sentence or two, then a table of levers, the
breakdown of the step and what each lever assumes."""

from __future__ import annotations

from ..metrics.fit import FitResult, LeverOutcome
from ..metrics.fit import workload as wl
from ..metrics.fit.result import AS_RECORDED, HEADLINE_LEVERS
from ..units import format_bytes
from .text import table

GiB = 1 << 30
LEVER_PHRASES = {
    "as recorded": "as is",
    "checkpointing": "with activation checkpointing",
    "bf16": "with bf16 autocast",
    "checkpointing+bf16": "with checkpointing and bf16 autocast",
    "sgd-momentum": "with SGD (momentum) as the optimizer",
    "8-bit adam": "with 8-bit Adam",
    "adafactor": "with Adafactor",
    "optimizer offload": "with the optimizer offloaded to the CPU",
}
OPTIMIZER_NAMES = {
    "adamw": "AdamW",
    "adamw-fused": "AdamW (fused)",
    "adam": "Adam(W)",
    "sgd-momentum": "SGD momentum",
    "8-bit adam": "8-bit Adam",
    "lbfgs": "L-BFGS",
}
HEADLINE = "A whole step {what} needs about {peak}: parameters {p}, gradients {g}, {opt} {o}, activations ≈ {a}."
# a forward+backward with no optimizer step in the trace, and inference (fit/workload.py's kinds)
HEADLINE_NO_OPTIMIZER = (
    "A forward and backward {what} need about {peak}: parameters {p}, gradients {g}, no optimizer state, "
    "activations ≈ {a}."
)
HEADLINE_INFERENCE = (
    "The recorded forwards {what} need about {peak}: parameters {p}; inputs, activations and KV cache ≈ {a} "
    "(inference: no gradients, no optimizer state)."
)
NO_LIMIT = (
    "No memory limit is known: give one (--memory-limit SIZE, or memory_limit= in Python) for the largest batch "
    "that fits."
)
EXTRAPOLATED = "The trace ran out of memory before its first step completed: the rest of the step is extrapolated."
EXTRAPOLATED_FORWARD = (
    "The trace ran out of memory before its first forward completed: the rest of the forward is extrapolated."
)
FITS_UNDER_LIMIT = (
    'Peak allocated and reserved are the step\'s without a limit; "fits" replays it under the limit, where the '
    "allocator gives its cached blocks back and retries before it fails, so a step that reserves more than the "
    "limit without one can still fit."
)
ACCUMULATION = (
    "Gradient accumulation: the step needs what one micro-batch needs, so any batch runs as micro-batches of the "
    "largest that fits as is ({micro}), {steps} of them for {what}."
)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f}"


def _amount(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB / 2 else format_bytes(nbytes, 0)


def _batch_words(result: FitResult, batch: float | None) -> str:
    if batch is None:
        return "—"
    if result.recorded_batch:
        return f"{int(batch)}"
    return f"{batch:g}x the recorded batch"


def _ranged(outcome: LeverOutcome) -> bool:
    """Whether the largest batch is a range: the one that never reaches the limit is smaller than
    the most it can be (both are None without a limit)."""
    sure, best = outcome.batch_range
    return sure != best


def _batch_range(result: FitResult, outcome: LeverOutcome) -> str:
    """The largest batch, as a range from the one that never reaches the limit where they differ."""
    sure, best = outcome.batch_range
    if best is None or sure is None or sure == best:
        return _batch_words(result, best)
    if not sure:  # "0–4" read as a range that starts at a batch of nothing
        return f"none without a retry, up to {_batch_words(result, best)} with one"
    if result.recorded_batch:
        return f"{int(sure)}–{int(best)}"
    return f"{sure:g}x–{best:g}x the recorded batch"


BATCH_RANGE = (
    "Of a range, the first batch never takes the allocator to the limit; the larger ones fit only where the "
    "allocator, freeing its cache and retrying, finds room, which fragmentation and what the process ran before "
    "decide. With checkpointing or bf16 autocast, a step the trace did not run, the range ends where its tensors "
    "alone would fill the limit: how the allocator lays that step out is not known well enough to say less."
)


OOM_OVER_LIMIT = (
    "The run ran out of memory on a request of {request}, alone more than the {limit} it had: no batch size or "
    "lever makes that fit, and no recorded step made it (change the code that asked for it: the error's stack). "
)


def headline(r: FitResult, range_note: bool = True) -> str:
    """The answer in one or two sentences (three, where the request that failed is none of the
    step's), and what a range of batches means where it gives one (``range_note``; the report
    puts that among the steps that follow, :func:`batch_range_note`)."""
    text = _step_headline(r)
    if r.oom_request_over_limit is not None and r.memory_limit_bytes is not None:
        text = (
            OOM_OVER_LIMIT.format(
                request=format_bytes(r.oom_request_over_limit, 1), limit=format_bytes(r.memory_limit_bytes, 1)
            )
            + text
        )
    note = batch_range_note(r) if range_note else None
    return f"{text} {note}" if note else text


def batch_range_note(r: FitResult) -> str | None:
    """:data:`BATCH_RANGE` where the one-line answer gives a range of batches, else None."""
    if r.memory_limit_bytes is None:
        return None
    return BATCH_RANGE if any(_ranged(o) for o in r.levers if o.lever in HEADLINE_LEVERS) else None


def _step_headline(r: FitResult) -> str:
    breakdown = r.breakdown
    what = (
        f"at batch {_batch_words(r, r.batch)}"
        if r.batch is not None
        else ("at the recorded batch" if r.batch_scale == 1 else f"at {r.batch_scale:g}x the recorded batch")
    )
    per = breakdown.get("activations_per_sample_bytes")
    acts = (
        f"{_amount(per)} per sample"
        if per is not None
        else (f"{_amount(breakdown.get('activations_at_recorded_batch_bytes', 0))} at the recorded batch")
    )
    if r.workload == wl.FORWARD_ONLY and breakdown.get("kv_cache_at_peak_bytes"):
        acts += f", the KV cache {_amount(breakdown['kv_cache_at_peak_bytes'])} of it at the peak"
    levers = [flag for flag in (("bf16 autocast", r.bf16), ("checkpointing", r.checkpointing)) if flag[1]]
    if levers:
        what += " with " + " and ".join(lever_name for lever_name, _ in levers)
    template = HEADLINE
    if r.workload == wl.FORWARD_ONLY:
        template = HEADLINE_INFERENCE
    elif r.optimizer == wl.NO_OPTIMIZER:
        template = HEADLINE_NO_OPTIMIZER
    first = template.format(
        what=what,
        peak=format_bytes(r.peak_allocated_bytes, 1),
        p=_gib(breakdown["parameters_bytes"]),
        g=_gib(breakdown["gradients_bytes"]),
        opt=OPTIMIZER_NAMES.get(r.optimizer, r.optimizer),
        o=_gib(breakdown["optimizer_state_bytes"]),
        a=acts,
    )
    if r.memory_limit_bytes is None:
        return first + " " + NO_LIMIT
    shown = [o for lever in HEADLINE_LEVERS for o in r.levers if o.lever == lever and o.largest_batch is not None]
    parts = [f"{_batch_range(r, o)} {LEVER_PHRASES[o.lever]}" for o in shown]
    if not parts:
        return first
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return first + f" Under {format_bytes(r.memory_limit_bytes, 1)}, batch {listed} fits."


# the report's one-sentence answer (at most ANSWER_WORDS words), batches in samples where the
# recorded batch is known; the method, assumptions and caveats follow it folded (answer_method)
ANSWER_WORDS = 45
ANSWER_LEVERS = {"checkpointing": "with checkpointing", "bf16": "with bf16 autocast", "checkpointing+bf16": "with both"}
ANSWER_FITS = "{batch} fits in {limit}{workload}{where}{ran}{rest}."
ANSWER_NONE_AS_IS = "No batch fits in {limit}{workload}{where} as is{ran}{rest}."
ANSWER_NOTHING = "No batch fits in {limit}{workload}{where}{ran}, with or without checkpointing or bf16 autocast."
ANSWER_IN_SAMPLES = (
    "Batches are multiples of the recorded batch: give the recorded batch (--batch N; batch_size= when recording) "
    "for batches in samples."
)


def _short_range(r: FitResult, outcome: LeverOutcome) -> str:
    """The largest batch of a lever in few words: ``15–21`` (samples) or ``0.79x–0.95x``."""
    sure, best = outcome.batch_range
    shown = [best] if sure == best else [sure, best]
    return "–".join(f"{int(b)}" if r.recorded_batch else f"{b:g}x" for b in shown if b is not None)


def _size(nbytes: int) -> str:
    """A memory limit as people say it: ``6 GiB``, ``79.2 GiB``."""
    text = format_bytes(nbytes, 1)
    return text.replace(".0 ", " ")


def answer_sentence(r: FitResult, several_devices: bool = False) -> str | None:
    """What fits, in one sentence of at most :data:`ANSWER_WORDS` words: the largest batch as
    is, in samples where the recorded batch is known (you ran N), then with each lever that
    changes it; None without a memory limit (nothing to fit in). ``several_devices``: the file
    has more than one, so the sentence names this one's."""
    if r.memory_limit_bytes is None:
        return None
    where = f" on device {r.device}" if several_devices else ""
    ran = f" (you ran {r.recorded_batch})" if r.recorded_batch else ""
    # "inference" only where fit's evidence says the trace holds forward passes alone
    workload = " for inference" if r.workload == wl.FORWARD_ONLY else ""
    outcomes = {o.lever: o for o in r.levers if o.lever in HEADLINE_LEVERS}
    limit = _size(r.memory_limit_bytes)
    others = [
        f"{words} {_short_range(r, outcomes[name])}"
        for name, words in ANSWER_LEVERS.items()
        if name in outcomes and outcomes[name].largest_batch
    ]
    rest = "; " + ", ".join(others) if others else ""
    as_is = outcomes.get(AS_RECORDED)
    if as_is is not None and as_is.largest_batch:
        shown = _short_range(r, as_is)
        batch = f"Batch {shown}" if r.recorded_batch else f"{shown} the recorded batch"
        return ANSWER_FITS.format(batch=batch, limit=limit, workload=workload, where=where, ran=ran, rest=rest)
    template = ANSWER_NONE_AS_IS if others else ANSWER_NOTHING
    return template.format(limit=limit, workload=workload, where=where, ran=ran, rest=rest)


def samples_note(r: FitResult) -> str | None:
    """:data:`ANSWER_IN_SAMPLES` where the answer gives batches as multiples of the recorded one."""
    return ANSWER_IN_SAMPLES if r.memory_limit_bytes is not None and not r.recorded_batch else None


def _row(result: FitResult, outcome: LeverOutcome) -> list[str]:
    fits = "—" if outcome.fits is None else ("yes" if outcome.fits else "NO")
    return [
        outcome.lever,
        format_bytes(outcome.peak_allocated_bytes),
        format_bytes(outcome.peak_reserved_bytes),
        fits,
        _batch_range(result, outcome),
    ]


PARALLEL_HEAD = "Parallel strategies (snaplab plan, the recorded batch on every GPU), least change first:"
PARALLEL_REFUSED = "Parallel strategies: not planned: {why}."
WAYS_KINDS = (
    ("allocator settings", "PYTORCH_CUDA_ALLOC_CONF"),
    ("lever", "levers"),
    ("parallel strategy", "more GPUs (the fewest that fit)"),
)


def _parallel(result: FitResult) -> list[str]:
    """The strategies plan found, fitting or not, and those it refused."""
    if "all" in result.parallel_refused:
        return ["", PARALLEL_REFUSED.format(why=result.parallel_refused["all"])]
    if not result.parallel_strategies:
        return []
    rows = [
        [
            strategy.label,
            format_bytes(strategy.peak_allocated_bytes),
            format_bytes(strategy.peak_reserved_bytes),
            "—" if strategy.fits is None else ("yes" if strategy.fits else "NO"),
        ]
        for strategy in result.parallel_strategies
    ]
    out = ["", PARALLEL_HEAD, table(["strategy", "peak allocated", "peak reserved", "fits"], rows)]
    out += [f"  not planned: {label}: {why}" for label, why in result.parallel_refused.items()]
    return out


def format_fit(r: FitResult, name: str = "") -> str:
    """The whole answer as text."""
    out = [headline(r), ""]
    if not r.complete:
        out += [EXTRAPOLATED_FORWARD if r.workload == wl.FORWARD_ONLY else EXTRAPOLATED, ""]
    at_batch = f"batch {_batch_words(r, r.batch)}" if r.batch is not None else f"{r.batch_scale:g}x the recorded batch"
    largest = "largest batch" + ("" if r.recorded_batch else " (x recorded)")
    job = "the recorded forwards" if r.workload == wl.FORWARD_ONLY else "the whole step"
    out.append(f"Levers, from {name or 'the snapshot'} (device {r.device}): {job} at {at_batch}")
    out.append(
        table(["lever", "peak allocated", "peak reserved", "fits", largest], [_row(r, outcome) for outcome in r.levers])
    )
    if r.memory_limit_bytes is not None:
        out.append(f"Memory limit: {format_bytes(r.memory_limit_bytes)} ({r.memory_limit_source}).")
        if any(o.fits and o.peak_reserved_bytes > r.memory_limit_bytes for o in r.levers):
            out.append(FITS_UNDER_LIMIT)
        if batch_range_note(r) is None and any(_ranged(o) for o in r.levers):  # not said in the answer
            out.append(BATCH_RANGE)
    out += _parallel(r)
    if r.memory_limit_bytes is not None and r.ways_to_fit:
        out += ["", "What makes it fit, least change to the job first:"]
        for kind, words in WAYS_KINDS:
            labels = [way["label"] for way in r.ways_to_fit if way["kind"] == kind]
            if labels:
                out.append(f"  {words}: {'; '.join(labels)}")
    acc = r.accumulation
    if acc["accumulation_steps"] and int(acc["accumulation_steps"]) > 1:
        out.append(
            ACCUMULATION.format(
                micro=_batch_words(r, acc["micro_batch"]), steps=acc["accumulation_steps"], what=at_batch
            )
        )
    out += ["", "The recorded forwards (bytes):" if r.workload == wl.FORWARD_ONLY else "The step (bytes):"]
    out += [
        f"  {key.removesuffix('_bytes').replace('_', ' ')}: {format_bytes(nbytes)}"
        for key, nbytes in r.breakdown.items()
    ]
    out += ["", "Each lever assumes:"]
    out += [f"  - {outcome.lever}: {outcome.assumption}" for outcome in r.levers]
    out += ["", "From the trace:"]
    out += [f"  - {note}" for note in r.notes]
    return "\n".join(out) + "\n"
