/**
 * Field readers with the coercions the Python side's models apply to a signed document
 * (pydantic's lax mode): an integer field takes `3`, `3.0`, `true` or `"3"`; a float field
 * takes integers, booleans and numeric strings (`"inf"` too); a string field takes strings
 * only. What one side accepts the other must accept, or a device and a shuffler would
 * disagree about a document both verified.
 */

import { PyFloat, isObject, type JsonObject, type JsonValue } from "./pyjson.js";

/** A document that does not validate, naming the field and why. */
export class ValidationError extends Error {}

const INT_TEXT = /^\s*[+-]?\d+(?:_\d+)*(?:\.0*)?\s*$/;
const I64 = 2 ** 63;

export interface Bounds {
  ge?: number;
  gt?: number;
  le?: number;
  lt?: number;
}

function fail(path: string, why: string): never {
  throw new ValidationError(`${path}: ${why}`);
}

function bounded(path: string, value: number, bounds: Bounds): number {
  if (bounds.ge !== undefined && !(value >= bounds.ge)) fail(path, `must be >= ${bounds.ge}, got ${value}`);
  if (bounds.gt !== undefined && !(value > bounds.gt)) fail(path, `must be > ${bounds.gt}, got ${value}`);
  if (bounds.le !== undefined && !(value <= bounds.le)) fail(path, `must be <= ${bounds.le}, got ${value}`);
  if (bounds.lt !== undefined && !(value < bounds.lt)) fail(path, `must be < ${bounds.lt}, got ${value}`);
  return value;
}

/** An integer field (safe integers only: every bounded field of the wire is). */
export function int(value: JsonValue | undefined, path: string, bounds: Bounds = {}): number {
  let found: number | undefined;
  if (typeof value === "boolean") found = value ? 1 : 0;
  else if (typeof value === "number" || value instanceof PyFloat) {
    const n = typeof value === "number" ? value : value.value;
    if (Number.isInteger(n) && Math.abs(n) < I64) found = n;
  } else if (typeof value === "string" && INT_TEXT.test(value)) {
    found = Number(value.trim().replace(/_/g, "").replace(/\.0*$/, ""));
  }
  if (found === undefined || !Number.isSafeInteger(found)) fail(path, `must be an integer, got ${describe(value)}`);
  return bounded(path, found === 0 ? 0 : found, bounds);
}

function floatText(value: string): number | undefined {
  const text = value.trim().toLowerCase();
  if (/^[+-]?(inf|infinity)$/.test(text)) return text.startsWith("-") ? -Infinity : Infinity;
  const plain = text.replace(/(\d)_(?=\d)/g, "$1");
  return /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/.test(plain) ? Number(plain) : undefined;
}

/** A float field. */
export function float(value: JsonValue | undefined, path: string, bounds: Bounds = {}): number {
  let found: number | undefined;
  if (typeof value === "boolean") found = value ? 1 : 0;
  else if (typeof value === "number") found = value;
  else if (value instanceof PyFloat) found = value.value;
  else if (typeof value === "bigint") found = Number(value);
  else if (typeof value === "string") found = floatText(value);
  if (found === undefined || Number.isNaN(found) || (typeof value === "bigint" && !Number.isFinite(found))) {
    fail(path, `must be a number, got ${describe(value)}`);
  }
  return bounded(path, found, bounds);
}

export interface TextRules {
  pattern?: RegExp;
  min?: number;
  max?: number;
}

/** A string field (its length in code points, as Python counts). */
export function str(value: JsonValue | undefined, path: string, rules: TextRules = {}): string {
  if (typeof value !== "string") fail(path, `must be a string, got ${describe(value)}`);
  const length = [...value].length;
  if (rules.min !== undefined && length < rules.min) fail(path, `must have at least ${rules.min} characters`);
  if (rules.max !== undefined && length > rules.max) fail(path, `must have at most ${rules.max} characters`);
  if (rules.pattern !== undefined && !rules.pattern.test(value)) {
    fail(path, `must match ${rules.pattern.source}, got ${JSON.stringify(value.slice(0, 80))}`);
  }
  return value;
}

/** A JSON object field. */
export function obj(value: JsonValue | undefined, path: string): JsonObject {
  if (!isObject(value)) fail(path, `must be an object, got ${describe(value)}`);
  return value;
}

/** A JSON array field of `min`..`max` items. */
export function list(value: JsonValue | undefined, path: string, min = 0, max = Infinity): JsonValue[] {
  if (!Array.isArray(value)) fail(path, `must be a list, got ${describe(value)}`);
  if (value.length < min) fail(path, `must have at least ${min} items`);
  if (value.length > max) fail(path, `must have at most ${max} items`);
  return value;
}

/** `read` of the field, or `fallback` when the field is absent; null stays null only if allowed. */
export function field<T>(
  object: JsonObject,
  key: string,
  read: (value: JsonValue, path: string) => T,
  fallback: T | (() => never),
  path: string,
): T {
  if (!(key in object)) {
    if (typeof fallback === "function") return (fallback as () => never)();
    return fallback;
  }
  return read(object[key]!, `${path}.${key}`);
}

/** A reader that also takes null. */
export function nullable<T>(read: (value: JsonValue, path: string) => T): (value: JsonValue, path: string) => T | null {
  return (value, path) => (value === null ? null : read(value, path));
}

/** A required field's fallback: fails naming it. */
export function required(path: string, key: string): () => never {
  return () => fail(`${path}.${key}`, "field required");
}

/** Refuse keys a model forbids (`extra="forbid"`). */
export function noExtra(object: JsonObject, allowed: readonly string[], path: string): void {
  for (const key of Object.keys(object)) {
    if (!allowed.includes(key)) fail(`${path}.${key}`, "extra inputs are not permitted");
  }
}

export function describe(value: JsonValue | undefined): string {
  if (value === undefined) return "nothing";
  if (value instanceof PyFloat) return String(value.value);
  if (typeof value === "bigint") return `${value.toString().slice(0, 20)}...`;
  if (typeof value === "string") return JSON.stringify(value.slice(0, 80));
  if (Array.isArray(value)) return "a list";
  if (isObject(value)) return "an object";
  return String(value);
}
