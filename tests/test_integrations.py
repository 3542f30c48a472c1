"""The Lightning and Hugging Face callbacks, without a GPU.

In CI: fake Lightning / transformers Trainers (tests/fake_frameworks.py) drive the callbacks'
hooks in the real order, over the fake torch of test_capture.py, and what they write is read back
by snaplab. Where the real packages are installed (not in CI), the same callbacks also run
inside a real Lightning and a real transformers Trainer on the CPU, with only the recording's
torch calls stood in for (there is no CUDA to record)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from snapshot_lab import stats
from snapshot_lab.capture import CaptureError

from .fake_frameworks import FakeLightningModule, install_fake_lightning, install_fake_transformers
from .fake_torch import FakeTorch

NAME_RE = re.compile(r"^snapshot_rank(\d+)_[A-Za-z0-9.-]+_\d{8}-\d{6}(?:_([a-z0-9]+))?\.pickle$")


def _whys(paths):
    return [NAME_RE.match(p.name).group(2) for p in paths]


def _meta(path):
    return json.loads(path.with_name(path.name.replace(".pickle", ".meta.json")).read_text())


# --------------------------------------------------------------------------- Lightning


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_callback_dumps_every_n_optimizer_steps_and_reports(torch, tmp_path, monkeypatch, package):
    L = install_fake_lightning(monkeypatch, package)
    mod = __import__(f"snapshot_lab.integrations.{package}", fromlist=["SnaplabCallback"])
    cb = mod.SnaplabCallback(out=tmp_path / "snaps", every_n_steps=2, report=True)
    assert isinstance(cb, L.Callback)
    trainer = L.Trainer(callbacks=[cb], max_steps=5, accumulate_grad_batches=2)
    trainer.fit(FakeLightningModule())
    # 10 batches, 5 optimizer steps: dumps after steps 2 and 4, and one at the end of training
    assert _whys(cb.written) == ["step2", "step4", None]
    assert [_meta(p)["step"] for p in cb.written] == [2, 4, 5]
    assert torch.history_calls[0][1]["stacks"] == "python" and torch.history_calls[-1] == ((), {"enabled": None})
    (report,) = cb.reports
    assert report == cb.written[-1].with_suffix(".html")
    html = report.read_text()
    assert html.startswith("<!DOCTYPE html>") and 'id="findings"' in html
    assert stats(cb.written[-1]).file["capture"]["reason"] == "exit"


def test_lightning_exception_dumps_once_with_its_report(torch, tmp_path, monkeypatch):
    L = install_fake_lightning(monkeypatch)
    from snapshot_lab.integrations.lightning import SnaplabCallback

    cb = SnaplabCallback(out=tmp_path, report=True)
    trainer = L.Trainer(callbacks=[cb], max_steps=5, fail_at_step=3)
    with pytest.raises(RuntimeError, match="failed at step 3"):
        trainer.fit(FakeLightningModule())
    assert trainer.calls[-2:] == ["on_exception", "teardown"]
    assert _whys(cb.written) == ["exception"]  # teardown after on_exception adds nothing
    assert len(cb.reports) == 1 and cb.reports[0].exists()


def test_lightning_oom_dumps_at_the_failing_request_then_the_unwound_state(torch, tmp_path, monkeypatch):
    L = install_fake_lightning(monkeypatch)
    from snapshot_lab.integrations.lightning import SnaplabCallback

    class OutOfMemoryError(RuntimeError):
        pass

    def oom(trainer, batch_idx):
        if batch_idx == 2:
            torch.observers[0](0, 2**30, 3 * 2**30, 10 * 2**30)  # the allocator's OOM observer
            raise OutOfMemoryError("CUDA out of memory")

    cb = SnaplabCallback(out=tmp_path)
    trainer = L.Trainer(callbacks=[cb], max_steps=5)
    trainer.on_batch = oom
    with pytest.raises(OutOfMemoryError):
        trainer.fit(FakeLightningModule())
    assert _whys(cb.written) == ["oom", "exception"]
    assert _meta(cb.written[1])["incident"]["same_as"] == cb.written[0].name


def test_lightning_per_rank_names(torch, tmp_path, monkeypatch):
    L = install_fake_lightning(monkeypatch)
    from snapshot_lab.integrations.lightning import SnaplabCallback

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    cb = SnaplabCallback(out=tmp_path)
    L.Trainer(callbacks=[cb], max_steps=1).fit(FakeLightningModule())
    (path,) = cb.written
    assert NAME_RE.match(path.name).group(1) == "3" and _meta(path)["world_size"] == 4


def test_without_cuda_training_goes_on_and_nothing_is_written(tmp_path, monkeypatch, caplog):
    fake = FakeTorch()
    fake.module.cuda.is_available = lambda: False
    fake.install(monkeypatch)
    L = install_fake_lightning(monkeypatch)
    from snapshot_lab.integrations.lightning import SnaplabCallback

    cb = SnaplabCallback(out=tmp_path, report=True)
    L.Trainer(callbacks=[cb], max_steps=3).fit(FakeLightningModule())
    assert cb.written == [] and cb.reports == [] and list(tmp_path.iterdir()) == []
    assert "not recording GPU memory: CUDA is not available" in caplog.text
    assert cb.session.disabled == "CUDA is not available: there is no GPU memory to record"


def test_bad_options_fail_when_the_callback_is_made(monkeypatch):
    install_fake_lightning(monkeypatch)
    install_fake_transformers(monkeypatch)
    from snapshot_lab.integrations import lightning, transformers

    with pytest.raises(CaptureError):
        lightning.SnaplabCallback(stacks="cpp")
    with pytest.raises(CaptureError):
        transformers.SnaplabCallback(every_n_steps=0)


# --------------------------------------------------------------------------- transformers


def test_transformers_callback(torch, tmp_path, monkeypatch):
    tf = install_fake_transformers(monkeypatch)
    from snapshot_lab.integrations.transformers import SnaplabCallback

    cb = SnaplabCallback(out=tmp_path, every_n_steps=3, report=True, max_entries=5000)
    assert isinstance(cb, tf.TrainerCallback)
    trainer = tf.Trainer(
        model=object(), args=tf.TrainingArguments(max_steps=7, gradient_accumulation_steps=4), callbacks=[cb]
    )
    trainer.train()
    assert _whys(cb.written) == ["step3", "step6", None]
    assert torch.history_calls[0][1]["max_entries"] == 5000
    assert cb.reports == [cb.written[-1].with_suffix(".html")] and cb.reports[0].exists()
    assert not cb.session.active


def test_a_second_training_run_records_again(torch, tmp_path, monkeypatch):
    tf = install_fake_transformers(monkeypatch)
    from snapshot_lab.integrations.transformers import SnaplabCallback

    cb = SnaplabCallback(out=tmp_path)
    trainer = tf.Trainer(model=object(), args=tf.TrainingArguments(max_steps=2), callbacks=[cb])
    trainer.train()
    trainer.state.global_step = 0
    trainer.train()
    assert _whys(cb.written) == [None, None] and len(torch.history_calls) == 4


def test_core_imports_no_framework():
    code = (
        "import sys\n"
        "for m in ('torch', 'lightning', 'pytorch_lightning', 'transformers'): sys.modules[m] = None\n"
        "import snapshot_lab, snapshot_lab.integrations, snapshot_lab.cli, snapshot_lab.module_tags\n"
        "import snapshot_lab.pytest_plugin, snapshot_lab.notebook\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# --------------------------------------------------------------------------- the real frameworks


@pytest.fixture
def real_torch_fake_recording(monkeypatch):
    """Real torch for training on the CPU; the recording's torch calls stood in for."""
    pytest.importorskip("torch")
    fake = FakeTorch()
    monkeypatch.setattr("snapshot_lab.capture._torch", lambda: fake.module)
    monkeypatch.setattr("snapshot_lab.capture._OBSERVER_ATTACHED", False)
    return fake


def test_real_lightning_on_cpu(real_torch_fake_recording, tmp_path):
    L = pytest.importorskip("lightning")
    import torch
    from torch import nn

    from snapshot_lab.integrations.lightning import SnaplabCallback

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    cb = SnaplabCallback(out=tmp_path, every_n_steps=3, report=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=7,
        accumulate_grad_batches=2,
        callbacks=[cb],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(), torch.utils.data.DataLoader(data, batch_size=4))
    assert _whys(cb.written) == ["step3", "step6", None]
    assert cb.reports[0].exists()


def test_real_transformers_on_cpu(real_torch_fake_recording, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    from snapshot_lab.integrations.transformers import SnaplabCallback

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            ids = torch.randint(0, 100, (16,))
            return {"input_ids": ids, "labels": ids}

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
    cb = SnaplabCallback(out=tmp_path / "snaps", every_n_steps=2, report=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"),
        max_steps=5,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(
        model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=Tokens(), callbacks=[cb]
    ).train()
    assert _whys(cb.written) == ["step2", "step4", None]
    assert cb.reports[0].exists()
