// Devices played by the built SDK (dist/), for the Python system tests
// (tests/e2e/test_sdk_js.py): reads one JSON request on stdin, writes one JSON answer.
//
//   {"mode": "capture", "config_text": ..., "trust": {...}, "now": t, "reports": [...]}
//     one device reports each entry ({"channel", "value"} or {"channel", "period",
//     "changed"}, optional "crowd") at time "now" and flushes to a stand-in fetch that answers
//     202 and keeps each request: {"sent": [{"url", "body"}], "outcomes": [...]}, bodies base64.
//   {"mode": "devices", "config_url": ..., "trust": {...}, "devices": [{"channel", "value"}]}
//     one new device per entry reports to the real deployment and delivers its outbox:
//     {"delivered": n, "outcomes": [...], "left": n}.
import { Client, EsaError, MemoryStorage } from "../dist/index.js";

const silent = { warn: () => undefined, error: () => undefined };

async function read() {
  const chunks = [];
  for await (const chunk of process.stdin) chunks.push(chunk);
  return JSON.parse(Buffer.concat(chunks).toString("utf8"));
}

async function report(client, entry) {
  try {
    if ("period" in entry) await client.longitudinal(entry.channel, entry.crowd).update(entry.period, entry.changed);
    else await client.histogram(entry.channel, entry.crowd).report(entry.value);
    return "ok";
  } catch (error) {
    if (error instanceof EsaError) return error.name;
    throw error;
  }
}

async function capture(request) {
  const sent = [];
  const fetch = async (url, init) => {
    if (String(url).endsWith("/v1/enroll")) return new Response('{"client_token": "captured"}', { status: 200 });
    sent.push({ url: String(url), body: Buffer.from(init.body).toString("base64") });
    return new Response('{"receipt": "r"}', { status: 202 });
  };
  const client = await Client.create({
    configText: request.config_text,
    trust: request.trust,
    storage: new MemoryStorage(),
    background: false,
    clock: () => request.now,
    fetch,
    logger: silent,
  });
  const outcomes = [];
  for (const entry of request.reports) outcomes.push(await report(client, entry));
  await client.flush();
  await client.close();
  return { sent, outcomes };
}

async function devices(request) {
  let delivered = 0;
  let left = 0;
  const outcomes = [];
  for (const entry of request.devices) {
    const client = await Client.create({
      configUrl: request.config_url,
      trust: request.trust,
      storage: new MemoryStorage(),
      background: false,
      timeout: 30,
      logger: silent,
    });
    outcomes.push(await report(client, entry));
    delivered += await client.flush();
    left += await client.outboxSize();
    await client.close();
  }
  return { delivered, outcomes, left };
}

const request = await read();
const answer = request.mode === "capture" ? await capture(request) : await devices(request);
process.stdout.write(JSON.stringify(answer));
