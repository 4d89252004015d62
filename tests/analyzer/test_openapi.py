"""The analyzer's OpenAPI document is the truth (issue 12): every route is in it with every
status it can answer, every error in the one ``{"error", "detail"}`` shape, and the bodies and
credentials a client needs. :mod:`tests.analyzer.test_fuzz` checks the answers against it;
this module checks the document itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest

from analyzer.app import SIGNATURE_PATTERN, create_app
from analyzer.intake import MAX_STORED_INT
from analyzer.settings import AnalyzerSettings
from common.wire import Batch

from .helpers import VALUES, make_batch

#: Every operation and the statuses it can answer (400, 408, 431 and 500 can come from the
#: server itself; 405 is a wrong method on the operation's path, but never a preflight's).
SERVER = {"400", "405", "408", "431", "500"}
EXPECTED = {
    # the CORS preflight of the one device route: 204 only when an origin is allowed
    ("options", "/v1/config"): {"403"},
    ("post", "/v1/batches"): {"200", "201", "401", "413", "415", "422", "503"},
    ("get", "/v1/config"): {"200", "503"},  # 503 shufflers_unavailable: no descriptor yet
    ("get", "/v1/channels"): {"200", "503"},
    ("get", "/v1/channels/{channel_id}/estimate"): {"200", "404", "503"},
    ("post", "/v1/channels/{channel_id}/releases"): {"201", "401", "404", "503"},
    ("get", "/v1/channels/{channel_id}/privacy"): {"200", "404", "503"},
    ("post", "/v1/channels/{channel_id}/training/step"): {"200", "401", "404", "503"},
    ("get", "/v1/channels/{channel_id}/training"): {"200", "404"},
    ("get", "/v1/privacy"): {"200", "503"},
    ("post", "/v1/admin/requeue"): {"200", "401", "503"},
    ("get", "/v1/admin/keys"): {"200", "401", "503"},
    ("post", "/v1/admin/keys/rotate"): {"200", "401", "409", "503"},
    ("post", "/v1/admin/keys/retire"): {"200", "401", "404", "409", "503"},
    ("post", "/v1/admin/channels"): {"200", "201", "401", "409", "503"},
    ("post", "/v1/admin/channels/{channel_id}/retire"): {"200", "401", "404", "503"},
    ("post", "/v1/admin/channels/{channel_id}/close"): {"200", "401", "404", "503"},
    ("get", "/"): {"200", "503"},
    ("get", "/healthz"): {"200"},
    ("get", "/readyz"): {"200", "503"},
    ("get", "/metrics"): {"200"},
}
ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder: Path = tmp_path_factory.mktemp("openapi")
    app = create_app(AnalyzerSettings(database_url=f"sqlite:///{folder / 'a.db'}", key_dir=folder))
    return app.openapi()


def _operations(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method, path): operation
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }


def test_every_operation_documents_exactly_the_statuses_it_answers(
    document: dict[str, Any],
) -> None:
    operations = _operations(document)
    assert set(operations) == set(EXPECTED)
    for key, operation in operations.items():
        server = SERVER - {"405"} if key[0] == "options" else SERVER
        assert set(operation["responses"]) == EXPECTED[key] | server, key


def test_every_error_is_the_one_json_shape(document: dict[str, Any]) -> None:
    for key, operation in _operations(document).items():
        for status, answer in operation["responses"].items():
            if int(status) >= 400:
                assert answer["content"] == ERROR, (key, status)
                assert answer["description"]
    schemas = document["components"]["schemas"]
    assert set(schemas["ErrorBody"]["required"]) == {"error", "detail"}
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas


def test_success_bodies_carry_their_media_types(document: dict[str, Any]) -> None:
    operations = _operations(document)
    assert set(operations[("get", "/metrics")]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(operations[("get", "/")]["responses"]["200"]["content"]) == {"text/html"}
    acks = operations[("post", "/v1/batches")]["responses"]
    for status in ("200", "201"):
        schema = acks[status]["content"]["application/json"]["schema"]
        assert schema["$ref"].endswith("/BatchAck")


def test_a_batch_part_is_documented_so_a_client_can_send_one(document: dict[str, Any]) -> None:
    """The body schema and the signature header, as strict as the edge: a real signed part
    validates, and what the edge refuses as malformed does not."""
    operation = _operations(document)[("post", "/v1/batches")]
    assert operation["requestBody"]["required"] is True
    schema = operation["requestBody"]["content"]["application/json"]["schema"]
    sender, head, header = operation["parameters"]
    assert (sender["name"], sender["in"], sender["required"]) == ("ESA-Shuffler", "header", True)
    assert (head["name"], head["in"], head["required"]) == ("ESA-Preauth", "header", True)
    assert (header["name"], header["in"], header["required"]) == ("ESA-Signature", "header", True)
    assert header["schema"]["pattern"] == SIGNATURE_PATTERN
    part = make_batch(VALUES[:100])
    body, signature, shuffler = part
    assert jsonschema_rs.is_valid(head["schema"], part.headers["ESA-Preauth"])
    assert not jsonschema_rs.is_valid(head["schema"], "1.2." + "0" * 64 + ".c2ln")
    assert jsonschema_rs.is_valid(schema, Batch.model_validate_json(body).model_dump(mode="json"))
    assert jsonschema_rs.is_valid(header["schema"], signature)
    assert jsonschema_rs.is_valid(sender["schema"], shuffler)
    assert not jsonschema_rs.is_valid(sender["schema"], "Shuffler One")
    assert schema["additionalProperties"] is False
    assert schema["properties"]["n_contributions"]["maximum"] == MAX_STORED_INT
    too_many = {**Batch.model_validate_json(body).model_dump(), "parts": MAX_STORED_INT + 1}
    assert not jsonschema_rs.is_valid(schema, too_many)
    assert not jsonschema_rs.is_valid(header["schema"], "c2ln")


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/channels/{channel_id}/releases", "ReleaseRequest"),
        ("/v1/admin/requeue", "RequeueRequest"),
        ("/v1/admin/channels", "ChannelConfig"),
        ("/v1/admin/keys/rotate", "RotateKeyRequest"),
        ("/v1/admin/keys/retire", "RetireKeyRequest"),
        ("/v1/admin/channels/{channel_id}/close", "EpochCloseRequest"),
    ],
)
def test_admin_operations_document_their_token_and_body(
    document: dict[str, Any], path: str, request_body: str
) -> None:
    operation = _operations(document)[("post", path)]
    ((scheme, _),) = (item for requirement in operation["security"] for item in requirement.items())
    assert document["components"]["securitySchemes"][scheme] == {
        "type": "http",
        "scheme": "bearer",
        "description": "the analyzer's admin token",
    }
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert request_body in str(body)
    parameters = operation.get("parameters", [])
    assert not any(p["name"].lower() == "authorization" for p in parameters)
