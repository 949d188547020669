"""Sandbox networking: ``none``, ``host``, ``public`` (slirp4netns) and ``sandbox`` (gVisor
netstack on a veth with NAT), egress policy enforced with nftables outside gVisor, published
ports, and cleanup after crashes. See docs/network.md.

The public names load on first use, so the per-sandbox DNS helper
(``python -m ray_sandbox.runtime.network.dns``) starts without pydantic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["NetworkAttachment", "address", "attach", "detach", "gc", "leftovers", "link", "links",
           "reattach", "set_egress", "unlink"]

if TYPE_CHECKING:
    from ._lifecycle import (
        NetworkAttachment,
        address,
        attach,
        detach,
        gc,
        leftovers,
        link,
        links,
        reattach,
        set_egress,
        unlink,
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import _lifecycle

        return getattr(_lifecycle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
