"""Which peers may say who a client is: the addresses of the proxies in front of a service.

Behind a proxy (HAProxy for ``esa up --replicas`` and compose's replicas profile, a TLS
balancer) every device arrives from the proxy's address; uvicorn's proxy-headers middleware
takes the device's own from ``X-Forwarded-For``, but only from a peer it trusts, and the
shuffler's enrolment limit counts per that address. Trusting no peer (the default) ignores the
header; trusting any other than the proxy would let a device name any address it likes.
Settings: docs/operations.md, "Trusted proxies".
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel


def parse_trusted_proxies(value: str) -> str:
    """``value`` (comma-separated IP addresses or networks, e.g. ``10.0.0.5,10.1.0.0/24``)
    normalized; empty: trust none.

    Raises:
        ValueError: an entry that is not an IP address or network (``*`` and host names too:
            a proxy is named by its address).
    """
    found = []
    for entry in (part.strip() for part in value.split(",")):
        if not entry:
            continue
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError as error:
            raise ValueError(
                f"trusted_proxies: {entry[:64]!r} is not an IP address or network "
                "(name each proxy by its address, e.g. 10.0.0.5 or 10.0.0.0/24)"
            ) from error
        found.append(str(network.network_address) if network.num_addresses == 1 else str(network))
    return ",".join(found)


class TrustedProxySettings(BaseModel):
    """The ``trusted_proxies`` setting of a service (``ESA_<SERVICE>_TRUSTED_PROXIES``), one
    definition for every service that takes it; documented in docs/operations.md."""

    #: The proxies in front of this service (comma-separated IP addresses or networks): only
    #: from them is a client's address taken from ``X-Forwarded-For``; empty: from none.
    trusted_proxies: Annotated[str, AfterValidator(parse_trusted_proxies)] = ""


def proxy_options(proxies: str) -> dict[str, Any]:
    """Keyword arguments for ``uvicorn.run``: ``X-Forwarded-For`` read from ``proxies`` only
    (never uvicorn's own default, which trusts 127.0.0.1 or the ``FORWARDED_ALLOW_IPS``
    variable); none: the header is ignored."""
    if not proxies:
        return {"proxy_headers": False}
    return {"proxy_headers": True, "forwarded_allow_ips": proxies}
