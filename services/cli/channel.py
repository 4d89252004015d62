"""``esa channel``: add, retire and list channels of a running analyzer without a restart."""

from __future__ import annotations

import json
from pathlib import Path

import click

from services.cli.admin import call

URL = click.option(
    "--url",
    default="http://127.0.0.1:8100",
    show_default=True,
    envvar="ESA_ANALYZER_URL",
    help="The analyzer.",
)
TOKEN = click.option(
    "--admin-token",
    required=True,
    envvar="ESA_ADMIN_TOKEN",
    help="The analyzer's admin token (esa up keeps it in var/keys/analyzer/admin-token).",
)


@click.group()
def channel() -> None:
    """Channels of a running analyzer: shufflers adopt a change from its next signed config
    (within their config_refresh_seconds), devices at their next config fetch."""


@channel.command("add")
@URL
@TOKEN
@click.argument("channel_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def add(url: str, admin_token: str, channel_file: Path) -> None:
    """Add the channel described in CHANNEL_FILE (one channel's JSON, as in a channel file).

    \b
    Adding the same channel again changes nothing. A channel's parameters never change while
    it runs: to change them, add a channel with a new id and retire the old one.
    """
    try:
        body = json.loads(channel_file.read_text())
    except (OSError, ValueError) as error:
        raise click.ClickException(f"{channel_file}: {error}") from error
    answer = call(url, "/v1/admin/channels", admin_token, body)
    verb = "added" if answer["changed"] else "already there, unchanged"
    click.echo(f"channel {answer['channel']['id']}: {verb} (config revision {answer['revision']})")


@channel.command("retire")
@URL
@TOKEN
@click.argument("channel_id")
def retire(url: str, admin_token: str, channel_id: str) -> None:
    """Retire CHANNEL_ID: no contributions from its next epoch on; its releases and privacy
    ledger stay readable."""
    answer = call(url, f"/v1/admin/channels/{channel_id}/retire", admin_token)
    first = answer["channel"]["retired_from_epoch"]
    verb = "retired" if answer["changed"] else "was retired already"
    click.echo(f"channel {channel_id}: {verb}; no contributions from epoch {first} on")


@channel.command("list")
@URL
def list_channels(url: str) -> None:
    """The analyzer's channels, retired ones too, and the config revision."""
    answer = call(url, "/v1/channels", None)
    click.echo(f"config revision {answer.get('revision', 0)}")
    click.echo(f"{'channel':<24} {'mechanism':<14} {'epoch s':>8} {'epochs received':<20} state")
    for c in answer["channels"]:
        received = "-" if c["epochs"] is None else f"{c['epochs'][0]}..{c['epochs'][1]}"
        retired = c.get("retired_from_epoch")
        state = "live" if retired is None else f"retired from epoch {retired}"
        click.echo(
            f"{c['id']:<24} {c['mechanism']:<14} {c['epoch_seconds']:>8} {received:<20} {state}"
        )
