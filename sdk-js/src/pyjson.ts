/**
 * JSON as the Python side reads and writes it.
 *
 * Signatures cover `json.dumps(document, sort_keys=True, separators=(",", ":"))` of what
 * `json.loads` made of the served text (docs/protocol-notes.md, "Signed documents"), so a
 * verifier must re-serialize exactly as Python does: integers of any size as their digits,
 * floats as Python's `repr` (`1e-09`, `100.0`, `1e+16`), strings with every character outside
 * printable ASCII escaped (`\u00e9`), keys sorted by code point. `JSON.parse` cannot: it
 * forgets whether `2.0` was a float and rounds integers past 2^53. This parser keeps both:
 * integers are `number` (safe) or `bigint`, floats with an integral value are
 * {@link PyFloat}, other floats are `number`; objects have no prototype. It accepts what
 * Python's `json.loads` accepts (`NaN`, `Infinity`, duplicate keys: the last wins).
 */

/** A float whose value is integral (`2.0`, `1e3`): kept apart from the integer `2`. */
export class PyFloat {
  constructor(readonly value: number) {}
}

export type JsonValue =
  | null
  | boolean
  | number
  | bigint
  | PyFloat
  | string
  | JsonValue[]
  | { [key: string]: JsonValue };

export type JsonObject = { [key: string]: JsonValue };

export class JsonSyntaxError extends Error {}

/** A new object with no prototype (keys such as `__proto__` are plain keys). */
export function newObject(): JsonObject {
  return Object.create(null) as JsonObject;
}

export function isObject(value: unknown): value is JsonObject {
  return (
    typeof value === "object" &&
    value !== null &&
    !Array.isArray(value) &&
    !(value instanceof PyFloat)
  );
}

/** The float value of a parsed number (integers and floats alike), else undefined. */
export function numeric(value: unknown): number | undefined {
  if (typeof value === "number") return value;
  if (value instanceof PyFloat) return value.value;
  if (typeof value === "bigint") return Number(value);
  return undefined;
}

/** Whether a parsed value is a Python int (not a float, not a bool). */
export function isInt(value: unknown): value is number | bigint {
  return (typeof value === "number" && Number.isInteger(value)) || typeof value === "bigint";
}

