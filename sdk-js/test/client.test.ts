/**
 * The client against scripted shufflers (a fake fetch): what it sends, how it answers each
 * refusal as the Python SDK does (409 config_outdated / channel_retired /
 * channel_terms_changed, 429 and Retry-After, 401, 400, network errors), that reports never
 * block their caller, and that state and outbox outlive the client.
 */

import assert from "node:assert/strict";
import { mkdtempSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, test } from "node:test";
import { hex, unhex } from "../src/bytes.js";
import { Client, type ClientOptions } from "../src/client.js";
import { open } from "../src/crypto.js";
import { AlreadyReportedError, BudgetExceededError, EsaError, InvalidArgumentError, TrustedKeyError, ValueOutOfDomainError } from "../src/errors.js";
import { FileStorage } from "../src/node.js";
import { dumps, type JsonObject } from "../src/pyjson.js";
import { MemoryStorage } from "../src/storage.js";
import { fragmentInfo, outerInfo } from "../src/wire.js";
import { SILENT, section, vectors } from "./helpers.js";

const T0 = Number(vectors()["t0"]);
const HONEST = section("scenarios").find((s) => s["name"] === "honest lifecycle")!;
const DOCUMENT = ((HONEST["steps"] as JsonObject[])[0]!["document"]) as string;
const TRUST = dumps(HONEST["trust"]!);
const KEYS = vectors()["scenario_keys"] as Record<string, Record<string, string>>;

interface Sent {
  url: string;
  headers: Record<string, string>;
  body: Uint8Array;
}

/** Shufflers answering from a script: each contribution gets the next answer of its shuffler. */
class Shufflers {
  sent: Sent[] = [];
  enrolled = 0;
  answers: Record<string, (Response | Error)[]> = {};

  fetch: typeof fetch = async (input, init) => {
    const url = String(input);
    const shuffler = url.split("/")[3]!;
    if (url.endsWith("/v1/enroll")) {
      this.enrolled++;
      return new Response(JSON.stringify({ client_token: `token-${this.enrolled}` }), { status: 200 });
    }
    const headers = Object.fromEntries(new Headers(init?.headers).entries());
    this.sent.push({ url, headers, body: new Uint8Array(init?.body as Uint8Array) });
    const next = (this.answers[shuffler] ?? []).shift() ?? new Response('{"receipt":"r"}', { status: 202 });
    if (next instanceof Error) throw next;
    return next;
  };
}

function refusal(status: number, code: string, headers: Record<string, string> = {}): Response {
  return new Response(JSON.stringify({ error: code, detail: "scripted" }), { status, headers });
}

function options(shufflers: Shufflers, clock: { now: number }, more: Partial<ClientOptions> = {}): ClientOptions {
  return {
    configText: () => DOCUMENT,
    trust: TRUST,
    storage: new MemoryStorage(),
    background: false,
    clock: () => clock.now,
    fetch: shufflers.fetch,
    logger: SILENT,
    ...more,
  };
}

/** Open a contribution sealed to scenario shuffler `id` with its private key; parse it. */
async function opened(body: Uint8Array, id: string) {
  const plain = await open(body, unhex(KEYS[id]!["private"]!), outerInfo(id));
  const text = new TextDecoder();
  let at = 4;
  const short = () => {
    const size = plain[at]!;
    const value = text.decode(plain.slice(at + 1, at + 1 + size));
    at += 1 + size;
    return value;
  };
  const magic = text.decode(plain.slice(0, 4));
  const channel = short();
  const crowd = short();
  const epoch = Number(new DataView(plain.buffer, plain.byteOffset + at).getBigUint64(0));
  at += 8 + 16;
  const count = (plain[at]! << 8) | plain[at + 1]!;
  at += 2;
  const fragments: Uint8Array[] = [];
  for (let i = 0; i < count; i++) {
    const size = (plain[at]! << 8) | plain[at + 1]!;
    fragments.push(plain.slice(at + 2, at + 2 + size));
    at += 2 + size;
  }
  return { magic, channel, crowd, epoch, fragments, trailing: plain.length - at };
}

