"""The page's static files, read from package data (no build step, no CDN: the machine may be offline).

Standard library only, so the router can serve the same files (router/dashboard.py) by path.
"""

from __future__ import annotations

from importlib import resources

STATIC_FILES = {  # name -> media type; nothing else under static/ is served
    "dashboard.css": "text/css; charset=utf-8",
    "util.js": "text/javascript; charset=utf-8",
    "charts.js": "text/javascript; charset=utf-8",
    "tree.js": "text/javascript; charset=utf-8",
    "whatif.js": "text/javascript; charset=utf-8",
    "fleet.js": "text/javascript; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
}
NO_CACHE = {"Cache-Control": "no-cache"}


def static_dir():
    return resources.files("prefixserve").joinpath("server", "dashboard", "static")


def page_html(mode: str) -> str:
    """index.html for `mode` "server" (one replica) or "fleet" (the router)."""
    if mode not in ("server", "fleet"):
        raise ValueError(f"dashboard mode must be 'server' or 'fleet', got {mode!r}")
    html = static_dir().joinpath("index.html").read_text(encoding="utf-8")
    return html.replace('data-mode="server"', f'data-mode="{mode}"', 1)


def static_file(name: str) -> tuple[bytes, str]:
    """(content, media type) of one of STATIC_FILES; KeyError for any other name."""
    media_type = STATIC_FILES[name]
    return static_dir().joinpath(name).read_bytes(), media_type
