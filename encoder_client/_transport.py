"""The SDK's HTTP: the signed config fetched and contributions and enrolments POSTed, each
request within a whole-request deadline (:mod:`common.fetching`).

httpx and what it loads are the largest part of the SDK's dependencies, so a :class:`Transport`
is imported by the first ``Client`` constructed, never by ``import encoder_client`` (docs/sdk.md,
"What importing costs").
"""

from __future__ import annotations

import functools
import json
import ssl
from collections.abc import Mapping
from typing import Any

import httpx

from common.fetching import (
    MAX_CONFIG_BYTES,
    Fetched,
    FetchTooLargeError,
    deadline_client,
    fetch_within,
    post_within,
)
from encoder_client._errors import ConfigError


@functools.lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context (httpx's trust store, certifi) shared by every Client:
    building one reads the whole CA bundle, about 35 ms, which apps that open a Client per
    report (and ``esa demo``'s thousands of devices) should not pay each time."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class Transport:
    """One client's connections: every request within ``timeout`` seconds whole, however
    slowly the other side answers; no connection is kept alive (:func:`deadline_client`)."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        self._http = deadline_client(timeout, _tls_context())

    def fetch_config(self, url: object) -> Any:
        """GET the config document from ``url`` (http or https), parsed as JSON.

        Raises:
            ConfigError: a malformed URL, a network error, a non-200 or non-JSON answer.
        """
        if not isinstance(url, str):
            raise ConfigError(f"config_url must be a string URL, not {url!r}")
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as error:
            raise ConfigError(f"config_url {url!r} is not a URL: {error}") from error
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError(f"config_url {url!r} is not an http:// or https:// URL")
        try:
            with deadline_client(self._timeout, _tls_context()) as http:
                fetched = fetch_within(http, url, MAX_CONFIG_BYTES, self._timeout)
        except (httpx.HTTPError, FetchTooLargeError) as error:
            kind = type(error).__name__
            raise ConfigError(f"cannot fetch config_url {url!r}: {kind}: {error}") from error
        text = fetched.body[:200].decode(errors="replace")
        if fetched.status != 200:
            raise ConfigError(f"config_url {url!r} answered HTTP {fetched.status}: {text!r}")
        try:
            return json.loads(fetched.body)
        except ValueError as error:
            raise ConfigError(f"config_url {url!r} did not answer JSON: {text[:80]!r}") from error

    def post(
        self,
        url: str,
        *,
        content: bytes = b"",
        headers: Mapping[str, str] | None = None,
        limit: int,
    ) -> Fetched:
        """POST ``content`` to ``url``; the answer read whole, at most ``limit`` bytes.

        Raises:
            ConnectionError: a network failure, or the deadline passed.
            FetchTooLargeError: the answer is longer than ``limit`` bytes.
        """
        try:
            return post_within(
                self._http,
                url,
                content=content,
                headers=headers,
                limit=limit,
                seconds=self._timeout,
            )
        except httpx.HTTPError as error:
            raise ConnectionError(f"POST {url}: {type(error).__name__}: {error}") from error

    def close(self) -> None:
        """Release the connection pool."""
        self._http.close()
