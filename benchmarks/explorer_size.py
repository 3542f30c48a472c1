"""The report of a 1M-entry trace: its size, and how soon headless Chromium draws its first screen.

Issue #39 asks that the report, explorer included, stay one file of at most 5 MB at 1M trace
entries and draw its first screen in under 2 s. This builds the report of a synthetic 1M-entry
snapshot (``benchmarks/gen_snapshot.py``, modelled on a real run) and opens it in Debian's
chromium through Playwright, three times, printing the page's size (and the explorer's share of
it) and, for each load, the seconds from navigation to the explorer being drawn
(``html[data-explorer=ready]``, set after the first screen's drawing) and to the first paint:

    python benchmarks/explorer_size.py                      # generates the snapshot (~1 min)
    python benchmarks/explorer_size.py --snapshot /tmp/snap_1m.pickle

The what-if replay (about 20 s at 1M entries) is left out, as in tests/test_explorer.py: it does
not change what the page carries.
"""

from __future__ import annotations

import argparse
import pickle
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gen_snapshot import generate  # noqa: E402

from snapshot_lab import api  # noqa: E402

BUDGET = 5 * 1024 * 1024
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def build(snapshot: Path, out: Path) -> tuple[Path, float]:
    """The report of ``snapshot`` (without the what-if replay) and the seconds it took."""
    import snapshot_lab.metrics.diagnose as diagnose

    diagnose._whatifs = lambda *args, **kwargs: {}  # type: ignore[assignment]
    start = time.perf_counter()
    path = api.report(snapshot, output=out)
    return path, time.perf_counter() - start


def draw_times(page_path: Path, loads: int) -> list[tuple[float, float, float]]:
    """Per load: seconds to the explorer drawn (measured outside the page), the same inside the
    page (from navigation start), and to the first paint."""
    from playwright.sync_api import sync_playwright

    out = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        for _ in range(loads):
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            start = time.perf_counter()
            page.goto(page_path.as_uri())
            page.wait_for_selector("html[data-explorer=ready]", timeout=30_000)
            outside = time.perf_counter() - start
            inside = page.evaluate("performance.now()") / 1000
            paint = page.evaluate(
                "(performance.getEntriesByName('first-contentful-paint')[0] || {startTime: NaN}).startTime"
            )
            out.append((outside, inside, paint / 1000))
            page.close()
        browser.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", type=Path, help="a 1M-entry snapshot (default: generate one)")
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--loads", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = args.snapshot
        if snapshot is None:
            snapshot = Path(tmp) / "big.pickle"
            with snapshot.open("wb") as f:
                pickle.dump(generate(args.entries, extra_frames=4), f, protocol=4)
        page, seconds = build(snapshot, Path(tmp) / "big.html")
        html = page.read_text("utf-8")
        size = len(html.encode("utf-8"))
        data = re.search(r'id="snaplab-data">(.*?)</script>', html, re.S)
        explorer = len(data.group(1).encode("utf-8")) if data else 0
        print(f"report of {args.entries:,} entries built in {seconds:.1f} s")
        print(f"size: {size:,} bytes ({size / 2**20:.2f} MiB, {size / BUDGET:.0%} of the 5 MiB budget)")
        print(f"explorer data: {explorer:,} bytes ({explorer / size:.0%} of the page)")
        for k, (outside, inside, paint) in enumerate(draw_times(page, args.loads), 1):
            print(
                f"load {k}: explorer drawn {outside:.2f} s after navigation "
                f"(page clock {inside:.2f} s), first paint {paint:.2f} s"
            )


if __name__ == "__main__":
    main()