describe("reporting", () => {
  test("report() returns before any work is done, and the contribution opens at both ends", async () => {
    const shufflers = new Shufflers();
    const clock = { now: T0 + 10 };
    const client = await Client.create(options(shufflers, clock));
    let settled = false;
    const pending = client.histogram("pages", "eu").report(2).then(() => (settled = true));
    assert.equal(settled, false);
    assert.equal(await client.outboxSize(), 0);
    await pending;
    assert.equal(await client.outboxSize(), 1);
    assert.equal(await client.flush(), 1);
    const [sent] = shufflers.sent;
    const id = sent!.url.split("/")[3]!;
    assert.equal(sent!.headers["authorization"], "Bearer token-1");
    assert.equal(sent!.headers["content-type"], "application/octet-stream");
    const contribution = await opened(sent!.body, id);
    const epoch = Math.floor(clock.now / 3600);
    assert.deepEqual([contribution.magic, contribution.channel, contribution.crowd, contribution.epoch], ["ESA2", "pages", "eu", epoch]);
    assert.equal(contribution.trailing, 0);
    assert.equal(contribution.fragments.length, 1);
    const fragment = await open(contribution.fragments[0]!, unhex(KEYS["analyzer"]!["private"]!), fragmentInfo("pages", epoch, "eu"));
    assert.equal(fragment.length, 16);
    assert.equal(hex(fragment.slice(0, 4)), "00060105");
    assert.ok(fragment.slice(8).every((b) => b === 0));
    await client.close();
  });

  test("a refused report rejects its promise and tells onError, never an unhandled rejection", async () => {
    const errors: EsaError[] = [];
    const client = await Client.create(options(new Shufflers(), { now: T0 + 10 }, { onError: (e) => errors.push(e) }));
    client.histogram("pages").report(99); // not awaited: must not crash the process
    await assert.rejects(client.histogram("pages").report(-1), ValueOutOfDomainError);
    await client.idle();
    assert.deepEqual(errors.map((e) => e.name), ["ValueOutOfDomainError", "ValueOutOfDomainError"]);
    await client.close();
  });

  test("report fragments route row r to shuffler r mod K", async () => {
    const shufflers = new Shufflers();
    const client = await Client.create(options(shufflers, { now: T0 + 10 }));
    await client.histogram("rows").report(3);
    assert.equal(await client.flush(), 2);
    const ids = shufflers.sent.map((s) => s.url.split("/")[3]!).sort();
    assert.deepEqual(ids, ["s1", "s2"]);
    for (const sent of shufflers.sent) {
      const id = sent.url.split("/")[3]!;
      const contribution = await opened(sent.body, id);
      const epoch = contribution.epoch;
      for (const sealed of contribution.fragments) {
        const padded = await open(sealed, unhex(KEYS["analyzer"]!["private"]!), fragmentInfo("rows", epoch, ""));
        const row = (padded[4]! << 8) | padded[5]!;
        assert.equal(row % 2, id === "s1" ? 0 : 1);
      }
    }
    await client.close();
  });
});

