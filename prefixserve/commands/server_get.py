"""GET one endpoint of a running `prefixserve serve` for the planners' --url options."""

from __future__ import annotations

from typing import Optional


def get_from_server(url: str, path: str, admin_api_key: Optional[str], transport=None):
    """(address, response) of GET `path` on the server at `url` (which may already end with it);
    a transport failure is a ValueError naming what to check. The caller judges the status."""
    import httpx

    address = url.rstrip("/")
    address = address if address.endswith(path) else address + path
    headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
    try:
        with httpx.Client(transport=transport, timeout=10.0) as client:
            return address, client.get(address, headers=headers)
    except httpx.HTTPError as error:
        raise ValueError(
            f"--url: could not fetch {address} ({error or type(error).__name__}); check the address "
            "and that the server is running"
        ) from None
