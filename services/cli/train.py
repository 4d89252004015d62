"""``esa train``: drive LDP-SGD training on a running analyzer (ESA-revisited Algorithm 5;
docs/ldp-sgd.md).

``esa train step`` takes one step (``POST /v1/channels/{id}/training/step``, admin token) from
the epochs received since the previous one; ``esa train show`` prints the current round, θ and
every step taken (``GET /v1/channels/{id}/training``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import click

log = logging.getLogger("esa.train")

ANALYZER = click.option(
    "--analyzer",
    "analyzer_url",
    envvar="ESA_ANALYZER_URL",
    default="http://127.0.0.1:8100",
    show_default=True,
    help="The analyzer's base URL (env ESA_ANALYZER_URL).",
)
CHANNEL = click.option("--channel", required=True, help="The ldp-sgd channel id.")
JSON = click.option("--json", "as_json", is_flag=True, help="Print the analyzer's JSON answer.")


@click.group()
def train() -> None:
    """LDP-SGD training on an analyzer: take a step, show the model (docs/ldp-sgd.md)."""


def _call(method: str, url: str, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    """The JSON answer of one request; an error answer or a network failure is a
    ClickException naming it."""
    import httpx

    try:
        answer = httpx.request(method, url, headers=headers, timeout=120, **kw)
    except httpx.HTTPError as error:
        raise click.ClickException(
            f"cannot reach {url}: {type(error).__name__}: {error}"
        ) from error
    try:
        body = answer.json()
    except ValueError:
        body = None
    if answer.status_code != 200:
        if isinstance(body, dict) and "error" in body:
            raise click.ClickException(
                f"{url} answered {answer.status_code} {body['error']}: {body.get('detail')}"
            )
        raise click.ClickException(f"{url} answered HTTP {answer.status_code}")
    if body is None:
        raise click.ClickException(f"{url} did not answer JSON")
    return body


def _eps(value: float | None) -> str:
    return "none certified" if value is None else f"{value:.4g}"


@train.command("step")
@ANALYZER
@CHANNEL
@click.option(
    "--admin-token",
    envvar="ESA_ANALYZER_ADMIN_TOKEN",
    default="development",
    show_default=True,
    help="The analyzer's admin token (env ESA_ANALYZER_ADMIN_TOKEN).",
)
@click.option(
    "--epoch-to",
    type=click.IntRange(min=0),
    default=None,
    help="Last epoch to consume (default: the last received).",
)
@JSON
def step(
    analyzer_url: str, channel: str, admin_token: str, epoch_to: int | None, as_json: bool
) -> None:
    """Take one step: θ_{t+1} from the reports of round t received since the previous step
    (reports naming another round are refused and counted); the signed config then publishes
    θ_{t+1} and round t+1."""
    url = f"{analyzer_url.rstrip('/')}/v1/channels/{channel}/training/step"
    params = {} if epoch_to is None else {"epoch_to": epoch_to}
    headers = {"Authorization": f"Bearer {admin_token}"}
    result = _call("POST", url, headers, params=params)
    log.info("training step taken", extra={"channel": channel, "round": result["round"]})
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    s = result["step"]
    click.echo(
        f"{channel}: round {s['round']} -> {result['round']} (epochs {s['epoch_from']}.."
        f"{s['epoch_to']}): {s['reports']} reports used, {s['refused_other_rounds']} refused "
        f"(other rounds), {s['devices']} contributions; |g| = {s['gradient_norm']:.4g}, "
        f"|theta| = {result['theta_norm']:.4g}; round's central eps {_eps(s['eps_central'])}"
    )


@train.command("show")
@ANALYZER
@CHANNEL
@JSON
def show(analyzer_url: str, channel: str, as_json: bool) -> None:
    """Print the current round, θ_t and every step taken."""
    url = f"{analyzer_url.rstrip('/')}/v1/channels/{channel}/training"
    body = _call("GET", url)
    if as_json:
        click.echo(json.dumps(body, indent=2))
        return
    click.echo(f"{channel}: round {body['round']}, |theta| = {body['theta_norm']:.4g}")
    for s in body["history"]:
        click.echo(
            f"  round {s['round']}: epochs {s['epoch_from']}..{s['epoch_to']}, "
            f"{s['reports']} used, {s['refused_other_rounds']} refused, "
            f"|g| = {s['gradient_norm']:.4g}, eps {_eps(s['eps_central'])}"
        )
