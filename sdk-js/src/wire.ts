/**
 * What crosses the wire: the signed documents a device reads (validated as the Python models
 * of docs/protocol-notes.md, "Signed documents", validate them) and the byte layouts it
 * writes (docs/protocol-notes.md, "Sealed envelopes").
 */

import { concat, hasLoneSurrogate, uintBE, utf8 } from "./bytes.js";
import {
  ValidationError,
  field,
  float,
  int,
  list,
  noExtra,
  nullable,
  obj,
  required,
  str,
} from "./lax.js";
import { PyFloat, newObject, type JsonObject, type JsonValue } from "./pyjson.js";

export const IDENTIFIER = /^[a-z0-9][a-z0-9_.-]{0,63}$/;
export const CROWD = /^(?:[a-z0-9][a-z0-9_.-]{0,63})?$/;
export const PARTY = /^(?:analyzer|shuffler\/[a-z0-9][a-z0-9_.-]{0,63})$/;
export const MAX_INT = 2 ** 53 - 1;
export const MAX_CROWDS = 64;
export const MAX_EPOCH_SECONDS = 366 * 86_400;
export const MAX_SUCCESSIONS = 32;

/** A device's local-ε budget (enforced by the SDK, basic composition of replacement ε). */
export interface DeviceBudget {
  lifetime_eps: number | null;
  window_eps: number | null;
  window_seconds: number | null;
}

/** The fields of a channel that are its privacy terms (what a device pins, `terms.ts`). */
export interface ChannelPrivacyFields {
  id: string;
  epoch_seconds: number;
  min_crowd: number;
  eps_cr: number;
  delta_cr: number;
  max_fragments: number;
  min_fragments: number;
  payload_size: number;
  crowds: string[];
  retired_from_epoch: number | null;
  mechanism: string;
  params: JsonObject;
  delta: number;
  budget: DeviceBudget | null;
}

/** A channel as the analyzer configures it and devices fetch it. */
export interface ChannelConfig extends ChannelPrivacyFields {
  display: "histogram" | "image" | "series";
  image_shape: [number, number] | null;
  title: string;
}

export interface HpkeKey {
  key_id: string;
  public_key: string;
}

export interface AnalyzerInfo {
  url: string;
  keys: HpkeKey[];
  signing_key: string;
}

/** A signing key handing over to the next one (rotation without re-pinning). */
export interface Succession {
  party: string;
  from_key: string;
  to_key: string;
  issued_at: number;
  signature: string;
}

/** A shuffler's own signed descriptor, as the config carries it. */
export interface SignedDescriptor {
  descriptor: JsonObject;
  signature: string;
  successions: Succession[];
}

/** What a shuffler vouches for about itself. */
export interface ShufflerDescriptor {
  version: 1;
  id: string;
  url: string;
  keys: HpkeKey[];
  signing_key: string;
  issued_at: number;
  expires_at: number;
}

/** What a device needs to report, signed by the analyzer. */
export interface CollectionConfig {
  version: 2;
  revision: number;
  issued_at: number;
  expires_at: number;
  analyzer: AnalyzerInfo;
  shufflers: SignedDescriptor[];
  channels: ChannelConfig[];
  device_budget: DeviceBudget | null;
}

/** A shuffler as a device sends to it (its current key). */
export interface ShufflerInfo {
  id: string;
  url: string;
  public_key: string;
  key_id: string;
  signing_key: string;
}

const time = (value: JsonValue, path: string): number => int(value, path, { ge: 0, le: MAX_INT });

export function deviceBudget(value: JsonValue, path: string): DeviceBudget {
  const o = obj(value, path);
  noExtra(o, ["lifetime_eps", "window_eps", "window_seconds"], path);
  const budget = {
    lifetime_eps: field(o, "lifetime_eps", nullable((v, p) => float(v, p, { gt: 0 })), null, path),
    window_eps: field(o, "window_eps", nullable((v, p) => float(v, p, { gt: 0 })), null, path),
    window_seconds: field(o, "window_seconds", nullable((v, p) => int(v, p, { ge: 1 })), null, path),
  };
  if ((budget.window_eps === null) !== (budget.window_seconds === null)) {
    throw new ValidationError(`${path}: window_eps and window_seconds go together`);
  }
  if (budget.lifetime_eps === null && budget.window_eps === null) {
    throw new ValidationError(`${path}: a budget needs lifetime_eps, or window_eps with window_seconds`);
  }
  return budget;
}

