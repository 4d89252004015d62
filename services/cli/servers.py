"""``esa shuffler serve`` and ``esa keys generate``: run one shuffler instance, create key
files (``esa keys`` itself: :mod:`services.cli.keys`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    from services.cli.launcher import ServiceSpec


@click.group()
def shuffler() -> None:
    """Run a shuffler instance (settings from ESA_SHUFFLER_* environment variables)."""


@shuffler.command("serve")
@click.option(
    "--host", default=None, help="Bind address (default: ESA_SHUFFLER_HOST or 127.0.0.1)."
)
@click.option("--port", type=int, default=None, help="Port (default: ESA_SHUFFLER_PORT or 8101).")
def shuffler_serve(host: str | None, port: int | None) -> None:
    """Serve the shuffler API with uvicorn until interrupted."""
    import uvicorn
    from pydantic import ValidationError

    from runtime.proxies import proxy_options
    from runtime.secrets import settings_problems
    from runtime.server import uvicorn_options
    from shuffler.app import create_asgi
    from shuffler.settings import ShufflerSettings

    try:
        settings = ShufflerSettings()
    except (ValidationError, ValueError) as error:
        raise click.UsageError(f"invalid shuffler settings: {settings_problems(error)}") from error
    overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
    settings = settings.model_copy(update=overrides)
    uvicorn.run(
        create_asgi(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        **proxy_options(settings.trusted_proxies),
        **uvicorn_options(),
    )


@click.group()
def analyzer() -> None:
    """Run the analyzer (settings from ESA_ANALYZER_* environment variables)."""


@analyzer.command("serve")
@click.option(
    "--host", default=None, help="Bind address (default: ESA_ANALYZER_HOST or 127.0.0.1)."
)
@click.option("--port", type=int, default=None, help="Port (default: ESA_ANALYZER_PORT or 8100).")
def analyzer_serve(host: str | None, port: int | None) -> None:
    """Serve the analyzer API and dashboard with uvicorn until interrupted."""
    import uvicorn
    from pydantic import ValidationError

    from analyzer.app import create_app
    from analyzer.errors import InvalidChannelError
    from analyzer.settings import AnalyzerSettings
    from runtime.proxies import proxy_options
    from runtime.secrets import settings_problems
    from runtime.server import uvicorn_options

    try:
        settings = AnalyzerSettings()
        overrides = {k: v for k, v in (("host", host), ("port", port)) if v is not None}
        app = create_app(settings.model_copy(update=overrides))
    except (ValidationError, InvalidChannelError, ValueError) as error:
        problems = settings_problems(error)
        raise click.UsageError(f"invalid analyzer settings: {problems}") from error
    uvicorn.run(
        app,
        host=overrides.get("host", settings.host),  # type: ignore[arg-type]
        port=overrides.get("port", settings.port),  # type: ignore[arg-type]
        log_config=None,
        access_log=False,
        **proxy_options(settings.trusted_proxies),
        **uvicorn_options(),
    )


@click.command("up")
@click.option(
    "--var",
    "var",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("var"),
    show_default=True,
    help="Where keys, SQLite files, channel config and logs live.",
)
@click.option("--shufflers", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option(
    "--base-port",
    type=int,
    default=8100,
    show_default=True,
    help="Analyzer port; shuffler i listens on base-port + i.",
)
@click.option(
    "--database-url-template",
    default=None,
    metavar="URL",
    help="One database per service instead of SQLite files, e.g. "
    "'postgresql+psycopg://postgres@127.0.0.1:5432/esa_{service}' ({service} is analyzer, "
    "shuffler_1, ...; the databases must exist).",
)
@click.option(
    "--replicas",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="Processes per shuffler trust domain, sharing its PostgreSQL database behind HAProxy "
    "(var/haproxy.cfg; health checks on /readyz). > 1 needs --database-url-template.",
)
@click.option(
    "--analyzer-workers",
    type=click.IntRange(1, 16),
    default=1,
    show_default=True,
    help="Analyzer processes sharing its PostgreSQL database behind HAProxy (each opens "
    "stored parts; a part is opened by one of them). > 1 needs --database-url-template.",
)
@click.option(
    "--prepare-only",
    is_flag=True,
    help="Only write keys, channels.json, shufflers.json, trust.json and analyzer.pub under "
    "--var, then exit (how docker-compose.yml's init service sets up its volumes).",
)
@click.option(
    "--shuffler-url-template",
    default="http://127.0.0.1:{port}",
    show_default=True,
    help="With --prepare-only: the URL each shuffler's descriptor gives devices and the "
    "analyzer fetches it from ({i}, {port}).",
)
@click.option(
    "--cors-origins",
    default=None,
    metavar="ORIGINS",
    help="Origins of the web pages whose devices may call every party's device routes "
    "(comma-separated; '' for none). Default: http://127.0.0.1:8000 and "
    "http://localhost:8000, the example page's (docs/operations.md).",
)
def up_command(
    var: Path,
    shufflers: int,
    base_port: int,
    database_url_template: str | None,
    replicas: int,
    analyzer_workers: int,
    prepare_only: bool,
    shuffler_url_template: str,
    cors_origins: str | None,
) -> None:
    """Start the analyzer and K shufflers on 127.0.0.1 and keep them running.

    Creates keys, each shuffler's own client-token secret and the default channel set (every
    mechanism) on first run, waits until all services are ready, prints their URLs, and stops
    them all on Ctrl-C or SIGTERM (the local profile: a raised per-address enrolment limit;
    devices on a page from --cors-origins may call the device routes).
    With --replicas R or --analyzer-workers W above 1 (PostgreSQL only), R processes per
    shuffler and W analyzer processes run behind HAProxy, which takes the usual ports; one of
    them that dies is restarted on its port (HAProxy sends its requests to the others
    meanwhile). HAProxy dying, a process with no sibling dying, or one dying more than 5 times
    in 60 s stops everything.
    """
    from services.cli.launcher import LaunchError, new_secrets, prepare
    from services.tools.stopping import stops_cleanly

    parties = ["analyzer", *(f"shuffler-{i}" for i in range(1, shufflers + 1))]
    overrides = _cors_overrides(cors_origins)
    try:
        created = new_secrets(var, parties)
        if prepare_only:
            specs = prepare(
                var,
                shufflers,
                base_port,
                database_template=database_url_template,
                shuffler_url=shuffler_url_template,
                overrides=overrides,
            )
            _show_prepared(var, specs)
            return
        with stops_cleanly("esa up"):
            _serve(var, shufflers, base_port, database_url_template, replicas, analyzer_workers,
                   created, overrides)  # fmt: skip
    except LaunchError as error:
        raise click.ClickException(str(error)) from error


def _serve(
    var: Path, shufflers: int, base_port: int, database_template: str | None, replicas: int,
    workers: int, created: dict[str, dict[str, str]], overrides: dict[str, str],
) -> None:  # fmt: skip
    """Start the deployment, print its URLs (and the tokens ``created`` this run), supervise it
    until a stopping signal or a death a restart cannot help."""
    from services.cli.launcher import serve_forever, stop_started, up

    try:
        services = up(
            var,
            shufflers,
            base_port,
            database_template=database_template,
            replicas=replicas,
            workers=workers,
            overrides=overrides,
        )
        for service in services:
            click.echo(f"{service.name:<12} {service.url}")
        click.echo(f"trust        {var / 'trust.json'}   (the keys an app pins, one per party)")
        click.echo(f"dashboard    http://127.0.0.1:{base_port}/   (Ctrl-C stops everything)")
        _show_once(created, var)
        serve_forever(services)
    finally:
        stop_started()  # serve_forever stopped them, unless a stop came before it ran


def _show_prepared(var: Path, specs: Sequence[ServiceSpec]) -> None:
    """What ``esa up --prepare-only`` wrote, and how each service runs."""
    for spec in specs:
        click.echo(f"{spec.name:<12} esa {' '.join(spec.command)} (port {spec.port})")
    click.echo(
        f"prepared {var}: keys/, channels.json, shufflers.json, trust.json (the keys an app "
        "pins), analyzer.pub"
    )


def _cors_overrides(origins: str | None) -> dict[str, str]:
    """``esa up --cors-origins`` as settings of every party (none: the local profile's)."""
    from runtime.cors import parse_cors_origins

    if origins is None:
        return {}
    try:
        allowed = parse_cors_origins(origins)
    except ValueError as error:
        raise click.BadParameter(str(error), param_hint="--cors-origins") from error
    return {"ESA_ANALYZER_CORS_ORIGINS": allowed, "ESA_SHUFFLER_CORS_ORIGINS": allowed}


@click.command("generate")
@click.option("--role", type=click.Choice(["analyzer", "shuffler"]), required=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Directory for the key files (created; existing keys are never overwritten).",
)
def keys_generate(role: str, out: Path) -> None:
    """Analyzer: hpke.pem (X25519) and signing.pem (Ed25519, signs the collection config).
    Shuffler: hpke.pem (X25519) and signing.pem (Ed25519, signs batches)."""
    from common.envelope import key_id, load_or_create_ed25519, load_or_create_x25519
    from runtime.keys import STATE_FILE

    if (out / STATE_FILE).exists():  # its first keys may have retired, their files deleted
        raise click.ClickException(
            f"{out / STATE_FILE} exists: this party's keys rotate (esa keys list, esa keys rotate)"
        )
    hpke_path, signing_path = out / "hpke.pem", out / "signing.pem"
    existed = hpke_path.exists(), signing_path.exists()
    hpke = load_or_create_x25519(hpke_path)
    load_or_create_ed25519(signing_path)
    for path, was_there in zip((hpke_path, signing_path), existed, strict=True):
        click.echo(f"{'kept existing' if was_there else 'created'} {path}")
    click.echo(f"{role} HPKE key id: {key_id(hpke.public_key()).hex()}")


def _show_once(created: dict[str, dict[str, str]], var: Path) -> None:
    """The admin and metrics tokens this run created, shown once (each party's own; they stay
    in ``var/keys/<party>/``, 0600, and are never printed again)."""
    from services.cli.launcher import ADMIN_TOKEN_FILE, METRICS_TOKEN_FILE

    shown = [
        (party, file, token)
        for party, files in created.items()
        for file, token in files.items()
        if file in (ADMIN_TOKEN_FILE, METRICS_TOKEN_FILE)
    ]
    if not shown:
        return
    click.echo(f"new tokens, shown once (each party's own; kept 0600 in {var}/keys/<party>/):")
    for party, file, token in shown:
        click.echo(f"  {party:<12} {file:<14} {token}")
