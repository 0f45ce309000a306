"""Debian's ``chromium``, headless, driven by Playwright: how the tests and ``bench/inspect_load.py``
open the page. Playwright (the ``dev`` extra) drives the system browser; nothing is downloaded."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext

CHROMIUM = "/usr/bin/chromium"
# headless in a container (no sandbox, no GPU) and quiet: no update, sync or background traffic
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chromium(width: int = 1400, height: int = 1000) -> Iterator[BrowserContext]:
    """A browser context on a fresh profile (``--user-data-dir``), removed afterwards."""
    from playwright.sync_api import sync_playwright

    with (
        tempfile.TemporaryDirectory(prefix="relayrl-chromium-", ignore_cleanup_errors=True) as profile,
        sync_playwright() as p,
        p.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            args=FLAGS,
            headless=True,
            viewport={"width": width, "height": height},
        ) as ctx,
    ):
        yield ctx
