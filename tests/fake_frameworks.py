"""Stand-ins for Lightning and Hugging Face's Trainer (neither is installed in CI: each pulls in
torch, several GB). Each fake Trainer calls its callbacks' hooks in the order, and with the
arguments, that the real one does; the order was read off real runs (Lightning 2.6.6 and
transformers 5.17.0, CPU, see test_integrations.py) and from their sources:

Lightning ``fit``: setup(stage='fit'), on_fit_start, on_train_start, on_train_epoch_start, then per
batch on_train_batch_start, [on_before_backward, on_after_backward, on_before_optimizer_step when a
step is due, global_step += 1], on_train_batch_end; on_train_epoch_end, on_train_end, (the
strategy's teardown), on_fit_end, teardown(stage='fit'). On an exception: on_exception, teardown.

transformers ``train``: on_train_begin (model=...), on_epoch_begin, per step on_step_begin,
on_substep_end for accumulated micro-batches, on_pre_optimizer_step, on_optimizer_step,
on_step_end (global_step already counts it), on_epoch_end, on_log, on_train_end. Every hook gets
(args, state, control) and the keyword arguments model, processing_class, optimizer,
lr_scheduler, train_dataloader, eval_dataloader. There is no hook for exceptions.
"""

from __future__ import annotations

import sys
import types
from typing import Any

# --------------------------------------------------------------------------- Lightning


class FakeLightningModule:
    """What the callbacks may touch of a LightningModule (they only pass it to tag_modules)."""

    def __init__(self) -> None:
        self.global_step = 0


class _LightningCallback:
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None: ...
    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None: ...
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None: ...
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None: ...
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None: ...
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None: ...
    def on_validation_end(self, trainer: Any, pl_module: Any) -> None: ...
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None: ...


class FakeLightningTrainer:
    def __init__(
        self,
        *,
        callbacks: list[Any] | None = None,
        max_steps: int = 10,
        accumulate_grad_batches: int = 1,
        fail_at_step: int | None = None,
        **_: Any,
    ) -> None:
        self.callbacks = list(callbacks or [])
        self.max_steps = max_steps
        self.accumulate = accumulate_grad_batches
        self.fail_at_step = fail_at_step
        self.global_step = 0
        self.calls: list[str] = []
        self.on_batch: Any = None  # the training step's body, for tests (e.g. to make an OOM)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append(name)
        for cb in self.callbacks:
            getattr(cb, name)(self, self._module, *args, **kwargs)

    def fit(self, model: Any, train_dataloaders: Any = None, **_: Any) -> None:
        self._module = model
        try:
            self._call("setup", stage="fit")
            self._call("on_fit_start")
            self._call("on_train_start")
            self._call("on_train_epoch_start")
            batch_idx = 0
            while self.global_step < self.max_steps:
                batch = ("x", batch_idx)
                self._call("on_train_batch_start", batch, batch_idx)
                if self.fail_at_step is not None and self.global_step == self.fail_at_step:
                    raise RuntimeError(f"training failed at step {self.global_step}")
                if self.on_batch is not None:
                    self.on_batch(self, batch_idx)
                self._call("on_before_backward", "loss")
                self._call("on_after_backward")
                if (batch_idx + 1) % self.accumulate == 0:
                    self._call("on_before_optimizer_step", "optimizer")
                    self.global_step += 1
                self._call("on_train_batch_end", {"loss": 0.0}, batch, batch_idx)
                batch_idx += 1
            self._call("on_train_epoch_end")
            self._call("on_train_end")
            self._call("on_fit_end")
            self._call("teardown", stage="fit")
        except BaseException as exc:
            self._call("on_exception", exc)
            self._call("teardown", stage="fit")
            raise


def install_fake_lightning(monkeypatch: Any, name: str = "lightning") -> types.ModuleType:
    """``lightning`` (with ``lightning.pytorch``) or ``pytorch_lightning`` in sys.modules."""
    top = types.ModuleType(name)
    pl = top if name == "pytorch_lightning" else types.ModuleType(f"{name}.pytorch")
    callbacks = types.ModuleType(f"{pl.__name__}.callbacks")
    callbacks.Callback = _LightningCallback  # type: ignore[attr-defined]
    for mod in {top, pl}:
        mod.Trainer = FakeLightningTrainer  # type: ignore[attr-defined]
        mod.LightningModule = FakeLightningModule  # type: ignore[attr-defined]
        mod.Callback = _LightningCallback  # type: ignore[attr-defined]
    pl.callbacks = callbacks  # type: ignore[attr-defined]
    if pl is not top:
        top.pytorch = pl  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, pl.__name__, pl)
    monkeypatch.setitem(sys.modules, name, top)
    monkeypatch.setitem(sys.modules, callbacks.__name__, callbacks)
    _forget(monkeypatch, "snapshot_lab.integrations.lightning", "snapshot_lab.integrations.pytorch_lightning")
    return top


def _forget(monkeypatch: Any, *names: str) -> None:
    """Import these modules afresh against the fake, and forget that import after the test (a
    later test may have the real framework)."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)  # remembers whether it was there, and what
        del sys.modules[name]


# --------------------------------------------------------------------------- transformers


class TrainerCallback:
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...
    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None: ...


class TrainingArguments:
    def __init__(
        self, output_dir: str = "out", max_steps: int = 10, gradient_accumulation_steps: int = 1, **kwargs: Any
    ) -> None:
        self.output_dir = output_dir
        self.max_steps = max_steps
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.__dict__.update(kwargs)


class FakeHFTrainer:
    def __init__(
        self,
        model: Any = None,
        args: TrainingArguments | None = None,
        train_dataset: Any = None,
        callbacks: list[Any] | None = None,
        **_: Any,
    ) -> None:
        self.model = model
        self.args = args or TrainingArguments()
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks or []]
        self.state = types.SimpleNamespace(global_step=0, is_world_process_zero=True)
        self.control = types.SimpleNamespace()
        self.calls: list[str] = []
        self._call("on_init_end")

    def _call(self, name: str, **extra: Any) -> None:
        self.calls.append(name)
        kwargs = {
            "model": self.model,
            "processing_class": None,
            "optimizer": None,
            "lr_scheduler": None,
            "train_dataloader": None,
            "eval_dataloader": None,
            **extra,
        }
        for cb in self.callbacks:
            getattr(cb, name)(self.args, self.state, self.control, **kwargs)

    def train(self) -> types.SimpleNamespace:
        self._call("on_train_begin")
        self._call("on_epoch_begin")
        while self.state.global_step < self.args.max_steps:
            self._call("on_step_begin")
            for _ in range(self.args.gradient_accumulation_steps - 1):
                self._call("on_substep_end")
            self._call("on_pre_optimizer_step")
            self._call("on_optimizer_step")
            self.state.global_step += 1
            self._call("on_step_end")
        self._call("on_epoch_end")
        self._call("on_log", logs={"train_loss": 0.0})
        self._call("on_train_end")
        return types.SimpleNamespace(global_step=self.state.global_step)


def install_fake_transformers(monkeypatch: Any) -> types.ModuleType:
    mod = types.ModuleType("transformers")
    mod.TrainerCallback = TrainerCallback  # type: ignore[attr-defined]
    mod.TrainingArguments = TrainingArguments  # type: ignore[attr-defined]
    mod.Trainer = FakeHFTrainer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", mod)
    _forget(monkeypatch, "snapshot_lab.integrations.transformers")
    return mod
