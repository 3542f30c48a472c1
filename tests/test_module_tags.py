"""Module tags: the metadata format, and the hooks that write it.

The format tests need nothing. The hook tests need PyTorch (not in CI: it is several GB); they
run wherever torch is installed, on CPU: the allocator's setter is replaced by one that records
what each thread was told, and a dispatch mode reads that at every operator, which is where the
CUDA allocator would read it."""

from __future__ import annotations

import logging
import sys
import threading
import types

import pytest

from snapshot_lab import module_tags
from snapshot_lab.module_tags import format_tag, parent_fqn, parse_tag, tag_modules


@pytest.mark.parametrize(
    ("metadata", "parsed"),
    [
        ("fwd:transformer.h.3.attn", ("fwd", "transformer.h.3.attn")),
        ("bwd:lm_head", ("bwd", "lm_head")),
        ("rec:layers.0", ("rec", "layers.0")),
        ("fwd:", ("fwd", "")),  # the root module's own code
        ("", None),  # outside any module
        (None, None),
        ("my own metadata", None),  # a program's own strings are not ours
        ("xyz:a.b", None),
        ({"a": 1}, None),
    ],
)
def test_parse_tag(metadata, parsed):
    assert parse_tag(metadata) == parsed


def test_format_round_trips_and_parents():
    for phase in module_tags.PHASES:
        assert parse_tag(format_tag(phase, "a.b.c")) == (phase, "a.b.c")
    with pytest.raises(ValueError):
        format_tag("forward", "a")
    assert [parent_fqn(x) for x in ("a.b.c", "a", "")] == ["a.b", "", None]


def test_without_torch_it_is_a_no_op_that_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    h = tag_modules(object())
    assert not h.enabled and h.reason == "PyTorch is not installed"
    h.remove()
    assert h.describe()["enabled"] is False


def test_old_torch_is_a_no_op_that_says_it_needs_2_10(monkeypatch, caplog):
    from .fake_torch import FakeTorch

    FakeTorch(version="2.9.1").install(monkeypatch)  # no torch.cuda.memory._set_memory_metadata
    monkeypatch.setattr(module_tags, "_WARNED", set())
    with caplog.at_level(logging.WARNING), tag_modules(object()) as h:
        assert not h.enabled
    assert "needs PyTorch >= 2.10" in h.reason and "2.9.1" in h.reason
    assert "per-module attribution needs PyTorch >= 2.10" in caplog.text
    assert h.describe() == {
        "format": 1,
        "enabled": False,
        "reason": h.reason,
        "mode": "model",
        "backward": True,
        "modules": {},
    }


def test_no_cuda_is_a_no_op(monkeypatch):
    from .fake_torch import FakeTorch

    fake = FakeTorch()
    fake.module.cuda.memory._set_memory_metadata = lambda s: None
    fake.module.cuda.is_available = lambda: False
    fake.install(monkeypatch)
    h = tag_modules(None)
    assert not h.enabled and h.mode == "process" and "CUDA is not available" in h.reason


def test_bad_depth():
    with pytest.raises(ValueError):
        tag_modules(None, max_depth=-1)


# --------------------------------------------------------------------------- with real torch


@pytest.fixture
def torch():
    return pytest.importorskip("torch")


class Recorder:
    """Stands in for the allocator: remembers each thread's metadata, and (as a dispatch mode)
    which metadata every operator ran under, compressed into runs of one tag."""

    def __init__(self, torch):
        from torch.utils._python_dispatch import TorchDispatchMode

        self.current: dict[int, str] = {}
        self.calls = 0
        self.log: list[tuple[str, str]] = []
        rec = self

        class Probe(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                rec.log.append((rec.current.get(threading.get_ident(), ""), func.__name__.split(".")[0]))
                return out

        self.mode = Probe

    def set(self, s: str) -> None:
        self.calls += 1
        self.current[threading.get_ident()] = s

    def runs(self) -> list[str]:
        out: list[str] = []
        for tag, _ in self.log:
            if not out or out[-1] != tag:
                out.append(tag)
        return out

    def ops(self, tag: str) -> list[str]:
        return [op for t, op in self.log if t == tag]


def _net(torch, checkpointed: bool = False):
    nn = torch.nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)  # in place on a hooked module's output: must not break

        def forward(self, x):
            return self.act(self.lin(x)) * 2 + x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Block()
            self.b = Block()
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            x = checkpoint(self.a, x, use_reentrant=False) if checkpointed else self.a(x)
            return self.head(self.b(x)).sum()

    return Net()


def test_forward_and_backward_tags(torch):
    rec = Recorder(torch)
    net = _net(torch)
    x = torch.randn(2, 4, requires_grad=True)
    with tag_modules(net, set_metadata=rec.set) as h, rec.mode():
        assert h.enabled and h.mode == "model"
        loss = net(x)
        loss.backward()
    assert rec.runs() == [
        "fwd:a.lin",
        "fwd:a.act",
        "fwd:a",
        "fwd:b.lin",
        "fwd:b.act",
        "fwd:b",
        "fwd:head",
        "fwd:",
        "",  # backward() makes the first gradient outside any module
        "bwd:",
        "bwd:head",
        "bwd:b",  # the block's own ops (the residual; the in-place ReLU, which returned its input)
        "bwd:b.lin",
        "bwd:a",
        "bwd:a.lin",
        "",  # reset when the backward ended
    ]
    assert "mm" in rec.ops("bwd:b.lin") and "threshold_backward" in rec.ops("bwd:b")
    assert "relu_" in rec.ops("fwd:b.act")
    assert h.modules == {
        "": "Net",
        "a": "Block",
        "a.lin": "Linear",
        "a.act": "ReLU",
        "b": "Block",
        "b.lin": "Linear",
        "b.act": "ReLU",
        "head": "Linear",
    }
    assert rec.current[threading.get_ident()] == ""