function crowds(value: JsonValue, path: string): string[] {
  const found = list(value, path, 1, MAX_CROWDS).map((c, i) => str(c, `${path}[${i}]`));
  for (const crowd of found) {
    if (!CROWD.test(crowd)) throw new ValidationError(`${path}: crowd ids must match ${CROWD.source}`);
  }
  if (new Set(found).size !== found.length) throw new ValidationError(`${path}: crowd ids must be distinct`);
  return found;
}

const POLICY_FIELDS = [
  "id", "epoch_seconds", "min_crowd", "eps_cr", "delta_cr", "max_fragments", "min_fragments",
  "payload_size", "crowds", "retired_from_epoch",
] as const;
const CHANNEL_FIELDS = [
  ...POLICY_FIELDS, "mechanism", "params", "delta", "display", "budget", "image_shape", "title",
];

/** A channel of a signed config (`extra="forbid"`; a `max_batch` key is dropped). */
export function channelConfig(value: JsonValue, path: string): ChannelConfig {
  const o = obj(value, path);
  noExtra(o, [...CHANNEL_FIELDS, "max_batch"], path);
  const channel: ChannelConfig = {
    id: field(o, "id", (v, p) => str(v, p, { pattern: IDENTIFIER }), required(path, "id"), path),
    epoch_seconds: field(o, "epoch_seconds", (v, p) => int(v, p, { ge: 1, le: MAX_EPOCH_SECONDS }), 3600, path),
    min_crowd: field(o, "min_crowd", (v, p) => int(v, p, { ge: 1 }), 100, path),
    eps_cr: field(o, "eps_cr", (v, p) => float(v, p, { gt: 0 }), 0.5, path),
    delta_cr: field(o, "delta_cr", (v, p) => float(v, p, { gt: 0, lt: 1 }), 1e-9, path),
    max_fragments: field(o, "max_fragments", (v, p) => int(v, p, { ge: 1, le: 65535 }), 64, path),
    min_fragments: field(o, "min_fragments", (v, p) => int(v, p, { ge: 0, le: 65535 }), 0, path),
    payload_size: field(o, "payload_size", (v, p) => int(v, p, { ge: 8, le: 1024 }), 16, path),
    crowds: field(o, "crowds", crowds, [""], path),
    retired_from_epoch: field(o, "retired_from_epoch", nullable((v, p) => int(v, p, { ge: 0, le: MAX_INT })), null, path),
    mechanism: field(o, "mechanism", (v, p) => str(v, p, { pattern: IDENTIFIER }), required(path, "mechanism"), path),
    params: field(o, "params", obj, required(path, "params"), path),
    delta: field(o, "delta", (v, p) => float(v, p, { gt: 0, lt: 1 }), 1e-9, path),
    display: field(o, "display", display, "histogram", path),
    budget: field(o, "budget", nullable(deviceBudget), null, path),
    image_shape: field(o, "image_shape", nullable(imageShape), null, path),
    title: field(o, "title", (v, p) => str(v, p, { max: 200 }), "", path),
  };
  if (channel.min_fragments > channel.max_fragments) {
    throw new ValidationError(`${path}: min_fragments=${channel.min_fragments} is above max_fragments=${channel.max_fragments}`);
  }
  return channel;
}

function display(value: JsonValue, path: string): ChannelConfig["display"] {
  if (value === "histogram" || value === "image" || value === "series") return value;
  throw new ValidationError(`${path}: must be 'histogram', 'image' or 'series'`);
}

function imageShape(value: JsonValue, path: string): [number, number] {
  const items = list(value, path, 2, 2);
  return [int(items[0], `${path}[0]`), int(items[1], `${path}[1]`)];
}

function hpkeKey(value: JsonValue, path: string): HpkeKey {
  const o = obj(value, path);
  return {
    key_id: field(o, "key_id", (v, p) => str(v, p, { pattern: /^[0-9a-f]{16}$/ }), required(path, "key_id"), path),
    public_key: field(o, "public_key", str, required(path, "public_key"), path),
  };
}

