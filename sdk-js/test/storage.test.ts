/** The browser storage (IndexedDB, here fake-indexeddb's implementation in Node) behind a client. */

import assert from "node:assert/strict";
import { test } from "node:test";
import { IDBFactory } from "fake-indexeddb";
import { Client } from "../src/client.js";
import { dumps, type JsonObject } from "../src/pyjson.js";
import { IndexedDBStorage } from "../src/storage.js";
import { SILENT, section, vectors } from "./helpers.js";

const T0 = Number(vectors()["t0"]);
const HONEST = section("scenarios").find((s) => s["name"] === "honest lifecycle")!;
const DOCUMENT = (HONEST["steps"] as JsonObject[])[0]!["document"] as string;

function create(storage: IndexedDBStorage, now: number) {
  return Client.create({
    configText: DOCUMENT,
    trust: dumps(HONEST["trust"]!),
    storage,
    background: false,
    clock: () => now,
    logger: SILENT,
  });
}

test("IndexedDB keeps the device across clients; a damaged record is set aside", async () => {
  const factory = new IDBFactory();
  const first = await create(new IndexedDBStorage("esa", "state", factory), T0 + 10);
  await first.histogram("pages").report(1);
  const id = first.deviceId;
  await first.close();
  const again = await create(new IndexedDBStorage("esa", "state", factory), T0 + 10);
  assert.equal(again.deviceId, id);
  assert.equal(await again.outboxSize(), 1);
  assert.equal(await again.budgetSpent("pages"), 2);
  await again.close();
  const raw = new IndexedDBStorage("esa", "state", factory);
  await raw.save("damaged");
  await raw.close();
  const reset = await create(new IndexedDBStorage("esa", "state", factory), T0 + 10);
  assert.notEqual(reset.deviceId, id);
  assert.equal(reset.state.wasReset, true);
  await reset.close();
});
