"""Headless Chromium for the report's browser tests: Debian's chromium driven by Playwright
(real clicks, typing and reads of the page). Tests that need it are marked with
:func:`needs_browser` and skip when chromium or playwright is missing (CI machines without a
browser); here both are installed and they run."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and Path(p).exists()), None)
HAS_PLAYWRIGHT = importlib.util.find_spec("playwright") is not None
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def needs_browser(test: Any) -> Any:
    """Marked ``browser``; skipped without chromium or playwright."""
    for mark in (
        pytest.mark.browser,
        pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed"),
        pytest.mark.skipif(not HAS_PLAYWRIGHT, reason="playwright is not installed (pip install playwright)"),
    ):
        test = mark(test)
    return test


def chromium() -> Iterator[Any]:
    """A launched browser (for a fixture to ``yield from``); skips without one."""
    if CHROMIUM is None or not HAS_PLAYWRIGHT:
        pytest.skip("needs chromium and playwright")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def open_page(browser: Any, path: Path, width: int = 1280) -> tuple[Any, list[str], list[str]]:
    """The page at ``path`` once its explorer is ready, with the console's errors and warnings
    and every request it makes (each list filled as the page runs)."""
    page = browser.new_page(viewport={"width": width, "height": 900})
    problems: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    page.goto(path.as_uri())
    page.wait_for_selector("html[data-explorer=ready]", timeout=10_000)
    return page, problems, requests
