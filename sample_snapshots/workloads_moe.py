"""Issue #37, part 6: ``fit`` on a family it never saw, recorded on 2026-11-28 after every fit rule.

``mixtral``: a mixture-of-experts decoder from a Hugging Face ``MixtralConfig`` (8 layers, d=512,
8 heads with 4 key/value heads, 8 experts of SwiGLU width 1024 per layer, top-2 routing, vocab
32000, 512 tokens, no dropout), fp32 weights, AdamW. Its experts see a data-dependent number of
tokens each, so the step's tensors are not the same sizes from one batch to the next: what a
dense model's rules assume.

The same measurements as ``workloads_fit.py``'s families (its ``measure``/``table_job``/
``_snapshot_run``, imported, not copied): the peak over two whole steps of a fresh model at five
batches per lever, uncapped, and the largest batch under a 6 GiB cap (doubling then bisection);
the complete recording at batch 2 under each lever; the recording that runs out of memory in its
first forward at batch 64 under the cap. Then (``moe_fresh_*`` groups, chosen after the first
analysis) single batches run in a process of their own, without memory history, under the cap:
does the batch ``fit`` calls safe really run?

    python3 sample_snapshots/workloads_moe.py all --groups moe --out /tmp/moe --jobs 8
    python3 sample_snapshots/workloads_moe.py all --groups moe_fresh_plain_b7,moe_fresh_bf16_b9 --out /tmp/moe
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads_fit as W
import workloads_holdout as H

FAMILY = "mixtral"
W.FAMILIES[FAMILY] = {"batches": [1, 2, 4, 8, 16], "complete": 2, "oom": 64, "search_max": 128}
W.TOKENS[FAMILY] = (32000, 512)
FRESH_BATCHES = range(1, 33)
_dense_build = W.build


def build(family: str, lever: str):
    """The Mixtral-config model for ``mixtral``, the fit families' models otherwise."""
    if family != FAMILY:
        return _dense_build(family, lever)
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    return W._transformers_model(MixtralForCausalLM(cfg).to("cuda"), lever)


W.build = build  # measure() and _snapshot_run() look the name up in their module

for _lever in W.LEVERS:
    H.workload(f"fittable_{FAMILY}_{_lever}", "moe")(lambda v=_lever: W.table_job(FAMILY, v))
    H.workload(f"fit_{FAMILY}_b2_{'' if _lever == 'plain' else _lever.replace('+', '_') + '_'}complete_python", "moe")(
        lambda v=_lever: W._snapshot_run(FAMILY, 2, False, v)
    )
    for _batch in FRESH_BATCHES:
        _tag = f"{_lever.replace('+', '_')}_b{_batch}"
        H.workload(f"fresh_{FAMILY}_{_tag}", f"moe_fresh_{_tag}")(lambda v=_lever, b=_batch: W._fresh_run(FAMILY, v, b))
H.workload(f"fit_{FAMILY}_b64_oom_python", "moe")(lambda: W._snapshot_run(FAMILY, 64, True))

# then (group fit_expandable), does fit's expandable_segments row hold? Once fit laid the step out as
# the what-if does (expandable segments grow upward), it said under 6 GiB: GPT-2 (batch 4 complete
# recording) 4 fits, the Llama 6, the Mixtral 8. Each batch and the one above, fresh, under the cap,
# with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set before CUDA starts.
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
EXPANDABLE_RUNS = {"gpt2": (4, 5), "llama": (6, 7), FAMILY: (8, 9)}


def _expandable_run(family: str, batch: int) -> None:
    import json
    import os

    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(W._cap(family) / total)
    res = W.measure(family, "plain", batch)
    out = {
        "family": family,
        "lever": "plain",
        "batch": batch,
        "cap_bytes": W._cap(family),
        "fresh_process": True,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "result": res,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0),
    }
    print(family, batch, res, flush=True)
    (H.OUT / f"fresh_expandable_{family}_b{batch}.json").write_text(json.dumps(out, indent=1))


for _family, _batches in EXPANDABLE_RUNS.items():
    for _batch in _batches:
        H.workload(f"fresh_expandable_{_family}_b{_batch}", "fit_expandable", env=EXPANDABLE)(
            lambda f=_family, b=_batch: _expandable_run(f, b)
        )

if __name__ == "__main__":
    H.__file__ = __file__  # the pool spawns this script, whose workloads these are
    H.main()
