"""A tape's column of names (category, phase) held as one byte a row.

A tape has a few distinct names in millions of rows; as an object array each row costs a
pointer (8 bytes), as :class:`Labels` one byte. It answers what the tape's readers ask of such a
column the way the object array did: ``labels == "forward"`` is the rows' mask, ``labels[rows]``
the labels of those rows, and anything that reads it as an array (``np.asarray``, ``tolist``)
gets the names themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd


class Labels:
    """``names[codes[i]]`` is row ``i``'s name (``codes``: int8)."""

    __slots__ = ("codes", "names")
    __hash__ = None  # type: ignore[assignment]  # compared row by row, like an array

    def __init__(self, codes: np.ndarray, names: tuple[Any, ...]) -> None:
        distinct = tuple(dict.fromkeys(names))
        if len(distinct) < len(names):  # a name given twice: one code for it (== finds every row)
            codes = np.array([distinct.index(name) for name in names], dtype=codes.dtype)[codes]
        self.codes = codes
        self.names = distinct

    @classmethod
    def of(cls, values: object, n: int) -> Labels:
        """Labels from an array of names, other labels, or one name for all ``n`` rows."""
        if isinstance(values, Labels):
            return values
        if not isinstance(values, np.ndarray):
            return cls(np.zeros(n, dtype=np.int8), (values,))
        codes, distinct = pd.factorize(values.reshape(-1), use_na_sentinel=False)
        return cls(codes.astype(np.int8 if distinct.size <= 127 else np.int32), tuple(distinct.tolist()))

    @staticmethod
    def concat(parts: Sequence[Labels]) -> Labels:
        """The rows of ``parts`` in order, under the names of all of them (first seen first)."""
        names: dict[Any, int] = {}
        for part in parts:
            for name in part.names:
                names.setdefault(name, len(names))
        dtype = np.int8 if len(names) <= 127 else np.int32
        recoded = [np.array([names[n] for n in part.names], dtype=dtype)[part.codes] for part in parts]
        return Labels(np.concatenate(recoded) if recoded else np.zeros(0, dtype=dtype), tuple(names))

    def __len__(self) -> int:
        return int(self.codes.size)

    @property
    def size(self) -> int:
        return int(self.codes.size)

    def __getitem__(self, rows: Any) -> Labels:
        return Labels(self.codes[rows], self.names)

    def _code(self, name: object) -> int:
        return self.names.index(name) if name in self.names else -1

    def __eq__(self, name: object) -> np.ndarray:  # type: ignore[override]
        return self.codes == self._code(name)

    def __ne__(self, name: object) -> np.ndarray:  # type: ignore[override]
        return self.codes != self._code(name)

    def isin(self, names: Iterable[object]) -> np.ndarray:
        """Whether each row's name is one of ``names``."""
        return np.isin(self.codes, [self._code(name) for name in names])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        decoded = np.empty(len(self.names), dtype=object)
        decoded[:] = self.names
        return decoded[self.codes] if dtype is None else decoded[self.codes].astype(dtype)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.tolist())

    def tolist(self) -> list[Any]:
        return [self.names[code] for code in self.codes.tolist()]

    def __repr__(self) -> str:
        return f"Labels({self.tolist()[:5]}{'...' if self.size > 5 else ''}, {self.size} rows)"