def test_activation_checkpointing_is_tagged_as_recomputed(torch):
    rec = Recorder(torch)
    net = _net(torch, checkpointed=True)
    with tag_modules(net, set_metadata=rec.set), rec.mode():
        net(torch.randn(2, 4, requires_grad=True)).backward()
    runs = rec.runs()
    assert "rec:a.lin" in runs and "rec:a.act" in runs
    assert runs.index("rec:a.lin") > runs.index("bwd:b.lin")  # recomputed when the backward reaches it
    assert "addmm" in rec.ops("rec:a.lin")


def test_an_exception_in_forward_unwinds_the_tags(torch):
    rec = Recorder(torch)
    nn = torch.nn

    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def forward(self, x):
            self.inner(x)
            raise ValueError("boom")

    outer = nn.Sequential(Boom())
    with tag_modules(outer, set_metadata=rec.set):
        with pytest.raises(ValueError):
            outer(torch.randn(1, 2))
        assert rec.current[threading.get_ident()] == ""
        assert module_tags._STATE.stack == []


def test_no_grad_and_inference_register_no_backward_hooks(torch):
    rec = Recorder(torch)
    net = _net(torch)
    x = torch.randn(2, 4)
    with tag_modules(net, set_metadata=rec.set), torch.inference_mode(), rec.mode():
        net(x)
    assert rec.runs()[0] == "fwd:a.lin" and all(not t.startswith("bwd") for t in rec.runs())


def test_process_wide_tags_name_roots_by_class_and_explicit_tags_win(torch):
    rec = Recorder(torch)
    net = _net(torch)
    with tag_modules(None, set_metadata=rec.set) as everything:
        assert everything.mode == "process"
        with rec.mode():
            net(torch.randn(2, 4)).backward()
        assert "fwd:Net.b.lin" in rec.runs() and "bwd:Net.a.lin" in rec.runs()
        assert everything.modules["Net.a.lin"] == "Linear"
        rec.log.clear()
        with tag_modules(net, prefix="student", set_metadata=rec.set), rec.mode():
            net(torch.randn(2, 4)).backward()
        assert "fwd:student.b.lin" in rec.runs() and "bwd:student.a.lin" in rec.runs()
        assert not any("Net." in t for t in rec.runs())
    from torch.nn.modules import module

    assert not module._global_forward_hooks and not module._global_forward_pre_hooks
    assert not module._global_forward_hooks_with_kwargs  # torch forgets this one; we do not


def test_max_depth_and_remove(torch):
    rec = Recorder(torch)
    net = _net(torch)
    h = tag_modules(net, max_depth=1, set_metadata=rec.set)
    with rec.mode():
        net(torch.randn(2, 4)).backward()
    assert set(rec.runs()) == {"fwd:a", "fwd:b", "fwd:head", "fwd:", "", "bwd:", "bwd:head", "bwd:b", "bwd:a"}
    h.remove()
    h.remove()
    calls = rec.calls
    net(torch.randn(2, 4)).backward()
    assert rec.calls == calls  # no hook left
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_torch_compile_runs_without_tags_inside(torch):
    rec = Recorder(torch)
    net = _net(torch)
    with tag_modules(net, set_metadata=rec.set):
        compiled = torch.compile(net, backend="eager")
        compiled(torch.randn(2, 4)).backward()
        compiled(torch.randn(2, 4)).backward()
    assert rec.calls == 0


def test_the_real_setter_is_used_when_cuda_is_there(torch, monkeypatch):
    seen = []
    fake_c = types.SimpleNamespace(_cuda_setMemoryMetadata=seen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda.memory, "_set_memory_metadata", lambda s: None, raising=False)
    monkeypatch.setattr(module_tags, "_torch", lambda: types.SimpleNamespace(**{**vars(torch), "_C": fake_c}))
    setter, reason = module_tags._metadata_setter(module_tags._torch())
    assert reason is None and setter == seen.append


def test_a_module_is_tagged_once_however_many_taggers(torch):
    """Nested recordings, or a callback and a recording both tagging: the hooks of a second
    tagger would unbalance the first one's stack, so a module keeps its first tagger."""
    rec = Recorder(torch)
    net = _net(torch)
    outer = tag_modules(net, set_metadata=rec.set)
    inner = tag_modules(net, prefix="again", set_metadata=rec.set)
    assert inner.modules == {}
    assert all(len(m._forward_pre_hooks) == 1 for m in net.modules())
    with rec.mode():
        net(torch.randn(2, 4)).backward()
    assert "fwd:b.lin" in rec.runs() and not any("again" in t for t in rec.runs())
    inner.remove()
    outer.remove()
    assert all(not m._forward_pre_hooks for m in net.modules())

    from torch.nn.modules import module

    everything = tag_modules(None, set_metadata=rec.set)
    nested = tag_modules(None, set_metadata=rec.set)
    assert nested.enabled and nested.reason == "already tagged by an enclosing tag_modules(None)"
    assert len(module._global_forward_pre_hooks) == 1
    nested.remove()
    assert everything.active and len(module._global_forward_pre_hooks) == 1
    everything.remove()
    assert not module._global_forward_pre_hooks
