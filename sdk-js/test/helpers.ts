/** What the tests share: the vectors Python made, a replaying random source, comparisons. */

import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { PyFloat, isObject, parse, type JsonObject, type JsonValue } from "../src/pyjson.js";
import type { RandomSource } from "../src/random.js";
import type { Logger } from "../src/client.js";

const HERE = fileURLToPath(new URL(".", import.meta.url));
/** sdk-js/ (tests run from build/test/). */
export const ROOT = `${HERE}/../..`;

let cached: JsonObject | undefined;

/** vectors/wire.json, read with the SDK's own Python-compatible parser (big integers, 2.0). */
export function vectors(): JsonObject {
  cached ??= parse(readFileSync(`${ROOT}/vectors/wire.json`, "utf8")) as JsonObject;
  return cached;
}

export function section(name: string): JsonObject[] {
  return vectors()[name] as JsonObject[];
}

/** Replays draws Python recorded, refusing a draw of another kind or bound. */
export class Tape implements RandomSource {
  private next = 0;
  constructor(private readonly draws: JsonValue[][]) {}

  private take(kind: string, bound?: number): number {
    const draw = this.draws[this.next++];
    if (draw === undefined) throw new Error(`no recorded draw left for ${kind}`);
    const expected = bound === undefined ? [kind] : [kind, bound];
    const found = draw.slice(0, -1).map((v) => (v instanceof PyFloat ? v.value : v));
    if (JSON.stringify(found) !== JSON.stringify(expected)) {
      throw new Error(`draw ${this.next - 1} is ${JSON.stringify(found)}, not ${JSON.stringify(expected)}`);
    }
    const value = draw[draw.length - 1]!;
    return value instanceof PyFloat ? value.value : (value as number);
  }

  random(): number {
    return this.take("random");
  }

  randbelow(upper: number): number {
    return this.take("randbelow", upper);
  }

  get usedUp(): boolean {
    return this.next === this.draws.length;
  }
}

/** A value as the vectors write it: infinities as "inf", 2.0 as 2, lists and objects alike. */
export function plain(value: unknown): unknown {
  if (value instanceof PyFloat) return value.value;
  if (typeof value === "number" && !Number.isFinite(value)) return Number.isNaN(value) ? "nan" : value > 0 ? "inf" : "-inf";
  if (typeof value === "bigint") return Number.isSafeInteger(Number(value)) ? Number(value) : `bigint:${value}`;
  if (Array.isArray(value)) return value.map(plain);
  if (value instanceof Map) return plain(Object.fromEntries(value));
  if (isObject(value) || (typeof value === "object" && value !== null)) {
    return Object.fromEntries(Object.entries(value as object).map(([k, v]) => [k, plain(v)]));
  }
  return value;
}

/** Deep equality of plain values, numbers within a relative 1e-12 (transcendental functions may differ in the last bit). */
export function close(a: unknown, b: unknown, path = "$"): string | null {
  const x = plain(a);
  const y = plain(b);
  if (typeof x === "number" && typeof y === "number") {
    return x === y || Math.abs(x - y) <= 1e-12 * Math.max(Math.abs(x), Math.abs(y)) ? null : `${path}: ${x} != ${y}`;
  }
  if (Array.isArray(x) && Array.isArray(y)) {
    if (x.length !== y.length) return `${path}: ${x.length} items != ${y.length}`;
    for (let i = 0; i < x.length; i++) {
      const found = close(x[i], y[i], `${path}[${i}]`);
      if (found !== null) return found;
    }
    return null;
  }
  if (typeof x === "object" && x !== null && typeof y === "object" && y !== null && !Array.isArray(x) && !Array.isArray(y)) {
    const keys = new Set([...Object.keys(x), ...Object.keys(y)]);
    for (const key of keys) {
      const found = close((x as Record<string, unknown>)[key], (y as Record<string, unknown>)[key], `${path}.${key}`);
      if (found !== null) return found;
    }
    return null;
  }
  return x === y ? null : `${path}: ${JSON.stringify(x)} != ${JSON.stringify(y)}`;
}

export const SILENT: Logger = { warn: () => undefined, error: () => undefined };
