"""Only for SNAPLAB_DRY=1 SNAPLAB_DRY_CAPTURE=1 (workloads_parallel.py then puts this folder first
on PYTHONPATH): a CPU stand-in for the CUDA calls of snapshot_lab.capture, so that the non-dry
dump path of jobs/train_parallel.py (dump, xz, sidecar copy, truth) runs on a machine without a
GPU. The counters and the snapshot are dummies; torch itself is untouched but for
torch.cuda.current_device and get_device_name, which the job's truth file asks."""

import os
import sys
import types
from pathlib import Path

if os.environ.get("SNAPLAB_DRY") and os.environ.get("SNAPLAB_DRY_CAPTURE"):
    try:
        import snapshot_lab.capture as _cap
    except ImportError:  # as jobs/capture_run.py: capture without the package's dependencies
        import importlib

        _pkg = types.ModuleType("snapshot_lab")
        _pkg.__path__ = [str(Path(__file__).resolve().parents[3] / "snapshot_lab")]
        sys.modules["snapshot_lab"] = _pkg
        _cap = importlib.import_module("snapshot_lab.capture")

    def _fake_torch():
        import torch
        import torch.cuda

        class Proxy:
            def __getattr__(self, name):
                return getattr(torch, name)

        p = Proxy()
        trace = [{"action": "alloc", "addr": 1, "size": 512, "stream": 0, "time_us": 1, "frames": []}]
        p.cuda = types.SimpleNamespace(
            is_available=lambda: True,
            device_count=lambda: 1,
            current_device=lambda: 0,
            memory_stats=lambda d=None: {
                "allocated_bytes.all.peak": 123,
                "reserved_bytes.all.peak": 2097152,
                "reserved_bytes.all.current": 2097152,
            },
            get_device_properties=lambda d=None: types.SimpleNamespace(total_memory=141 * 2**30),
            memory=types.SimpleNamespace(
                _record_memory_history=lambda *a, **k: None,
                _snapshot=lambda: {"segments": [], "device_traces": [trace]},
            ),
        )
        p._C = types.SimpleNamespace(_cuda_attach_out_of_memory_observer=lambda f: None)
        p.__version__ = torch.__version__
        torch.cuda.current_device = lambda: 0
        torch.cuda.get_device_name = lambda d=None: "stand-in GPU (dry run)"
        return p

    _cap._torch = _fake_torch
