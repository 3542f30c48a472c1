"""The hooks of ``SnaplabCallback`` for Lightning, framework-free so that both package names
(``lightning.pytorch`` and ``pytorch_lightning``) share them.

Lightning 2.x calls, for ``trainer.fit``: ``setup(stage='fit')`` (before the model moves to the
GPU: its parameters are recorded with their stacks), ``on_fit_start``, ``on_train_start``, per
batch ``on_train_batch_start`` ... ``on_train_batch_end`` (``trainer.global_step`` counts optimizer
steps, not batches), ``on_train_end`` (the model is still on the GPU: the final snapshot is taken
here), then its own teardown (the model moves back to the CPU), ``on_fit_end`` and
``teardown``. On an exception: ``on_exception``, then teardown.
"""

from __future__ import annotations

from typing import Any

from ._session import SessionCallback


class LightningHooks(SessionCallback):
    # what the trainer runs: fit, validate, test or predict
    _stage: str | None = None
    _last_step = 0  # the optimizer steps counted so far

    # -- start -------------------------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: Any) -> None:
        self._stage = str(getattr(stage, "value", stage))
        self.session.start(pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # resumed runs start past 0
        self._last_step = int(getattr(trainer, "global_step", 0))
        self.session.saw_batch_size(*_batch_size_holders(trainer, pl_module))

    # -- steps -------------------------------------------------------------------------------

    def on_train_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = int(getattr(trainer, "global_step", self._last_step + 1))
        while self._last_step < step:
            # gradient accumulation: no step for some batches
            self._last_step += 1
            self.session.step()

    # -- stop --------------------------------------------------------------------------------

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.session.stop()

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stage == "validate":  # not the validation inside fit
            self.session.stop()

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stage == "test":
            self.session.stop()

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        if self._stage == "predict":
            self.session.stop()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.session.stop(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: Any) -> None:
        self.session.stop()  # a no-op unless the run ended before its end hook


def _batch_size_holders(trainer: Any, pl_module: Any) -> list[Any]:
    """Where a Lightning job keeps its batch size, surest first: the training dataloader (and its
    batch sampler), the datamodule and its hyperparameters, the module's hyperparameters."""
    holders: list[Any] = []
    for owner, name in ((trainer, "train_dataloader"), (trainer, "datamodule")):
        try:
            holder = getattr(owner, name, None)
        except Exception:  # a trainer property that cannot answer here
            continue
        if holder is not None:
            holders += [holder, getattr(holder, "batch_sampler", None), getattr(holder, "hparams", None)]
    holders.append(getattr(pl_module, "hparams", None))
    return [holder for holder in holders if holder is not None]
