"""Human-readable numbers."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None, precision: int = 2) -> str:
    """``1536 -> '1.50 KiB'``; binary units, as PyTorch and nvidia-smi use."""
    if n is None:
        return "—"
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{sign}{int(value)} B"
            return f"{sign}{value:.{precision}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """``'40GiB' -> 42949672960``; accepts B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB (all binary).
    A number without a unit is refused: ``40`` would mean 40 bytes where 40 GiB was meant."""
    s = text.strip().replace(" ", "")
    if s[-1:].isdigit() or s.endswith("."):
        raise ValueError(f"a size needs a unit: {text!r} (try 40GiB, 512MiB, or 40B for bytes)")
    num = s.rstrip("BbiKkMmGgTtPp")
    unit = s[len(num) :].lower().replace("ib", "").replace("b", "")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in scale or not num or not value >= 0 or value == float("inf"):
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 40GiB)")
    return int(value * scale[unit])


def format_percent(x: float | None, precision: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{precision}f}%"
