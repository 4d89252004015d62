"""The mapping format: validation with clear errors, and binding to the signed config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from encoder_client.otel_mapping import MappingError, bind, hash_bin, load_mapping

from .helpers import device, krr_channel, state_channel

ROUTES: dict[str, Any] = {
    "kind": "category",
    "channel": "routes",
    "instrument": "http.server.request.duration",
    "attribute": "http.route",
    "values": ["/", "/items/{item_id}", "/search"],
}


def _mapping(*rules: dict[str, Any]) -> dict[str, Any]:
    return {"version": 1, "rules": list(rules)}


def test_yaml_json_and_dict_give_the_same_mapping(tmp_path: Path) -> None:
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text(
        "rules:\n  - kind: category\n    channel: routes\n"
        "    instrument: http.server.request.duration\n    attribute: http.route\n"
        '    values: ["/", "/items/{item_id}", "/search"]\n'
    )
    json_file = tmp_path / "m.json"
    json_file.write_text(json.dumps(_mapping(ROUTES)))
    expected = load_mapping(_mapping(ROUTES))
    assert load_mapping(yaml_file) == expected == load_mapping(json_file)
    assert load_mapping(expected) is expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"values": None}, "exactly one of values"),
        ({"hash": True}, "exactly one of values"),
        ({"values": ["/", "/"]}, "distinct"),
        ({"attribute": ""}, "rules.0.category.attribute"),
        ({"kind": "sum"}, "does not match any of the expected tags"),
        ({"surprise": 1}, "rules.0.category.surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_rules_are_refused_naming_the_rule_and_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(MappingError, match=message):
        load_mapping(_mapping({**ROUTES, **change}))


def test_other_bad_mappings() -> None:
    with pytest.raises(MappingError, match="already fed by an earlier rule"):
        load_mapping(_mapping(ROUTES, {**ROUTES, "attribute": "http.method"}))
    buckets = {"kind": "buckets", "channel": "lat", "instrument": "d", "boundaries": [1, 1]}
    with pytest.raises(MappingError, match="boundaries must increase strictly"):
        load_mapping(_mapping(buckets))
    with pytest.raises(MappingError, match="first_epoch"):
        load_mapping(_mapping({"kind": "state", "channel": "s", "instrument": "g"}))
    with pytest.raises(MappingError, match="rules"):
        load_mapping({"version": 1, "rules": []})


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(MappingError, match="cannot read mapping file"):
        load_mapping(tmp_path / "missing.yaml")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("rules: [unclosed\n")
    with pytest.raises(MappingError, match="is not YAML"):
        load_mapping(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{")
    with pytest.raises(MappingError, match="is not JSON"):
        load_mapping(bad_json)


def test_bind_checks_the_rules_against_the_signed_config(tmp_path: Path) -> None:
    phone = device(tmp_path, [krr_channel("routes", k=4), state_channel("abroad")])
    try:
        bound = bind(load_mapping(_mapping(ROUTES)), phone.client)
        assert [(b.channel, b.domain, b.crowd) for b in bound] == [("routes", 4, "")]
        with pytest.raises(MappingError, match="channel 'nope' is not in the collection config"):
            bind(load_mapping(_mapping({**ROUTES, "channel": "nope"})), phone.client)
        with pytest.raises(MappingError, match="needs a channel of category values"):
            bind(load_mapping(_mapping({**ROUTES, "channel": "abroad"})), phone.client)
        with pytest.raises(MappingError, match="5 values do not fit the channel's domain of 4"):
            five = {**ROUTES, "values": ["a", "b", "c", "d", "e"]}
            bind(load_mapping(_mapping(five)), phone.client)
        with pytest.raises(MappingError, match="9 buckets do not fit"):
            lat = {"kind": "buckets", "channel": "routes", "instrument": "d"}
            bind(load_mapping(_mapping({**lat, "boundaries": list(range(8))})), phone.client)
        with pytest.raises(MappingError, match="crowd 'eu' is not declared"):
            bind(load_mapping(_mapping({**ROUTES, "crowd": "eu"})), phone.client)
        state = {"kind": "state", "channel": "routes", "instrument": "g", "first_epoch": 0}
        with pytest.raises(MappingError, match="needs a channel of state values"):
            bind(load_mapping(_mapping(state)), phone.client)
    finally:
        phone.close()


def test_value_to_bin(tmp_path: Path) -> None:
    phone = device(tmp_path, [krr_channel("routes", k=8), krr_channel("hashed", k=5)])
    try:
        hashed = {**ROUTES, "channel": "hashed", "values": None, "hash": True}
        vocab, by_hash = bind(load_mapping(_mapping(ROUTES, hashed)), phone.client)
        assert vocab.category_bin("/search") == 2
        assert vocab.category_bin("/admin") is None
        assert vocab.category_bin(["/"]) is None
        assert by_hash.category_bin("/admin") == hash_bin("/admin", 5)
        assert by_hash.category_bin(True) == hash_bin("true", 5)
    finally:
        phone.close()
    # Fixed by the format (the analyzer side names bins with it): SHA-256, 8 bytes, mod k.
    assert hash_bin("/", 1 << 64) == 0x8A5EDAB282632443
    assert {hash_bin(f"/r{i}", 7) for i in range(200)} == set(range(7))
