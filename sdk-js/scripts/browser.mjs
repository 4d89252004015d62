// Visits of the example page (docs/examples/web/) in headless Chromium, for the browser e2e
// test (tests/e2e/test_browser.py) and benchmarks/sdk_js_browser.py: reads one JSON request on
// stdin, writes one JSON answer on stdout. Chromium is the system's (`chromium` on PATH, or
// ESA_CHROMIUM), driven by playwright-core (no browser download).
//
//   {"mode": "visits", "page": url, "queries": ["db=d1&homepage=3", ...], "tabs": n}
//     every query is one visit of the page (one device, its own IndexedDB database when each
//     query names its own db), n tabs at a time; answers {"visits": [{"query", "state",
//     "result", "error", "log"}]} in the order of the queries.
//   {"mode": "devices", "page": url, "devices": [{"configUrl", "trustUrl", "database",
//    "homepage", "abroad"}], "tabs": n}
//     n tabs load the page once each (run=0) and run the devices through the page's own
//     runDevice(), one after the other in each tab (a navigation costs Chromium more than a
//     device does); answers {"devices": [{"state", "result", "error"}]} in the given order.
//   {"mode": "bench", "page": url, "config": url, "devices": n}
//     n devices are created on the page (loaded with run=0), each with its own IndexedDB
//     database; then each makes the page's three reports, one device
//     after the other, and the page's main thread is measured (measure(), below, and the
//     DevTools protocol's Performance.getMetrics: the main thread's TaskDuration).
import { execFileSync } from "node:child_process";
import { chromium } from "playwright-core";

function executable() {
  if (process.env.ESA_CHROMIUM) return process.env.ESA_CHROMIUM;
  for (const name of ["chromium", "chromium-browser", "google-chrome"]) {
    try {
      return execFileSync("which", [name], { encoding: "utf8" }).trim();
    } catch {
      // not this one
    }
  }
  throw new Error("no chromium on PATH (apt-get install chromium), nor ESA_CHROMIUM");
}

async function read() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

/** One visit: load the page with `query`, wait until its device is done or failed. */
async function visit(page, base, query) {
  await page.goto(`${base}?${query}`);
  // polled on a timer: polling by animation frame would render the page at 60 Hz meanwhile
  await page.waitForFunction(() => document.body.dataset.state !== "loading", null, { timeout: 60_000, polling: 50 });
  return page.evaluate(() => ({
    state: document.body.dataset.state,
    result: document.body.dataset.result ? JSON.parse(document.body.dataset.result) : null,
    error: document.getElementById("error").textContent,
    log: [...document.querySelectorAll("#log li")].map((li) => li.textContent),
  }));
}

async function visits(browser, request) {
  const context = await browser.newContext();
  const answers = new Array(request.queries.length);
  let next = 0;
  const tab = async () => {
    const page = await context.newPage();
    page.on("pageerror", (error) => process.stderr.write(`page error: ${error.message}\n`));
    while (next < request.queries.length) {
      const index = next++;
      answers[index] = { query: request.queries[index], ...(await visit(page, request.page, request.queries[index])) };
    }
    await page.close();
  };
  await Promise.all(Array.from({ length: Math.max(1, request.tabs ?? 1) }, tab));
  await context.close();
  return { visits: answers };
}

/** Stats of durations in ms: count, median, 99th percentile, largest, sum. */
function summary(values) {
  const sorted = [...values].sort((a, b) => a - b);
  const at = (q) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? 0;
  return { count: sorted.length, p50: at(0.5), p99: at(0.99), max: at(1), sum: sorted.reduce((a, b) => a + b, 0) };
}

/**
 * In the page: the synchronous part of each report call (performance.now() around it), the
 * time until its promise settles, and the tasks over 50 ms meanwhile (PerformanceObserver
 * "longtask"); every device's three reports are called back to back, as the page calls them.
 */
