"""``esa keys``: create key files, and rotate a running party's keys through its admin API
(``/v1/admin/keys``) without restarting anything."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from services.cli.admin import call
from services.cli.servers import keys_generate

#: Where ``esa up`` serves the analyzer unless told otherwise.
DEFAULT_ANALYZER_URL = "http://127.0.0.1:8100"


@click.group()
def keys() -> None:
    """Key files, and key rotation at a running party without downtime.

    \b
    A party's keys live in its key directory: hpke.pem and signing.pem first, one file per
    rotation after, and keys.json (each key's state and times), shared by its replicas.
    `esa keys rotate` makes a new key through the party's admin API: it is pending until
    every replica has loaded it (ESA_<ROLE>_KEY_ACTIVATION_SECONDS), then published. An HPKE
    key it replaces keeps opening what devices sealed to it until its overlap ends (the
    config or descriptor ttl, plus the longest epoch, plus a margin), then retires and its
    file is deleted; a signing key it replaces names the new one in a succession, which
    devices, shufflers and the analyzer follow from the key they pin, so nobody is re-pinned.
    `esa keys list` shows every key; `esa keys retire` ends an HPKE key's overlap now.
    """


keys.add_command(keys_generate)

_VAR = click.option(
    "--var",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var"),
    show_default=True,
    help="The `esa up` folder names are looked up in.",
)
_ANALYZER = click.option(
    "--analyzer-url",
    default=DEFAULT_ANALYZER_URL,
    show_default=True,
    help="Where the party named analyzer is served.",
)
_TOKEN = click.option(
    "--admin-token",
    envvar="ESA_ADMIN_TOKEN",
    default=None,
    help="The party's own admin token (each party has its own); default for a name: "
    "<var>/keys/<name>/admin-token.",
)


def resolve(party: str, var: Path, analyzer_url: str, token: str | None) -> tuple[str, str]:
    """The URL and admin token of ``party`` (a URL, or a name in the deployment at ``var``).

    Raises:
        click.UsageError: an unknown name, or no token for the party.
    """
    if party.startswith(("http://", "https://")):
        url = party
    elif party == "analyzer":
        url = analyzer_url
    else:
        registry = _registry(var)
        if party not in registry:
            known = ", ".join(["analyzer", *registry])
            raise click.UsageError(f"no party {party!r} in {var} (known: {known})")
        url = registry[party]
    if token is None:
        path = var / "keys" / party / "admin-token"
        if party.startswith(("http://", "https://")) or not path.is_file():
            raise click.UsageError(
                f"no admin token for {party}: give --admin-token (or ESA_ADMIN_TOKEN)"
            )
        token = path.read_text().strip()
    return url.rstrip("/"), token


def _registry(var: Path) -> dict[str, str]:
    """Shuffler ids and URLs of an ``esa up`` deployment (``<var>/shufflers.json``)."""
    path = var / "shufflers.json"
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise click.UsageError(f"{path}: {error} (is --var an `esa up` folder?)") from error
    return {str(e["id"]): str(e["url"]) for e in entries if isinstance(e, dict) and "id" in e}


def _when(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at > 0 else "start"
    if at <= 0:
        return stamp
    delta = at - now
    return f"{stamp} ({'in ' if delta > 0 else ''}{_span(abs(delta))}{'' if delta > 0 else ' ago'})"


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def show(listing: dict[str, Any], url: str) -> None:
    """A party's keys, one line each (``*``: published)."""
    now = time.time()
    click.echo(f"{listing['party']} ({url}): {len(listing['successions'])} succession(s)")
    for key in listing["keys"]:
        mark = "*" if key["published"] else " "
        click.echo(
            f"  {mark} {key['kind']:<8} {key['key_id']}  {key['state']:<8} "
            f"active from {_when(key['activates_at'], now)}, "
            f"retires {_when(key['retires_at'], now)}"
        )


@keys.command("list")
@click.argument("parties", nargs=-1, metavar="[PARTY]...")
@_VAR
@_ANALYZER
@_TOKEN
def list_keys(
    parties: tuple[str, ...], var: Path, analyzer_url: str, admin_token: str | None
) -> None:
    """Show each party's keys: kind, id, state (pending, active, retired), when it became or
    becomes active and when it retires; * marks the key published (devices seal to it, or it
    signs).

    \b
    PARTY is a party's URL, or its name in an `esa up` deployment (analyzer, shuffler-1...:
    shuffler URLs from <var>/shufflers.json, tokens from <var>/keys/<name>/admin-token);
    none: the analyzer and every shuffler of --var.
    """
    named = parties or ("analyzer", *_registry(var))
    for party in named:
        url, token = resolve(party, var, analyzer_url, admin_token)
        show(call(url, "/v1/admin/keys", token, method="GET"), url)


@keys.command("rotate")
@click.argument("party", metavar="PARTY")
@click.option(
    "--key",
    "kind",
    type=click.Choice(["hpke", "signing"]),
    required=True,
    help="hpke: the key devices seal to (the analyzer's fragments, a shuffler's "
    "contributions); signing: the key that signs the analyzer's config, or a shuffler's "
    "descriptor and batches.",
)
@_VAR
@_ANALYZER
@_TOKEN
def rotate(party: str, kind: str, var: Path, analyzer_url: str, admin_token: str | None) -> None:
    """Make a new HPKE or signing key at PARTY, while it runs.

    \b
    PARTY is a party's URL, or its name in an `esa up` deployment (analyzer, shuffler-1...).
    The new key is pending until every replica has loaded it, then published; the key it
    replaces keeps working through its overlap (HPKE) or names it in a succession that
    devices and the other parties follow (signing). Refused while a key of the same kind is
    still pending. `esa keys list` shows the states.
    """
    url, token = resolve(party, var, analyzer_url, admin_token)
    change = call(url, "/v1/admin/keys/rotate", token, {"key": kind})
    key, now = change["key"], time.time()
    click.echo(
        f"{party}: new {kind} key {key['key_id']}, published {_when(key['activates_at'], now)}"
    )
    for other in change["keys"]["keys"]:
        if (
            other["kind"] == kind
            and other["key_id"] != key["key_id"]
            and other["state"] != "retired"
        ):
            click.echo(f"  replaces {other['key_id']}: retires {_when(other['retires_at'], now)}")


@keys.command("retire")
@click.argument("party", metavar="PARTY")
@click.option("--key-id", required=True, metavar="ID", help="The HPKE key id (esa keys list).")
@_VAR
@_ANALYZER
@_TOKEN
def retire(party: str, key_id: str, var: Path, analyzer_url: str, admin_token: str | None) -> None:
    """Retire an HPKE key at PARTY now, before its overlap ends (a key thought compromised).

    \b
    What devices sealed to it is refused from then on (a shuffler answers 409
    config_outdated, and devices fetch the config again) or no longer opens (the analyzer):
    contributions still in flight are lost. The published key cannot be retired: rotate
    first and wait until the new key is active.
    """
    url, token = resolve(party, var, analyzer_url, admin_token)
    change = call(url, "/v1/admin/keys/retire", token, {"key": "hpke", "key_id": key_id})
    click.echo(f"{party}: HPKE key {change['key']['key_id']} is {change['key']['state']}")
