// Reports of one value drawn by the built SDK's encoders (dist/), each by a new device, for
// the mechanism contract suite (tests/mechanisms/test_contract_sdk_js.py):
//
//   node scripts/sample.mjs NAME PARAMS_JSON VALUE_JSON DRAWS SEED [MUTATION]
//
// prints one line per report, its fragments in hex separated by commas. SEED "system" draws
// from the platform CSPRNG (what a device does); a number draws from a seeded generator
// (sfc32; tests only), so a check is deterministic, as the Python suite's SeededSource makes
// it. MUTATION makes a wrong encoder, to show the suite catches it: "eps=F" encodes with every
// ε parameter times F; "coin=F" draws every uniform as F times the source's (a biased coin).
import { mechanism } from "../dist/mechanisms/index.js";
import { parse } from "../dist/pyjson.js";
import { SystemSource } from "../dist/random.js";

/** A seeded source with the SDK's two draws (Chris Doty-Humphrey's sfc32, 32-bit words). */
function seeded(seed) {
  let [a, b, c, d] = [0x9e3779b9, 0x243f6a88, 0xb7e15162, seed >>> 0];
  const word = () => {
    const t = (((a + b) | 0) + d) | 0;
    d = (d + 1) | 0;
    a = b ^ (b >>> 9);
    b = (c + (c << 3)) | 0;
    c = (c << 21) | (c >>> 11);
    c = (c + t) | 0;
    return t >>> 0;
  };
  for (let i = 0; i < 20; i++) word();
  const random = () => ((word() >>> 5) * 67108864 + (word() >>> 6)) / 9007199254740992;
  const randbelow = (n) => {
    const limit = 0x100000000 - (0x100000000 % n);
    for (;;) {
      const w = word();
      if (w < limit) return w % n;
    }
  };
  return { random, randbelow };
}

const [name, paramsText, valueText, drawsText, seedText, mutation = ""] = process.argv.slice(2);
const params = parse(paramsText);
const [kind, factorText] = mutation.split("=");
const factor = Number(factorText);
if (kind === "eps") {
  for (const key of ["eps", "eps_b", "eps_f"]) if (key in params) params[key] = Number(params[key].value ?? params[key]) * factor;
}
const source = seedText === "system" ? new SystemSource() : seeded(Number(seedText));
const rng = kind === "coin" ? { random: () => source.random() * factor, randbelow: (n) => source.randbelow(n) } : source;
const found = mechanism(name);
const parsed = found.parseParams(params);
const value = JSON.parse(valueText);
const lines = [];
for (let i = 0; i < Number(drawsText); i++) {
  const encoded = found.encode(parsed, value, found.newState(parsed, rng), rng, 1);
  lines.push(encoded.routes.flatMap(([, fragments]) => fragments.map((f) => Buffer.from(f).toString("hex"))).join(","));
}
process.stdout.write(lines.join("\n") + "\n");
