"""A DDP rank recorded with ``gradient_as_bucket_view``: its gradients are views into DDP's
buckets, and the tensors the backward made for them were freed once copied in. Those
(parameter-sized, on autograd's thread, freed within the backward) are taken as the gradients
(``plan/structure._from_ddp``). An activation's gradient can have a parameter's size too: the
8-layer GPT's ranks make 42 tensors of its embeddings' 24 MiB in every backward, so taking every
parameter-sized one (the simpler rule) gave fit's breakdown 1.20 GiB of gradients for 0.26 GiB of
parameters, and ``plan`` 974 MB of gradients at the peak of a DDP run without the bucket view,
planned from ``ddp_bucketview_rank0`` (69 MB of parameters). As many as there are parameters of
each size, the last made in each backward, are taken now: every rank's gradients are its truth's
``grad_bytes_local`` (the MLP ranks, whose sizes no activation shares, were right before too)."""

from __future__ import annotations

import json

import pytest

from snapshot_lab.metrics.fit.model import recorded_batch_bytes, step_evidence

from .conftest import SAMPLES


def _bucket_view_ranks() -> list[str]:
    names = []
    for truth in sorted(SAMPLES.glob("*bucketview*rank*.truth.json")):
        workload = json.loads(truth.read_text()).get("workload") or {}
        if workload.get("gradient_as_bucket_view") and workload.get("grad_bytes_local"):
            names.append(truth.name.removesuffix(".truth.json"))
    return names


RANKS = _bucket_view_ranks()


def test_there_are_transformer_and_mlp_ranks():
    assert sum("transformer" in n for n in RANKS) == 10 and sum("mlp" in n for n in RANKS) == 10


@pytest.mark.parametrize("name", RANKS)
def test_the_gradients_of_a_bucket_view_rank_are_its_parameters(real_frames, name):
    frames = real_frames(name)
    workload = json.loads((SAMPLES / f"{name}.truth.json").read_text())["workload"]
    device = int(frames.events["device"].iloc[0])
    assert recorded_batch_bytes(step_evidence(frames, device))["gradient"] == workload["grad_bytes_local"]
