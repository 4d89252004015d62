/**
 * The device side of an LDP mechanism (docs/mechanisms.md, "The interface"): its parameters,
 * local privacy, device state and encoder. Each mirrors its Python module draw for draw
 * (the same `random()`/`randbelow()` calls in the same order), so the shared vectors replay
 * Python's recorded draws through it and compare the fragments.
 */

import { dumps, isInt, numeric, type JsonObject, type JsonValue } from "../pyjson.js";
import type { RandomSource } from "../random.js";
import { uintBE } from "../bytes.js";
import { frame } from "../wire.js";

/** What an app hands the SDK for one report: a category (an integer) or a state update. */
export type ValueKind = "category" | "state";

/** One period of a 0/1 state: whether it flipped at `period`. */
export interface StateUpdate {
  period: number;
  changed: boolean;
}

/** Local ε of one report under each notion (ESA-revisited Definition II.4, Theorem IV.1). */
export interface LocalPrivacy {
  removal: number;
  replacement: number;
  eps_l_inf: number;
  eps_l1: number;
}

/** The notions, in the order a device compares them. */
export const NOTIONS = ["replacement", "removal", "eps_l_inf", "eps_l1"] as const;

/** One report, ready to seal: (shuffler slot or null, fragments) routes, and the new state. */
export interface Encoded {
  routes: [number | null, Uint8Array[]][];
  state: JsonObject | null;
}

/** Parameters that do not validate (Python's ValueError or TypeError from `parse_params`). */
export class ParamsError extends Error {}

/** A value or device state the mechanism cannot encode. */
export class MechanismError extends Error {}

/** The saved device state cannot be used (drawn for other parameters, or corrupted). */
export class StateConflictError extends MechanismError {}

/** A state update for a period at or before the last one reported. */
export class StaleUpdateError extends MechanismError {}

export interface Mechanism<P = unknown> {
  readonly name: string;
  readonly code: number;
  readonly valueKind: ValueKind;
  /** No local privacy by design (all of it from the shuffle). */
  readonly shuffleOnly: boolean;
  /** Whether this SDK can encode reports (false: only its terms are understood). */
  readonly encodes: boolean;
  /** @throws ParamsError naming the bad parameter. */
  parseParams(raw: JsonObject): P;
  /** Python's `==` of two parsed parameter sets. */
  sameParams(a: P, b: P): boolean;
  localPrivacy(params: P): LocalPrivacy;
  newState(params: P, rng: RandomSource): JsonObject | null;
  /** @throws MechanismError (or a subclass) for a value or state it cannot use. */
  encode(params: P, value: unknown, state: JsonObject | null, rng: RandomSource, shufflers: number): Encoded;
}

/** Read `raw` as keyword arguments: no unknown key, every required one. */
export function kwargs(raw: JsonObject, required: readonly string[], optional: readonly string[] = []): void {
  for (const key of Object.keys(raw)) {
    if (!required.includes(key) && !optional.includes(key)) throw new ParamsError(`unexpected parameter ${key}`);
  }
  for (const key of required) if (!(key in raw)) throw new ParamsError(`missing parameter ${key}`);
}

/** Python's repr of a parsed JSON value (names a bad parameter as Python does). */
export function show(value: JsonValue | undefined): string {
  if (value === undefined) return "None";
  if (typeof value === "string") return `'${value}'`;
  if (typeof value === "boolean") return value ? "True" : "False";
  return dumps(value);
}

/** An integer (not a bool, not a float) in [min, limit). */
export function checkInt(name: string, value: JsonValue | undefined, min: number, limit = Infinity): number {
  if (!isInt(value)) throw new ParamsError(`${name} must be an integer in [${min}, ${limit}), got ${name}=${show(value)}`);
  const n = Number(value);
  if (!(n >= min && n < limit) || !Number.isSafeInteger(n)) {
    throw new ParamsError(`${name} must be an integer in [${min}, ${limit}), got ${name}=${show(value)}`);
  }
  return n;
}

/** A domain size: an integer in [2, limit) (uint32 on the wire by default). */
export function checkBins(name: string, value: JsonValue | undefined, limit = 2 ** 32): number {
  return checkInt(name, value, 2, limit);
}

/** A local ε: a finite number > 0 (an int or float, never a bool). */
export function checkEps(name: string, value: JsonValue | undefined): number {
  const n = typeof value === "bigint" ? Number.NaN : numeric(value);
  if (n === undefined || !Number.isFinite(n) || n <= 0) {
    throw new ParamsError(`${name} must be a finite number > 0, got ${name}=${show(value)}`);
  }
  return n;
}

/** A categorical value in [0, k): a JS integer (a boolean or a fraction is refused). */
export function checkValue(value: unknown, k: number): number {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 0 || value >= k) {
    throw new MechanismError(`value must be an integer in [0, ${k}), got value=${String(value)}`);
  }
  return value;
}

/** A fragment whose payload is one uint32 index. */
export function indexFragment(code: number, index: number): Uint8Array {
  return frame(code, uintBE(index, 4));
}

/** A histogram mechanism: one category per report, one route the SDK picks a shuffler for. */
export abstract class IndexHistogram<P> implements Mechanism<P> {
  abstract readonly name: string;
  abstract readonly code: number;
  readonly valueKind: ValueKind = "category";
  readonly shuffleOnly: boolean = false;
  readonly encodes: boolean = true;
  abstract parseParams(raw: JsonObject): P;
  abstract sameParams(a: P, b: P): boolean;
  abstract localPrivacy(params: P): LocalPrivacy;
  abstract domainSize(params: P): number;
  /** The fragments of one report of `value` (already checked against the domain). */
  abstract encodeValue(params: P, value: number, rng: RandomSource): Uint8Array[];

  newState(): JsonObject | null {
    return null;
  }

  encode(params: P, value: unknown, _state: JsonObject | null, rng: RandomSource): Encoded {
    const checked = checkValue(value, this.domainSize(params));
    return { routes: [[null, this.encodeValue(params, checked, rng)]], state: null };
  }
}
