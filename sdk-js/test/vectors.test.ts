/**
 * The shared vectors (vectors/wire.json, made by the Python SDK and checked against it by
 * tests/client/test_sdk_js_vectors.py): this SDK must compute every expectation in it.
 */

import assert from "node:assert/strict";
import { describe, test } from "node:test";
import { b64decode, hex, unhex } from "../src/bytes.js";
import { Client } from "../src/client.js";
import { keyId, open, useBackends, type Backend } from "../src/crypto.js";
import { EsaError } from "../src/errors.js";
import { mechanism, type Mechanism } from "../src/mechanisms/index.js";
import { dumps, isObject, parse, type JsonObject, type JsonValue } from "../src/pyjson.js";
import { MemoryStorage } from "../src/storage.js";
import { changedTerms, localPrivacy, relaxations, termsJson, termsOf, type PrivacyCaps } from "../src/terms.js";
import { TrustAnchors } from "../src/trust.js";
import { channelConfig, deviceBudget, encodeContribution, fragmentInfo, outerInfo, pad } from "../src/wire.js";
import { SILENT, Tape, close, plain, section } from "./helpers.js";

const num = (v: JsonValue | undefined): number => Number(plain(v));

describe("canonical JSON", () => {
  for (const [i, c] of section("canonical").entries()) {
    test(`case ${i}`, () => assert.equal(dumps(parse(c["text"] as string)), c["canonical"]));
  }
});

describe("byte layouts", () => {
  test("fragment info binds channel, epoch and crowd", () => {
    for (const c of section("info")) {
      const make = () => hex(fragmentInfo(c["channel"] as string, num(c["epoch"]), c["crowd"] as string));
      if (c["error"] === true) assert.throws(make, RangeError);
      else assert.equal(make(), c["info"]);
    }
  });

  test("outer info names the shuffler", () => {
    for (const c of section("outer_info")) assert.equal(hex(outerInfo(c["shuffler"] as string)), c["info"]);
  });

  test("key ids", async () => {
    for (const c of section("key_ids")) assert.equal(hex(await keyId(b64decode(c["public"] as string))), c["key_id"]);
  });

  test("padding", () => {
    for (const c of section("padding")) {
      const make = () => hex(pad(unhex(c["data"] as string), num(c["size"])));
      if (c["error"] === true) assert.throws(make, RangeError);
      else assert.equal(make(), c["padded"]);
    }
  });

  test("contributions", () => {
    for (const c of section("contributions")) {
      const make = () =>
        hex(
          encodeContribution({
            channelId: c["channel_id"] as string,
            crowdId: c["crowd_id"] as string,
            epoch: num(c["epoch"]),
            nonce: unhex(c["nonce"] as string),
            fragments: (c["fragments"] as string[]).map(unhex),
          }),
        );
      if (c["error"] === true) assert.throws(make, RangeError);
      else assert.equal(make(), c["encoded"]);
    }
  });
});

describe("blobs Python sealed open here", () => {
  for (const backend of ["webcrypto", "noble"] as Backend[]) {
    test(backend, async () => {
      useBackends({ ed25519: backend, x25519: backend });
      try {
        for (const c of section("sealed")) {
          const blob = unhex(c["blob"] as string);
          const info =
            c["kind"] === "fragment"
              ? fragmentInfo(c["channel"] as string, num(c["epoch"]), c["crowd"] as string)
              : outerInfo(c["shuffler"] as string);
          const opened = await open(blob, unhex(c["private"] as string), info);
          const expected = c["kind"] === "fragment" ? hex(pad(unhex(c["fragment"] as string), num(c["payload_size"]))) : c["contribution"];
          assert.equal(hex(opened), expected);
          assert.equal(hex(blob.slice(0, 8)), hex(await keyId(b64decode(c["public"] as string))));
          await assert.rejects(open(blob, unhex(c["private"] as string), outerInfo("another")));
        }
      } finally {
        useBackends({ ed25519: "webcrypto", x25519: "webcrypto" });
      }
    });
  }
});

test("local privacy of every mechanism's parameters", () => {
  for (const c of section("local_privacy")) {
    const found = localPrivacy({ mechanism: c["mechanism"] as string, params: c["params"] as JsonObject });
    assert.equal(close(found, c["local"]), null, `${c["mechanism"]} ${dumps(c["params"]!)}`);
  }
});

/** The neutral state form of the vectors (rfrag: the backstops by value). */
function neutral(name: string, state: JsonObject | null): unknown {
  if (state === null || name !== "rfrag") return state;
  return { backstops: state["backstops"] };
}

function rfragState(mech: Mechanism, params: unknown, state: JsonObject): JsonObject {
  const fresh = mech.newState(params, new Tape([])) as JsonObject;
  fresh["backstops"] = state["backstops"]!;
  return fresh;
}

test("encoders replay Python's recorded draws to the same fragments and state", () => {
  for (const [i, c] of section("tapes").entries()) {
    const name = c["mechanism"] as string;
    const mech = mechanism(name)!;
    const params = mech.parseParams(c["params"] as JsonObject);
    const tape = new Tape(c["draws"] as JsonValue[][]);
    const given = c["state"] as JsonObject | undefined;
    let state = given === undefined ? mech.newState(params, tape) : given;
    if (name === "rfrag" && given !== undefined) state = rfragState(mech, params, given);
    const value = isObject(c["value"]) ? { period: num(c["value"]["period"]), changed: c["value"]["changed"] } : num(c["value"]);
    const encoded = mech.encode(params, value, state, tape, num(c["shufflers"] ?? 1));
    const routes = encoded.routes.map(([slot, fragments]) => [slot, fragments.map(hex)]);
    assert.equal(close(routes, c["routes"]), null, `tape ${i} (${name}) routes`);
    assert.equal(close(neutral(name, encoded.state), c["state_after"]), null, `tape ${i} (${name}) state`);
    assert.ok(tape.usedUp, `tape ${i} (${name}) left draws unused`);
  }
});

