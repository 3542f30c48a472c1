"""``SnaplabCallback`` for the ``pytorch_lightning`` package name (the same Lightning 2.x under
its older name); see :mod:`snapshot_lab.integrations.lightning`."""

from __future__ import annotations

from pytorch_lightning.callbacks import Callback

from ._lightning_hooks import LightningHooks


class SnaplabCallback(LightningHooks, Callback):
    __doc__ = __doc__


__all__ = ["SnaplabCallback"]