describe("delivery answers", () => {
  test("409 config_outdated, channel_retired, channel_terms_changed: dropped, config fetched again", async () => {
    for (const code of ["config_outdated", "channel_retired", "channel_terms_changed"]) {
      const shufflers = new Shufflers();
      const clock = { now: T0 + 10 };
      let reads = 0;
      const client = await Client.create(options(shufflers, clock, { configText: () => (reads++, DOCUMENT), weights: { s1: 1, s2: 0 } }));
      shufflers.answers["s1"] = [refusal(409, code)];
      await client.histogram("pages").report(1);
      assert.equal(await client.flush(), 0, code);
      assert.equal(await client.outboxSize(), 0, code);
      const before = reads;
      clock.now += 3600;
      await client.histogram("pages").report(1);
      assert.equal(reads, before + 1, `${code}: the next report fetches the config first`);
      await client.close();
    }
  });

  test("409 of a replay is a delivery; 400 and 413 are dropped for good", async () => {
    const shufflers = new Shufflers();
    const clock = { now: T0 + 10 };
    const client = await Client.create(options(shufflers, clock, { weights: { s1: 1, s2: 0 } }));
    shufflers.answers["s1"] = [refusal(409, "replayed"), refusal(400, "malformed"), refusal(413, "too_large")];
    for (const channel of ["pages", "clicks", "counts"]) {
      await client.histogram(channel).report(1).catch(() => undefined);
    }
    assert.equal(await client.flush(), 1);
    assert.equal(await client.outboxSize(), 0);
    await client.close();
  });

  test("429 waits for Retry-After; 503 too; a network error backs off one shuffler only", async () => {
    const shufflers = new Shufflers();
    const clock = { now: T0 + 10 };
    const client = await Client.create(options(shufflers, clock));
    shufflers.answers["s1"] = [refusal(429, "slow_down", { "Retry-After": "120" })];
    shufflers.answers["s2"] = [new TypeError("network down")];
    await client.histogram("rows").report(1);
    assert.equal(await client.flush(), 0);
    clock.now += 60;
    assert.equal(await client.flush(), 1, "s2 retried after its backoff, s1 still waits");
    assert.equal(await client.outboxSize(), 1);
    shufflers.answers["s1"] = [refusal(503, "unavailable", { "Retry-After": "600" })];
    clock.now += 61;
    assert.equal(await client.flush(), 0);
    clock.now += 500;
    assert.equal(await client.flush(), 0, "503's Retry-After is honoured");
    clock.now += 101;
    assert.equal(await client.flush(), 1);
    await client.close();
  });

  test("401 forgets the token and enrols again; unknown_channel is retried", async () => {
    const shufflers = new Shufflers();
    const clock = { now: T0 + 10 };
    const client = await Client.create(options(shufflers, clock, { weights: { s1: 1, s2: 0 } }));
    shufflers.answers["s1"] = [refusal(401, "unauthorized"), refusal(400, "unknown_channel")];
    await client.histogram("pages").report(1);
    assert.equal(await client.flush(), 0);
    clock.now += 2;
    assert.equal(await client.flush(), 0);
    clock.now += 5;
    assert.equal(await client.flush(), 1);
    assert.equal(shufflers.enrolled, 2);
    assert.deepEqual(shufflers.sent.map((s) => s.headers["authorization"]), ["Bearer token-1", "Bearer token-2", "Bearer token-2"]);
    await client.close();
  });

  test("background delivery sends a report without a flush", async () => {
    const shufflers = new Shufflers();
    const client = await Client.create(options(shufflers, { now: T0 + 10 }, { background: true, flushInterval: 60 }));
    await client.histogram("pages").report(1);
    for (let i = 0; i < 100 && shufflers.sent.length === 0; i++) await new Promise((r) => setTimeout(r, 10));
    assert.equal(shufflers.sent.length, 1);
    await client.close();
  });
});