const NUMBER = /-?(?:0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?/y;
const WHITESPACE = /[ \t\n\r]*/y;

class Parser {
  private at = 0;
  constructor(private readonly text: string) {}

  parse(): JsonValue {
    this.skip();
    const value = this.value();
    this.skip();
    if (this.at !== this.text.length) this.fail("extra data");
    return value;
  }

  private fail(what: string): never {
    throw new JsonSyntaxError(`${what} at character ${this.at}`);
  }

  private skip(): void {
    WHITESPACE.lastIndex = this.at;
    WHITESPACE.exec(this.text);
    this.at = WHITESPACE.lastIndex;
  }

  private value(): JsonValue {
    const c = this.text[this.at];
    if (c === "{") return this.object();
    if (c === "[") return this.array();
    if (c === '"') return this.string();
    for (const [word, value] of WORDS) {
      if (this.text.startsWith(word, this.at)) {
        this.at += word.length;
        return value;
      }
    }
    return this.number();
  }

  private number(): JsonValue {
    NUMBER.lastIndex = this.at;
    const match = NUMBER.exec(this.text);
    if (match === null) this.fail("expecting value");
    this.at = NUMBER.lastIndex;
    const token = match[0];
    if (match[1] === undefined && match[2] === undefined) {
      const value = Number(token);
      return Number.isSafeInteger(value) ? (Object.is(value, -0) ? 0 : value) : BigInt(token);
    }
    const value = Number(token);
    return Number.isInteger(value) ? new PyFloat(value) : value;
  }

  private string(): string {
    this.at++;
    let out = "";
    for (;;) {
      const start = this.at;
      while (this.at < this.text.length) {
        const code = this.text.charCodeAt(this.at);
        if (code === 34 || code === 92 || code < 32) break;
        this.at++;
      }
      out += this.text.slice(start, this.at);
      const c = this.text[this.at];
      if (c === '"') {
        this.at++;
        return out;
      }
      if (c === undefined) this.fail("unterminated string");
      if (c !== "\\") this.fail("invalid control character");
      out += this.escape();
    }
  }

  private escape(): string {
    const c = this.text[this.at + 1];
    this.at += 2;
    const simple = ESCAPES[c ?? ""];
    if (simple !== undefined) return simple;
    if (c !== "u") this.fail("invalid \\escape");
    const digits = this.text.slice(this.at, this.at + 4);
    if (!/^[0-9a-fA-F]{4}$/.test(digits)) this.fail("invalid \\uXXXX escape");
    this.at += 4;
    return String.fromCharCode(parseInt(digits, 16));
  }

  private array(): JsonValue[] {
    this.at++;
    const out: JsonValue[] = [];
    this.skip();
    if (this.text[this.at] === "]") {
      this.at++;
      return out;
    }
    for (;;) {
      this.skip();
      out.push(this.value());
      this.skip();
      const c = this.text[this.at++];
      if (c === "]") return out;
      if (c !== ",") this.fail("expecting ',' delimiter");
    }
  }

  private object(): JsonObject {
    this.at++;
    const out = newObject();
    this.skip();
    if (this.text[this.at] === "}") {
      this.at++;
      return out;
    }
    for (;;) {
      this.skip();
      if (this.text[this.at] !== '"') this.fail("expecting property name enclosed in double quotes");
      const key = this.string();
      this.skip();
      if (this.text[this.at++] !== ":") this.fail("expecting ':' delimiter");
      this.skip();
      out[key] = this.value();
      this.skip();
      const c = this.text[this.at++];
      if (c === "}") return out;
      if (c !== ",") this.fail("expecting ',' delimiter");
    }
  }
}

const WORDS: [string, JsonValue][] = [
  ["null", null],
  ["true", true],
  ["false", false],
  ["NaN", Number.NaN],
  ["Infinity", Number.POSITIVE_INFINITY],
  ["-Infinity", Number.NEGATIVE_INFINITY],
];
const ESCAPES: Record<string, string> = {
  '"': '"',
  "\\": "\\",
  "/": "/",
  b: "\b",
  f: "\f",
  n: "\n",
  r: "\r",
  t: "\t",
};

/**
 * Parse JSON text as Python's `json.loads` does.
 *
 * @throws JsonSyntaxError naming where the text stops being JSON.
 */
export function parse(text: string): JsonValue {
  return new Parser(text).parse();
}

/** Python's `repr` of a float (shortest round-trip digits, its switch to exponent form). */
export function floatRepr(value: number): string {
  if (Number.isNaN(value)) return "NaN";
  if (!Number.isFinite(value)) return value > 0 ? "Infinity" : "-Infinity";
  if (value === 0) return Object.is(value, -0) ? "-0.0" : "0.0";
  const [mantissa, exp] = value.toExponential().split("e") as [string, string];
  const sign = mantissa.startsWith("-") ? "-" : "";
  const digits = mantissa.replace("-", "").replace(".", "");
  const exponent = Number(exp);
  if (exponent < -4 || exponent >= 16) {
    const head = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    const power = Math.abs(exponent).toString().padStart(2, "0");
    return `${sign}${head}e${exponent < 0 ? "-" : "+"}${power}`;
  }
  if (exponent < 0) return `${sign}0.${"0".repeat(-exponent - 1)}${digits}`;
  const whole = digits.slice(0, exponent + 1).padEnd(exponent + 1, "0");
  const fraction = digits.slice(exponent + 1);
  return `${sign}${whole}.${fraction || "0"}`;
}

/** A string as Python's `json.dumps` (with `ensure_ascii`) writes it. */
export function quote(text: string): string {
  let out = '"';
  for (let i = 0; i < text.length; i++) {
    const code = text.charCodeAt(i);
    if (code === 34) out += '\\"';
    else if (code === 92) out += "\\\\";
    else if (code >= 32 && code <= 126) out += text[i];
    else out += SHORT[code] ?? `\\u${code.toString(16).padStart(4, "0")}`;
  }
  return out + '"';
}

const SHORT: Record<number, string> = { 8: "\\b", 9: "\\t", 10: "\\n", 12: "\\f", 13: "\\r" };

/** Compare two strings by code point, as Python sorts `str`. */
export function compareCodePoints(a: string, b: string): number {
  let i = 0;
  let j = 0;
  while (i < a.length && j < b.length) {
    const x = a.codePointAt(i)!;
    const y = b.codePointAt(j)!;
    if (x !== y) return x < y ? -1 : 1;
    i += x > 0xffff ? 2 : 1;
    j += y > 0xffff ? 2 : 1;
  }
  return a.length - i === b.length - j ? 0 : a.length - i < b.length - j ? -1 : 1;
}

/**
 * The text Python's `json.dumps(value, sort_keys=True, separators=(",", ":"))` writes
 * (`sortKeys` false: keys in insertion order, as `json.dumps` without `sort_keys`).
 *
 * @throws TypeError for a value JSON cannot hold.
 */
export function dumps(value: JsonValue, sortKeys = true): string {
  if (value === null) return "null";
  if (value === true) return "true";
  if (value === false) return "false";
  if (typeof value === "string") return quote(value);
  if (typeof value === "bigint") return value.toString();
  if (value instanceof PyFloat) return floatRepr(value.value);
  if (typeof value === "number") {
    return Number.isInteger(value) ? (Object.is(value, -0) ? "0" : value.toFixed(0)) : floatRepr(value);
  }
  if (Array.isArray(value)) return `[${value.map((v) => dumps(v, sortKeys)).join(",")}]`;
  if (isObject(value)) {
    const keys = Object.keys(value);
    if (sortKeys) keys.sort(compareCodePoints);
    return `{${keys.map((k) => `${quote(k)}:${dumps(value[k]!, sortKeys)}`).join(",")}}`;
  }
  throw new TypeError(`not JSON: ${String(value)}`);
}

/** The canonical bytes a signature covers (`common.collection.canonical`). */
export function canonical(value: JsonValue): Uint8Array {
  return new TextEncoder().encode(dumps(value));
}

/**
 * Python's `==` between parsed JSON values: numbers by value (`2 == 2.0`, never a bool),
 * lists in order, objects by keys.
 */
export function pyEqual(a: JsonValue | undefined, b: JsonValue | undefined): boolean {
  if (a === b) return true;
  const x = numericOrBool(a);
  const y = numericOrBool(b);
  if (x !== undefined || y !== undefined) return x !== undefined && y !== undefined && x === y;
  if (Array.isArray(a) || Array.isArray(b)) {
    return Array.isArray(a) && Array.isArray(b) && a.length === b.length && a.every((v, i) => pyEqual(v, b[i]));
  }
  if (isObject(a) && isObject(b)) {
    const keys = Object.keys(a);
    return keys.length === Object.keys(b).length && keys.every((k) => k in b && pyEqual(a[k], b[k]));
  }
  return false;
}

function numericOrBool(value: JsonValue | undefined): number | bigint | undefined {
  if (typeof value === "boolean") return value ? 1 : 0;
  if (typeof value === "bigint") return Number.isSafeInteger(Number(value)) ? Number(value) : value;
  return numeric(value);
}

/** A plain JS value as a JSON value (numbers as they are; no undefined, functions or maps). */
export function fromPlain(value: unknown): JsonValue {
  if (value === null || typeof value === "boolean" || typeof value === "string") return value;
  if (typeof value === "number" || typeof value === "bigint" || value instanceof PyFloat) return value;
  if (Array.isArray(value)) return value.map(fromPlain);
  if (typeof value === "object") {
    const out = newObject();
    for (const [k, v] of Object.entries(value as Record<string, unknown>)) {
      if (v !== undefined) out[k] = fromPlain(v);
    }
    return out;
  }
  throw new TypeError(`not JSON: ${String(value)}`);
}