async function measure(request) {
  const bench = globalThis.__esaBench;
  const long = [];
  const observer = new PerformanceObserver((list) => long.push(...list.getEntries().map((e) => e.duration)));
  observer.observe({ type: "longtask" });
  const gaps = []; // between runs of a setTimeout(0) chain: how long the page could not run
  let last = performance.now();
  let probing = true;
  const probe = () => {
    const now = performance.now();
    gaps.push(now - last);
    last = now;
    if (probing) setTimeout(probe, 0);
  };
  setTimeout(probe, 0);
  const sync = [];
  const settled = [];
  const began = performance.now();
  for (const [i, client] of bench.clients.entries()) {
    const value = i % 64;
    const calls = [
      () => client.histogram("homepage").report(value),
      () => client.histogram("homepage-fragments").report(value),
      () => client.longitudinal("abroad").update(1, i % 2 === 0),
    ];
    const pending = calls.map((call) => {
      const start = performance.now();
      const promise = call();
      sync.push(performance.now() - start);
      return promise.then(() => settled.push(performance.now() - start));
    });
    await Promise.all(pending);
  }
  const elapsed = performance.now() - began;
  probing = false;
  await new Promise((resolve) => setTimeout(resolve, 100)); // the last long task's entry
  observer.disconnect();
  return { sync, settled, long, gaps, elapsed, reports: sync.length };
}

async function bench(browser, request) {
  const context = await browser.newContext();
  const page = await context.newPage();
  const ready = await visit(page, request.page, "run=0");
  if (ready.state !== "ready") throw new Error(`the page did not load: ${JSON.stringify(ready)}`);
  await page.evaluate(async ({ config, devices }) => {
    const esa = globalThis.esaExample.esa;
    const trust = await (await fetch("trust.json")).text();
    const clients = [];
    for (let i = 0; i < devices; i++) {
      const storage = new esa.IndexedDBStorage(`bench-${i}`);
      clients.push(await esa.Client.create({ configUrl: config, trust, storage, background: false }));
    }
    globalThis.__esaBench = { esa, clients };
  }, request);
  const cdp = await context.newCDPSession(page);
  await cdp.send("Performance.enable");
  const before = await cdp.send("Performance.getMetrics");
  const found = await page.evaluate(measure, request);
  const after = await cdp.send("Performance.getMetrics");
  const delta = (name) => {
    const value = (metrics) => metrics.metrics.find((m) => m.name === name)?.value ?? 0;
    return (value(after) - value(before)) * 1000;
  };
  await page.evaluate(async () => {
    for (const client of globalThis.__esaBench.clients) await client.close();
  });
  await context.close();
  return {
    reports: found.reports,
    elapsed_ms: found.elapsed,
    sync_ms: summary(found.sync),
    settled_ms: summary(found.settled),
    long_tasks_ms: summary(found.long),
    event_loop_gaps_ms: summary(found.gaps),
    main_thread: { task_ms: delta("TaskDuration"), script_ms: delta("ScriptDuration") },
    version: browser.version(),
  };
}

/** In the page: one device through the page's runDevice(), its outcome as a visit's. */
function runOne(device) {
  return globalThis.esaExample.runDevice(device).then(
    (result) => ({ state: "done", result, error: "" }),
    (error) => ({ state: "failed", result: null, error: `${error?.name}: ${error?.message}` }),
  );
}

async function devices(browser, request) {
  const context = await browser.newContext();
  const answers = new Array(request.devices.length);
  let next = 0;
  const tab = async () => {
    const page = await context.newPage();
    page.on("pageerror", (error) => process.stderr.write(`page error: ${error.message}\n`));
    const ready = await visit(page, request.page, "run=0");
    if (ready.state !== "ready") throw new Error(`the page did not load: ${JSON.stringify(ready)}`);
    while (next < request.devices.length) {
      const index = next++;
      answers[index] = await page.evaluate(runOne, request.devices[index]);
    }
    await page.close();
  };
  await Promise.all(Array.from({ length: Math.max(1, request.tabs ?? 1) }, tab));
  await context.close();
  return { devices: answers };
}

const modes = { visits, devices, bench };
const request = await read();
const browser = await chromium.launch({ executablePath: executable(), headless: true, args: ["--disable-gpu"] });
try {
  const answer = await modes[request.mode](browser, request);
  process.stdout.write(JSON.stringify(answer));
} finally {
  await browser.close();
}