describe("state", () => {
  test("the outbox, the budget and reported epochs outlive the client", async () => {
    const storage = new MemoryStorage();
    const clock = { now: T0 + 10 };
    const unreachable = new Shufflers();
    unreachable.answers = { s1: [new TypeError("down")], s2: [new TypeError("down")] };
    const first = await Client.create(options(unreachable, clock, { storage }));
    await first.histogram("pages").report(1);
    await first.flush();
    const deviceId = first.deviceId;
    await first.close();
    const shufflers = new Shufflers();
    const again = await Client.create(options(shufflers, clock, { storage }));
    assert.equal(again.deviceId, deviceId);
    assert.equal(await again.budgetSpent("pages"), 2);
    await assert.rejects(again.histogram("pages").report(1), AlreadyReportedError);
    clock.now += 3600;
    assert.equal(await again.flush(), 1);
    await again.close();
  });

  test("a storage that cannot save undoes the report: nothing charged, nothing queued", async () => {
    const storage = new MemoryStorage();
    const client = await Client.create(options(new Shufflers(), { now: T0 + 10 }, { storage }));
    storage.failSaves = 1;
    await assert.rejects(client.histogram("pages").report(1), /cannot be written/);
    assert.equal(await client.budgetSpent(), 0);
    assert.equal(await client.outboxSize(), 0);
    await client.histogram("pages").report(1);
    assert.equal(await client.budgetSpent(), 2);
    await client.close();
  });

  test("a report without local privacy (Balcer–Cheu) spends an infinite ε, kept as such", async () => {
    const budgets = section("scenarios").find((s) => s["name"] === "budgets")!;
    const steps = budgets["steps"] as JsonObject[];
    const unbudgeted = steps.filter((s) => s["do"] === "config").at(-1)!["document"] as string;
    const storage = new MemoryStorage();
    const clock = { now: T0 + 10 };
    const first = await Client.create(options(new Shufflers(), clock, { storage, configText: unbudgeted }));
    await first.counts("counts").report(3);
    assert.equal(await first.budgetSpent("counts"), Infinity);
    await first.close();
    const again = await Client.create(options(new Shufflers(), clock, { storage, configText: unbudgeted }));
    assert.equal(await again.budgetSpent(), Infinity);
    await again.close();
  });

  test("a budget refusal changes nothing", async () => {
    const clock = { now: T0 + 10 };
    const client = await Client.create(options(new Shufflers(), clock, { caps: { lifetimeEps: 3 } }));
    await client.histogram("pages").report(1);
    clock.now += 3600;
    await assert.rejects(client.histogram("clicks").report(1), BudgetExceededError);
    assert.equal(await client.budgetSpent(), 2);
    await client.close();
  });

  test("FileStorage keeps the state in a file; a damaged file is set aside for a new device", async () => {
    const folder = mkdtempSync(join(tmpdir(), "esa-sdk-"));
    const path = join(folder, "state", "esa.json");
    const clock = { now: T0 + 10 };
    const first = await Client.create(options(new Shufflers(), clock, { storage: new FileStorage(path) }));
    await first.histogram("pages").report(1);
    const id = first.deviceId;
    await first.close();
    assert.match(readFileSync(path, "utf8"), /"outbox":\[\{/);
    const again = await Client.create(options(new Shufflers(), clock, { storage: new FileStorage(path) }));
    assert.equal(again.deviceId, id);
    await again.close();
    writeFileSync(path, "{not json");
    const reset = await Client.create(options(new Shufflers(), clock, { storage: new FileStorage(path) }));
    assert.notEqual(reset.deviceId, id);
    assert.equal(reset.state.wasReset, true);
    assert.ok(readdirSync(join(folder, "state")).some((name) => name.startsWith("esa.json.corrupt-")));
    await reset.close();
  });
});

describe("arguments", () => {
  test("bad arguments and keys are typed errors", async () => {
    const shufflers = new Shufflers();
    const clock = { now: T0 + 10 };
    await assert.rejects(Client.create(options(shufflers, clock, { timeout: 0 })), InvalidArgumentError);
    await assert.rejects(Client.create(options(shufflers, clock, { weights: { s1: -1 } })), InvalidArgumentError);
    await assert.rejects(Client.create(options(shufflers, clock, { caps: { localEps: -1 } })), InvalidArgumentError);
    await assert.rejects(Client.create(options(shufflers, clock, { trust: '{"analyzer": "AAAA", "shufflers": {}}' })), TrustedKeyError);
    await assert.rejects(Client.create(options(shufflers, clock, { trust: "not json" })), TrustedKeyError);
    await assert.rejects(Client.create(options(shufflers, clock, { configUrl: "ftp://x", configText: undefined as never })), EsaError);
  });
});
