"""The dashboard tests' helpers: a real browser (Debian's chromium driven by Playwright, never Playwright's
own download), background traffic, a live router, /metrics as a dict.

`.ci/run` installs chromium and Playwright; elsewhere the tests that need them skip, naming what is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

# Screenshots go to a temporary folder, so a test run leaves the checkout clean;
# PREFIXSERVE_SCREENSHOTS=docs/screenshots regenerates the docs' (docs/dashboard.md).
SCREENSHOTS = Path(os.environ.get("PREFIXSERVE_SCREENSHOTS") or Path(tempfile.gettempdir()) / "prefixserve-screenshots")
WAIT_MS = 30_000  # the longest a page condition may take to become true


def chromium_path() -> Optional[str]:
    for candidate in (os.environ.get("PREFIXSERVE_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[object]:
    """A fresh page in headless chromium; skips the test when Playwright or chromium is absent."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium binary: apt-get install chromium (or set PREFIXSERVE_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start;
        # --disable-dev-shm-usage: containers often have a tiny /dev/shm, which crashes renderers
        browser = playwright.chromium.launch(
            executable_path=path, headless=True, args=["--no-sandbox", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(WAIT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.js_errors = errors  # a test asserts none happened
            yield page
        finally:
            browser.close()


def metrics_samples(url: str, key: Optional[str] = None) -> dict:
    """/metrics as {'name{label="v",...}': value}, histogram buckets and _created left out; `key` (the admin or
    metrics key) where tenants have keys."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    out = {}
    response = httpx.get(url + "/metrics", headers=headers)
    assert response.status_code == 200, response.text
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[sample.name + ("{" + labels + "}" if labels else "")] = sample.value
    return out


def enter_admin_key(page, key: str) -> None:
    page.fill("#admin-key", key)
    page.click("#key-form button")


def wait_for_updates(page, count: int = 1, tree: bool = False) -> None:
    """Until the page has drawn `count` more snapshots (and, with `tree`, one more tree) than now."""
    attribute = "treeUpdates" if tree else "updates"
    now = page.evaluate(f"Number(document.body.dataset.{attribute} || 0)")
    page.wait_for_function(f"Number(document.body.dataset.{attribute} || 0) >= {now + count}")


def save_screenshot(page, name: str, selector: Optional[str] = None) -> Path:
    """docs/screenshots/<name>: the whole page, or the element at `selector`."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / name
    if selector is None:
        page.screenshot(path=str(path), full_page=True)
    else:
        page.locator(selector).screenshot(path=str(path))
    return path


class Traffic:
    """A background client sending `make_body(i)` to /v1/completions, at most `max_requests` times, until stopped."""

    def __init__(
        self,
        url: str,
        make_body: Callable[[int], dict],
        headers: Optional[Callable[[int], dict]] = None,
        max_requests: int = 400,
    ) -> None:
        self.url, self.make_body, self.headers = url, make_body, headers or (lambda i: {})
        self.max_requests = max_requests
        self.num_sent = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=120) as client:
            for i in range(self.max_requests):
                if self._stop.is_set():
                    return
                response = client.post(self.url + "/v1/completions", json=self.make_body(i), headers=self.headers(i))
                self.num_sent += 1
                if response.status_code != 200:
                    self.failures.append(response.text)

    def __enter__(self) -> "Traffic":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "traffic did not stop"


class LiveRouter:
    """`prefixserve route` (in process, uvicorn on a free 127.0.0.1 port) over replicas already running."""

    def __init__(self, replica_urls: list[str], admin_api_key: Optional[str]) -> None:
        import uvicorn
        from server_helpers import free_port

        from prefixserve.router.app import RouterSettings, build_router_app

        settings = RouterSettings(
            replicas=tuple(f"r{i}={url}" for i, url in enumerate(replica_urls)),
            admin_api_key=admin_api_key,
            health_interval=0.3,
            sync_interval=0.1,
        )
        self.app = build_router_app(settings)
        self.url = f"http://127.0.0.1:{free_port()}"
        port = int(self.url.rsplit(":", 1)[1])
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveRouter":
        self.thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # healthy = every replica passed a health check
            try:
                response = httpx.get(self.url + "/health", timeout=1)
                if response.status_code == 200 and len(response.json()["healthy_replicas"]) == len(
                    self.app.state.router.replicas
                ):
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("the router did not see every replica healthy within 30 s")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
