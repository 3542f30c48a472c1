"""``SnaplabCallback`` for Hugging Face's ``transformers.Trainer``::

    from transformers import Trainer
    from snapshot_lab.integrations.transformers import SnaplabCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[SnaplabCallback(out="snaps/", every_n_steps=500, report=True)])

Records the CUDA allocator's history from ``on_train_begin`` (the Trainer has already put the
model on the GPU; the optimizer state is allocated later and is recorded), tags allocations with
the module that made them (PyTorch >= 2.10), dumps a snapshot every ``every_n_steps`` optimizer
steps (``on_step_end``), on an out-of-memory error (at the failing request, before anything
unwinds) and at ``on_train_end``, one file per rank; with ``report=True`` writes the HTML report of
the last snapshot beside it. The Trainer has no hook for other exceptions: the recording then
stops, with a last snapshot, when the process exits. The options are those of
:class:`snapshot_lab.capture.recording`. Without CUDA it logs a warning and records nothing; it
never stops training. Needs ``pip install "snapshot-lab[transformers]"``.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ._session import SessionCallback


class SnaplabCallback(SessionCallback, TrainerCallback):  # type: ignore[misc]
    __doc__ = __doc__

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        self.session.start(model)
        # the batch one forward sees on this device: the recorded batch, in samples
        self.session.saw_batch_size({"batch_size": getattr(args, "per_device_train_batch_size", None)})

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.stop()


__all__ = ["SnaplabCallback"]
