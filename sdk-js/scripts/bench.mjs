// Timings of the built SDK (dist/) for benchmarks/sdk_js.py: reads one JSON request on stdin,
// writes one JSON answer.
//
//   {"config_text", "trust", "channels": [ids], "reports": n, "rounds": r, "storage":
//    "memory"|"file", "dir": folder, "backend": "webcrypto"|"noble", "seals": n}
//
// Per channel: ms per report (check the config, encode, HPKE-seal every fragment and the
// contribution, commit state and outbox to the storage), the clock one epoch further each
// report, the best of r rounds of n reports; and HPKE seals per second of one padded 16-byte
// fragment, the best of r rounds of n seals.
import { Client, MemoryStorage } from "../dist/index.js";
import { recipient, seal, useBackends } from "../dist/crypto.js";
import { FileStorage } from "../dist/node.js";
import { randomBytes } from "../dist/random.js";

const silent = { warn: () => undefined, error: () => undefined };
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const request = JSON.parse(Buffer.concat(chunks).toString("utf8"));
useBackends({ ed25519: request.backend, x25519: request.backend });

const perReport = {};
const start = Math.floor(Date.now() / 1000);
for (const channel of request.channels) {
  let tick = 0;
  const storage = request.storage === "file" ? new FileStorage(`${request.dir}/${channel}-${request.backend}.json`) : new MemoryStorage();
  const client = await Client.create({
    configText: request.config_text,
    trust: request.trust,
    storage,
    background: false,
    clock: () => start + tick,
    logger: silent,
  });
  const reporter = client.histogram(channel);
  await reporter.report(0); // warm-up: key import, JIT
  let best = Infinity;
  for (let round = 0; round < request.rounds; round++) {
    const began = performance.now();
    for (let i = 1; i <= request.reports; i++) {
      tick += 1;
      await reporter.report(i % 16);
    }
    best = Math.min(best, (performance.now() - began) / request.reports);
  }
  perReport[channel] = best;
  await client.close();
}

const key = await recipient(randomBytes(32).map((b, i) => (i === 0 ? b & 248 : b)));
const info = new Uint8Array(40);
const plaintext = new Uint8Array(16);
for (let i = 0; i < 50; i++) await seal(plaintext, key, info);
let fastest = Infinity;
for (let round = 0; round < request.rounds; round++) {
  const began = performance.now();
  for (let i = 0; i < request.seals; i++) await seal(plaintext, key, info);
  fastest = Math.min(fastest, performance.now() - began);
}
const sealsPerSecond = request.seals / (fastest / 1000);
process.stdout.write(JSON.stringify({ per_report: perReport, seals_per_second: sealsPerSecond }));
