"""``SnaplabCallback`` for Lightning (``lightning.pytorch``)::

    import lightning as L
    from snapshot_lab.integrations.lightning import SnaplabCallback

    trainer = L.Trainer(callbacks=[SnaplabCallback(out="snaps/", every_n_steps=500, report=True)])

Records the CUDA allocator's history while ``trainer.fit`` runs (from ``setup``, before the model
moves to the GPU), tags allocations with the module that made them (PyTorch >= 2.10), dumps a
snapshot every ``every_n_steps`` optimizer steps, on an out-of-memory error (at the failing
request, before anything unwinds), on an exception and at the end of training, one file per rank
(``<prefix>_rank<R>_<host>_<time>[_<why>].pickle`` and its ``.meta.json``), and with
``report=True`` writes the HTML report of the last snapshot beside it. The options are those of
:class:`snapshot_lab.capture.recording`. Without CUDA it logs a warning and records nothing; it
never stops training. Needs ``pip install "snapshot-lab[lightning]"``.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from ._lightning_hooks import LightningHooks


class SnaplabCallback(LightningHooks, Callback):
    __doc__ = __doc__


__all__ = ["SnaplabCallback"]
