"""What ``tag_modules`` costs per module call, on the CPU, in one run (needs torch, no GPU).

A chain of ``blocks`` small blocks (``Linear`` + ``GELU``: ``2 * blocks + 1`` module calls per
step) runs forward and backward, untagged and under each way of tagging, in alternating rounds;
the allocator's setter is a C function that does nothing (``set().discard``), so what is measured
is the hooks. Prints the median step time of each and the extra microseconds per module call:

    python benchmarks/module_tags_overhead.py --blocks 100 --rounds 15

The GPU-side number (a real model, the real setter, the GPU running ahead of the CPU) comes from
``sample_snapshots/jobs/integrations_gpu.py`` (its ``overhead`` part).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from snapshot_lab.module_tags import tag_modules

NOOP = set().discard  # a C function of one argument returning None, like the allocator's setter


class Trivial:
    """Empty forward pre- and post-hooks on every module: PyTorch's own cost of having hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.h = [m.register_forward_pre_hook(lambda *a: None) for m in model.modules()]
        self.h += [m.register_forward_hook(lambda *a: None) for m in model.modules()]

    def remove(self) -> None:
        for h in self.h:
            h.remove()


class FullBackward:
    """The alternative not taken: forward hooks plus full backward (pre-)hooks on every module."""

    def __init__(self, model: nn.Module) -> None:
        self.h = []
        for name, m in model.named_modules():
            f, b = "fwd:" + name, "bwd:" + name
            self.h.append(m.register_forward_pre_hook(lambda mod, a, f=f: NOOP(f)))
            self.h.append(m.register_forward_hook(lambda mod, a, o: NOOP("")))
            self.h.append(m.register_full_backward_pre_hook(lambda mod, g, b=b: NOOP(b)))
            self.h.append(m.register_full_backward_hook(lambda mod, gi, go: NOOP("")))

    def remove(self) -> None:
        for h in self.h:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(args.blocks)])
    calls = sum(1 for _ in model.modules())
    x = torch.randn(1, 16, requires_grad=True)

    def step() -> None:
        model(x).sum().backward()

    variants: dict[str, Any] = {
        "untagged": lambda: None,
        "empty forward hooks": lambda: Trivial(model),
        "tag_modules(backward=False)": lambda: tag_modules(model, set_metadata=NOOP, backward=False),
        "tag_modules(model)": lambda: tag_modules(model, set_metadata=NOOP),
        "tag_modules(None)": lambda: tag_modules(None, set_metadata=NOOP),
        "full backward hooks": lambda: FullBackward(model),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.rounds):
        for name, make in variants.items():
            handle = make()
            for _ in range(3):
                step()
            t = time.perf_counter()
            for _ in range(args.steps):
                step()
            samples[name].append((time.perf_counter() - t) / args.steps)
            if handle is not None:
                handle.remove()
    base = statistics.median(samples["untagged"])
    print(f"torch {torch.__version__}, CPU, 1 thread; {calls} module calls per forward+backward step")
    print(f"{'untagged':30s} {base * 1e3:8.3f} ms per step")
    for name in list(variants)[1:]:
        m = statistics.median(samples[name])
        print(f"{name:30s} {m * 1e3:8.3f} ms per step  +{(m - base) / calls * 1e6:6.1f} us per module call")


if __name__ == "__main__":
    main()
