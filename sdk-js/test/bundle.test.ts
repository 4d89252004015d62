/** The browser bundle (dist/esa-device-sdk.browser.js, minified) as a page imports it. */

import assert from "node:assert/strict";
import { test } from "node:test";
import * as source from "../src/index.js";

type Sdk = typeof source;
// the bundle is built by `npm run build` before the tests (npm's pretest); from build/test/
const BUNDLE = new URL("../../dist/esa-device-sdk.browser.js", import.meta.url).href;

test("every EsaError in the minified bundle is named by its class, as in the Python SDK", async () => {
  const bundle = (await import(BUNDLE)) as Sdk;
  const errors = Object.entries(source).filter(
    ([, value]) => typeof value === "function" && (value === source.EsaError || value.prototype instanceof source.EsaError),
  );
  assert.ok(errors.length >= 14, `only ${errors.length} error classes exported`);
  for (const [name] of errors) {
    const Made = bundle[name as keyof Sdk] as unknown as new (message: string, details: object) => Error;
    const error = new Made("x", { channelId: "c", field: "f", old: 1, new: 2, cap: 1, value: 2 });
    assert.equal(error.name, name);
    assert.ok(error instanceof bundle.EsaError);
  }
});
