// The example page's device (index.html; docs/sdk-js.md, "The example page"): loads the
// pinned keys, creates a Client whose state lives in this origin's IndexedDB, reports one
// value on a k-RAPPOR channel, a report-fragments channel and a longitudinal channel, delivers
// them and shows each step, and any EsaError, on the page.
import * as esa from "./esa-device-sdk.browser.js";

const query = new URLSearchParams(location.search);

/** ``path`` resolved against this page; refused unless it is on the page's own origin. */
function sameOrigin(path) {
  const url = new URL(path, location.href);
  if (url.origin !== location.origin) {
    throw new Error(`the trust file must come from this page's origin, not ${url.origin}`);
  }
  return url.href;
}
/** The page's device, from the query (index.html lists the parameters). */
const settings = {
  // `esa up` serves the analyzer on 127.0.0.1:8100 and allows this page's origin (CORS)
  configUrl: query.get("config") ?? "http://127.0.0.1:8100/v1/config",
  // var/trust.json of the deployment, copied next to this page: never fetched from the analyzer,
  // and never from another origin (a link must not be able to choose the keys this page pins)
  trustUrl: sameOrigin(query.get("trust") ?? "trust.json"),
  // one IndexedDB database per device; the default is the SDK's own
  database: query.get("db") ?? "esa-device-sdk",
  homepage: Number(query.get("homepage") ?? "7"),
  abroad: query.get("abroad") !== "0",
};

const shown = {
  log: document.getElementById("log"),
  status: document.getElementById("status"),
  error: document.getElementById("error"),
};

/** One line in the page's log. */
function say(text) {
  const item = document.createElement("li");
  item.textContent = text;
  shown.log.append(item);
}

/** The error on the page: an EsaError by its class name (what the SDK raised), else as is. */
function showError(error) {
  const name = error instanceof esa.EsaError ? error.name : `unexpected ${error?.name ?? "error"}`;
  shown.error.textContent = `${name}: ${error?.message ?? String(error)}`;
}

/** A report's outcome: "ok", or the EsaError's name, shown on the page (others propagate). */
async function outcome(what, report) {
  try {
    await report;
    say(`${what}: queued`);
    return "ok";
  } catch (error) {
    if (!(error instanceof esa.EsaError)) throw error;
    say(`${what}: refused (${error.name})`);
    showError(error);
    return error.name;
  }
}

/**
 * One device: load the trust file, create its client (its state in the IndexedDB database
 * `database`), report on the three channels, deliver. Exported for tests that run many
 * devices on one page load (tests/e2e/test_browser.py); the page runs its own on load.
 */
export async function runDevice({ configUrl, trustUrl, database, homepage, abroad }) {
  const response = await fetch(trustUrl, { cache: "no-store" });
  if (!response.ok) throw new Error(`the trust file ${trustUrl}: HTTP ${response.status}`);
  const trust = await response.text();
  say(`trust file ${trustUrl} loaded (the analyzer's key and each shuffler's)`);
  const client = await esa.Client.create({
    configUrl,
    trust,
    storage: new esa.IndexedDBStorage(database),
    background: false, // flush() below delivers at once, so the page can say what it sent
  });
  const backends = await esa.backends();
  say(`config verified; shufflers ${client.status().shufflers.join(", ")}; device ${client.deviceId}`);
  say(`storage IndexedDB "${database}"; X25519 ${backends.x25519}, Ed25519 ${backends.ed25519}`);
  const outcomes = [
    await outcome(`homepage (k-RAPPOR) ${homepage}`, client.histogram("homepage").report(homepage)),
    await outcome(`homepage-fragments ${homepage}`, client.histogram("homepage-fragments").report(homepage)),
    await outcome(`abroad period 1, changed ${abroad}`, client.longitudinal("abroad").update(1, abroad)),
  ];
  const delivered = await client.flush();
  const left = await client.outboxSize();
  await client.close();
  say(`delivered ${delivered} contribution(s); ${left} left in the outbox`);
  return { outcomes, delivered, left, deviceId: client.deviceId };
}

globalThis.esaExample = { runDevice, esa };

// ?run=0: load without reporting (state "ready"), for runDevice() alone
const run = query.get("run") === "0" ? Promise.resolve(null) : runDevice(settings);
run.then(
  (result) => {
    if (result === null) {
      document.body.dataset.state = "ready";
      shown.status.textContent = "ready";
      return;
    }
    document.body.dataset.result = JSON.stringify(result);
    document.body.dataset.state = "done";
    shown.status.textContent = result.outcomes.every((o) => o === "ok") ? "reported" : "done, with refusals";
  },
  (error) => {
    showError(error);
    document.body.dataset.state = "failed";
    shown.status.textContent = "failed";
  },
);
