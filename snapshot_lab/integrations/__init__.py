"""Memory snapshots from the training frameworks people already use.

- :mod:`snapshot_lab.integrations.lightning`: ``SnaplabCallback`` for ``lightning.pytorch``
  (:mod:`snapshot_lab.integrations.pytorch_lightning` for the older ``pytorch_lightning`` name).
- :mod:`snapshot_lab.integrations.transformers`: ``SnaplabCallback`` for Hugging Face's ``Trainer``.

Each is an optional dependency: importing this package imports none of them, and the core install
stays free of them (``pip install "snapshot-lab[lightning]"`` or ``"snapshot-lab[transformers]"``). All of
them record through :class:`snapshot_lab.capture.recording`, with its options and file names.
"""
