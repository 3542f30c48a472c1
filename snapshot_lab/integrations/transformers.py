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

import os
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ._session import CaptureSession


class SnaplabCallback(TrainerCallback):  # type: ignore[misc]
    __doc__ = __doc__

    def __init__(
        self,
        out: str | os.PathLike[str] = "snapshots",
        *,
        every_n_steps: int | None = None,
        on_oom: bool = True,
        max_entries: int = 100_000,
        stacks: str = "python",
        context: str = "all",
        prefix: str = "snapshot",
        report: bool = False,
        tag_modules: bool = True,
    ) -> None:
        self.session = CaptureSession(
            out,
            max_entries=max_entries,
            stacks=stacks,
            context=context,
            on_oom=on_oom,
            every_n_steps=every_n_steps,
            prefix=prefix,
            report=report,
            tag_modules=tag_modules,
        )

    @property
    def written(self) -> list[Path]:
        """Every snapshot written so far (all ranks write their own, named by rank)."""
        return list(self.session.written)

    @property
    def reports(self) -> list[Path]:
        """The HTML reports written (with ``report=True``)."""
        return list(self.session.reports)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.session.start(model)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.stop()


__all__ = ["SnaplabCallback"]