function hpkeKeys(min: number, max: number) {
  return (value: JsonValue, path: string): HpkeKey[] =>
    list(value, path, min, max).map((k, i) => hpkeKey(k, `${path}[${i}]`));
}

/** A key succession (`extra="forbid"`). */
export function succession(value: JsonValue, path: string): Succession {
  const o = obj(value, path);
  noExtra(o, ["party", "from_key", "to_key", "issued_at", "signature"], path);
  return {
    party: field(o, "party", (v, p) => str(v, p, { pattern: PARTY }), required(path, "party"), path),
    from_key: field(o, "from_key", (v, p) => str(v, p, { max: 64 }), required(path, "from_key"), path),
    to_key: field(o, "to_key", (v, p) => str(v, p, { max: 64 }), required(path, "to_key"), path),
    issued_at: field(o, "issued_at", time, required(path, "issued_at"), path),
    signature: field(o, "signature", (v, p) => str(v, p, { max: 128 }), required(path, "signature"), path),
  };
}

/** The canonical statement a succession's old key signs: everything but the signature. */
export function successionStatement(link: Succession): JsonObject {
  const out = newObject();
  out["party"] = link.party;
  out["from_key"] = link.from_key;
  out["to_key"] = link.to_key;
  out["issued_at"] = link.issued_at;
  return out;
}

function successions(value: JsonValue, path: string): Succession[] {
  return list(value, path, 0, MAX_SUCCESSIONS).map((s, i) => succession(s, `${path}[${i}]`));
}

function signedDescriptor(value: JsonValue, path: string): SignedDescriptor {
  const o = obj(value, path);
  noExtra(o, ["descriptor", "signature", "successions"], path);
  return {
    descriptor: field(o, "descriptor", obj, required(path, "descriptor"), path),
    signature: field(o, "signature", str, required(path, "signature"), path),
    successions: field(o, "successions", successions, [], path),
  };
}

/** A shuffler's descriptor (`extra="forbid"`). */
export function shufflerDescriptor(value: JsonValue, path: string): ShufflerDescriptor {
  const o = obj(value, path);
  noExtra(o, ["version", "id", "url", "keys", "signing_key", "issued_at", "expires_at"], path);
  field(o, "version", (v, p) => literal(v, p, 1), 1, path);
  return {
    version: 1,
    id: field(o, "id", (v, p) => str(v, p, { pattern: IDENTIFIER }), required(path, "id"), path),
    url: field(o, "url", (v, p) => str(v, p, { min: 1, max: 2048 }), required(path, "url"), path),
    keys: field(o, "keys", hpkeKeys(1, 8), required(path, "keys"), path),
    signing_key: field(o, "signing_key", str, required(path, "signing_key"), path),
    issued_at: field(o, "issued_at", time, required(path, "issued_at"), path),
    expires_at: field(o, "expires_at", time, required(path, "expires_at"), path),
  };
}

function literal(value: JsonValue, path: string, expected: number): number {
  const found = typeof value === "number" ? value : value instanceof PyFloat ? value.value : undefined;
  if (found === expected) return expected;
  throw new ValidationError(`${path}: must be ${expected}`);
}

function analyzerInfo(value: JsonValue, path: string): AnalyzerInfo {
  const o = obj(value, path);
  return {
    url: field(o, "url", str, required(path, "url"), path),
    keys: field(o, "keys", hpkeKeys(1, Infinity), required(path, "keys"), path),
    signing_key: field(o, "signing_key", str, required(path, "signing_key"), path),
  };
}

/** The collection config inside a signed document (unknown keys ignored). */
export function collectionConfig(value: JsonValue, path = "config"): CollectionConfig {
  const o = obj(value, path);
  field(o, "version", (v, p) => literal(v, p, 2), 2, path);
  const list_ = <T>(read: (v: JsonValue, p: string) => T) => (v: JsonValue, p: string) =>
    list(v, p).map((item, i) => read(item, `${p}[${i}]`));
  return {
    version: 2,
    revision: field(o, "revision", (v, p) => int(v, p, { ge: 0, le: MAX_INT }), 0, path),
    issued_at: field(o, "issued_at", time, required(path, "issued_at"), path),
    expires_at: field(o, "expires_at", time, required(path, "expires_at"), path),
    analyzer: field(o, "analyzer", analyzerInfo, required(path, "analyzer"), path),
    shufflers: field(o, "shufflers", list_(signedDescriptor), required(path, "shufflers"), path),
    channels: field(o, "channels", list_(channelConfig), required(path, "channels"), path),
    device_budget: field(o, "device_budget", nullable(deviceBudget), null, path),
  };
}