test("which changes relax a channel's pinned terms", () => {
  for (const [i, c] of section("terms").entries()) {
    const budget = (v: JsonValue | undefined) => (v === null || v === undefined ? null : deviceBudget(v, "budget"));
    const old = termsOf(channelConfig(c["old"]!, "old"), budget(c["old_device_budget"]));
    const next = termsOf(channelConfig(c["new"]!, "new"), budget(c["new_device_budget"]));
    const found = relaxations(old, next).map((r) => [r.field, r.old, r.new]);
    assert.equal(close(found, c["relaxations"]), null, `terms ${i}: ${dumps(c["new"]!)}`);
    const repin = found.length === 0 && changedTerms(old, next).length > 0;
    assert.equal(repin, c["repin"], `terms ${i} repin`);
  }
});

function caps(options: JsonObject): PrivacyCaps | undefined {
  const given = options["caps"];
  if (!isObject(given)) return undefined;
  return {
    localEps: num(given["local_eps"]),
    channelLocalEps: Object.fromEntries(Object.entries(given["channel_local_eps"] as JsonObject).map(([k, v]) => [k, num(v)])),
    lifetimeEps: num(given["lifetime_eps"]),
  };
}

async function accepted(client: Client, roots: Map<string, string>) {
  const status = client.status();
  const refused = Object.fromEntries(
    [...status.refused].map(([channel, error]) => {
      const entry: Record<string, unknown> = { error: error.name };
      for (const key of ["field", "old", "new", "cap", "value"]) if (key in error) entry[key] = (error as unknown as Record<string, unknown>)[key];
      return [channel, entry];
    }),
  );
  const pinned = Object.fromEntries([...(await client.state.pinnedTerms())].map(([c, t]) => [c, termsJson(t)]));
  return {
    ok: true,
    refused,
    seen: Object.fromEntries(await client.state.seen()),
    pins: Object.fromEntries(await client.state.pins(roots)),
    pinned,
    shufflers: status.shufflers,
    expires_at: status.expiresAt,
  };
}

async function report(client: Client, step: JsonObject) {
  const channel = step["channel"] as string;
  const crowd = step["crowd"] as string | undefined;
  const outcome: Record<string, unknown> = {};
  try {
    if (step["kind"] === "longitudinal") {
      const value = step["value"] as JsonObject;
      await client.longitudinal(channel, crowd).update(num(value["period"]), value["changed"] as boolean);
    } else {
      const value = step["value"];
      await client.histogram(channel, crowd).report((typeof value === "boolean" ? value : plain(value)) as number);
    }
    outcome["ok"] = true;
  } catch (error) {
    if (!(error instanceof EsaError)) throw error;
    outcome["error"] = error.name;
  }
  outcome["spent"] = await client.budgetSpent(channel);
  outcome["spent_all"] = await client.budgetSpent();
  outcome["outbox"] = await client.outboxSize();
  return outcome;
}

async function runScenario(scenario: JsonObject): Promise<void> {
  const options = scenario["options"] as JsonObject;
  const trust = TrustAnchors.from(dumps(scenario["trust"]!));
  const storage = new MemoryStorage();
  let now = 0;
  let document = "";
  let client: Client | undefined;
  try {
    for (const [i, step] of (scenario["steps"] as JsonObject[]).entries()) {
      now = num(step["at"]);
      let outcome: unknown;
      if (step["do"] === "report") outcome = await report(client!, step);
      else {
        document = step["document"] as string;
        try {
          if (client === undefined) {
            client = await Client.create({
              configText: () => document,
              trust,
              storage,
              background: false,
              clock: () => now,
              everyShuffler: options["every_shuffler"] as boolean,
              ...(caps(options) === undefined ? {} : { caps: caps(options)! }),
              ...(options["crowd"] === null ? {} : { crowd: options["crowd"] as string }),
              logger: SILENT,
            });
          } else await client.refreshConfig();
          outcome = await accepted(client, trust.roots());
        } catch (error) {
          if (!(error instanceof EsaError)) throw error;
          outcome = { error: error.name, message: error.message };
        }
      }
      const expected = step["expect"] as JsonObject;
      const shown = outcome as Record<string, unknown>;
      const difference = close({ ...shown, message: undefined }, { ...(plain(expected) as object), message: undefined });
      assert.equal(difference, null, `step ${i} (${step["do"]} at ${now}): ${JSON.stringify(shown).slice(0, 400)}`);
    }
  } finally {
    await client?.close();
  }
}

describe("scenarios through a client", () => {
  for (const scenario of section("scenarios")) {
    test(scenario["name"] as string, () => runScenario(scenario));
  }
});

describe("scenarios with the curves in JavaScript (platforms without WebCrypto Ed25519/X25519)", () => {
  for (const name of ["shufflers", "rotation"]) {
    test(name, async () => {
      useBackends({ ed25519: "noble", x25519: "noble" });
      try {
        await runScenario(section("scenarios").find((s) => s["name"] === name)!);
      } finally {
        useBackends({ ed25519: "webcrypto", x25519: "webcrypto" });
      }
    });
  }
});
