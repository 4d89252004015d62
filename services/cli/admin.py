"""``esa admin``: operator commands against a running service's admin API."""

from __future__ import annotations

from typing import Any

import click


def call(
    url: str, path: str, admin_token: str | None, body: Any = None, *, method: str | None = None
) -> Any:
    """Send ``body`` to a service's route (``method``; by default POST, or GET without a
    token), with the admin token if given; its JSON answer.

    Raises:
        click.ClickException: a network failure or a non-2xx answer, with the service's
            error code and detail.
    """
    import httpx

    headers = {} if admin_token is None else {"Authorization": f"Bearer {admin_token}"}
    target = url.rstrip("/") + path
    method = method or ("GET" if admin_token is None else "POST")
    try:
        response = httpx.request(
            method, target, json=None if method == "GET" else body, headers=headers, timeout=120.0
        )
    except httpx.HTTPError as error:
        raise click.ClickException(f"{url}: {type(error).__name__}: {error}") from error
    if response.status_code >= 300:
        raise click.ClickException(f"{url} answered HTTP {response.status_code}: {response.text}")
    return response.json()


@click.group()
def admin() -> None:
    """Operate a running analyzer or shuffler through its admin API (bearer token)."""


@admin.command("requeue")
@click.option(
    "--url",
    required=True,
    metavar="URL",
    help="The service: a shuffler (its parts the analyzer refused are sent again) or the "
    "analyzer (its parts quarantined after failed openings are opened again).",
)
@click.option(
    "--admin-token",
    required=True,
    envvar="ESA_ADMIN_TOKEN",
    help="That service's own admin token (each party has its own).",
)
@click.option("--batch", "batch_id", default=None, metavar="ID", help="Only this batch's parts.")
def requeue(url: str, admin_token: str, batch_id: str | None) -> None:
    """Take up again the batch parts a service set aside, once their cause is fixed.

    \b
    At a shuffler: parts the analyzer refused (HTTP 400/422) are forwarded again; unrequeued,
    retention purges their batch (esa_shuffler_ledger_deleted{cause="refused"}).
    At the analyzer: parts quarantined after repeated failed openings are opened again.
    """
    answer = call(url, "/v1/admin/requeue", admin_token, {"batch_id": batch_id})
    requeued = int(answer["requeued"])
    click.echo(
        f"{url}: {requeued} part(s) requeued" + (f" of batch {batch_id}" if batch_id else "")
    )