/** Whether a channel takes contributions for `epoch` (not retired by then). */
export function takes(channel: ChannelConfig, epoch: number): boolean {
  return channel.retired_from_epoch === null || epoch < channel.retired_from_epoch;
}

// --- byte layouts ---------------------------------------------------------------------------

export const INNER_INFO = utf8("esa/2 inner ");
export const OUTER_INFO = utf8("esa/1 outer ");
export const MAGIC = utf8("ESA2");
export const KEY_ID_SIZE = 8;
export const ENC_SIZE = 32;
export const TAG_SIZE = 16;
export const NONCE_SIZE = 16;

function shortString(text: string, what: string): Uint8Array {
  const raw = utf8(text);
  if (raw.length > 255 || hasLoneSurrogate(text)) throw new RangeError(`${what} must be <= 255 bytes of UTF-8`);
  return concat(new Uint8Array([raw.length]), raw);
}

function epochBytes(epoch: number): Uint8Array {
  if (!Number.isSafeInteger(epoch) || epoch < 0) throw new RangeError(`epoch out of range: ${epoch}`);
  return uintBE(epoch, 8);
}

/**
 * HPKE `info` binding a fragment to its channel, epoch and crowd:
 * `"esa/2 inner " | u8 len + channel | u64 epoch | u8 len + crowd`.
 *
 * @throws RangeError for an id over 255 bytes or an epoch that is not a safe non-negative integer.
 */
export function fragmentInfo(channel: string, epoch: number, crowd: string): Uint8Array {
  return concat(INNER_INFO, shortString(channel, "channel id"), epochBytes(epoch), shortString(crowd, "crowd id"));
}

/** HPKE `info` binding a contribution to its shuffler. */
export function outerInfo(shufflerId: string): Uint8Array {
  return concat(OUTER_INFO, utf8(shufflerId));
}

/**
 * `uint16 length | data | zeros` to exactly `size` bytes, so length never reveals the value.
 *
 * @throws RangeError if `data` does not fit.
 */
export function pad(data: Uint8Array, size: number): Uint8Array {
  if (data.length + 2 > size || size > 0xffff) {
    throw new RangeError(`${data.length} bytes do not fit a padded size of ${size}`);
  }
  const out = new Uint8Array(size);
  out.set(uintBE(data.length, 2), 0);
  out.set(data, 2);
  return out;
}

/** What a shuffler reads: routing metadata and sealed fragments it cannot open. */
export interface Contribution {
  channelId: string;
  crowdId: string;
  epoch: number;
  nonce: Uint8Array;
  fragments: Uint8Array[];
}

/**
 * The binary encoding: `"ESA2" | u8 len + channel | u8 len + crowd | u64 epoch | 16-byte
 * nonce | u16 count | (u16 len + fragment)*`.
 *
 * @throws RangeError for an id over 255 bytes, a nonce not 16 bytes, an epoch or count out of range.
 */
export function encodeContribution(c: Contribution): Uint8Array {
  if (c.nonce.length !== NONCE_SIZE) throw new RangeError("the nonce must be 16 bytes");
  if (c.fragments.length > 0xffff) throw new RangeError(`${c.fragments.length} fragments: at most 65535`);
  const parts = [MAGIC, shortString(c.channelId, "channel id"), shortString(c.crowdId, "crowd id")];
  parts.push(epochBytes(c.epoch), c.nonce, uintBE(c.fragments.length, 2));
  for (const fragment of c.fragments) {
    if (fragment.length > 0xffff) throw new RangeError("a fragment over 65535 bytes");
    parts.push(uintBE(fragment.length, 2), fragment);
  }
  return concat(...parts);
}

/** The inner plaintext frame of every mechanism: `version 1 | mechanism code | payload`. */
export const WIRE_VERSION = 1;

export function frame(code: number, payload: Uint8Array): Uint8Array {
  return concat(new Uint8Array([WIRE_VERSION, code]), payload);
}
