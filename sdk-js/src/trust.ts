/**
 * Who vouches for what a device uses (docs/architecture.md, "Who vouches for what").
 *
 * The analyzer signs the collection config; each shuffler signs its own descriptor, which the
 * config carries unchanged, so the analyzer cannot change a shuffler's URL or keys. A device
 * pins one key per party ({@link TrustAnchors}); {@link verifyCollection} accepts a config only
 * when every listed shuffler is pinned and vouched for, nothing has expired, and (with
 * `everyShuffler`) no pinned shuffler is left out; {@link checkRollback} and
 * {@link checkMoved} refuse what rolls back what the device accepted before. Keys rotate by
 * successions (the old key names the next). Formats: docs/protocol-notes.md, "Signed
 * documents". The same checks, in the same order, as the Python SDK.
 */

import { b64decode, b64encode, concat, equalBytes, hex, utf8 } from "./bytes.js";
import { sha256, verifyEd25519 } from "./crypto.js";
import { TrustedKeyError } from "./errors.js";
import { ValidationError } from "./lax.js";
import { canonical, isObject, parse, type JsonObject, type JsonValue } from "./pyjson.js";
import {
  MAX_SUCCESSIONS,
  collectionConfig,
  shufflerDescriptor,
  succession,
  successionStatement,
  type CollectionConfig,
  type ShufflerDescriptor,
  type ShufflerInfo,
  type SignedDescriptor,
  type Succession,
} from "./wire.js";

export const DESCRIPTOR_CONTEXT = utf8("esa/2 shuffler descriptor\n");
export const SUCCESSION_CONTEXT = utf8("esa/1 key succession\n");
export const ANALYZER_PARTY = "analyzer";
/** How far in the future a document's issue time is believed (clocks differ). */
export const MAX_CLOCK_SKEW_SECONDS = 300;
export const CONFIG = "config";

/** A config or descriptor that is unsigned, mis-signed, tampered, expired, rolled back or malformed. */
export class CollectionConfigError extends Error {}

export function shufflerParty(shufflerId: string): string {
  return `shuffler/${shufflerId}`;
}

/** A pinned Ed25519 key: its raw bytes and standard base64. */
export interface PinnedKey {
  raw: Uint8Array;
  b64: string;
}

/**
 * An Ed25519 public key from its standard base64 (surrounding whitespace ignored).
 *
 * @throws Error naming `what` and why it is not such a key.
 */
export function parseKey(text: unknown, what: string): PinnedKey {
  if (typeof text !== "string") throw new Error(`the ${what} key must be base64 text, not ${typeof text}`);
  let raw: Uint8Array;
  try {
    raw = b64decode(text.trim());
  } catch (error) {
    throw new Error(`the ${what} key is not a base64 Ed25519 public key: ${(error as Error).message}`);
  }
  if (raw.length !== 32) throw new Error(`the ${what} key is not a base64 Ed25519 public key: ${raw.length} bytes, not 32`);
  return { raw, b64: b64encode(raw) };
}

/** A short name of a key: the first 8 bytes of SHA-256 of its raw bytes, in hex. */
export async function fingerprint(key: PinnedKey): Promise<string> {
  return hex((await sha256(key.raw)).slice(0, 8));
}

/** The keys a device pins, one per trust domain (`var/trust.json`, written by `esa up`). */
export class TrustAnchors {
  constructor(
    readonly analyzer: PinnedKey,
    readonly shufflers: ReadonlyMap<string, PinnedKey>,
  ) {}

  /**
   * `{"analyzer": base64, "shufflers": {id: base64, ...}}`, as an object or its JSON text.
   *
   * @throws TrustedKeyError naming what is missing or not an Ed25519 key.
   */
  static from(data: unknown): TrustAnchors {
    let value = data;
    if (typeof data === "string") {
      try {
        value = parse(data);
      } catch (error) {
        throw new TrustedKeyError(`the trust file is not JSON: ${(error as Error).message}`);
      }
    }
    const object = value as { analyzer?: unknown; shufflers?: unknown } | null;
    if (typeof object !== "object" || object === null || typeof object.shufflers !== "object" || object.shufflers === null) {
      throw new TrustedKeyError('trust anchors must be {"analyzer": key, "shufflers": {id: key}}');
    }
    try {
      const shufflers = new Map(
        Object.entries(object.shufflers as Record<string, unknown>).map(([k, v]) => [k, parseKey(v, `shuffler '${k}'`)]),
      );
      if (shufflers.size === 0) throw new Error("trust anchors pin no shuffler key");
      return new TrustAnchors(parseKey(object.analyzer, "analyzer"), shufflers);
    } catch (error) {
      if (error instanceof TrustedKeyError) throw error;
      throw new TrustedKeyError((error as Error).message);
    }
  }

  /** The pinned keys (base64) by party. */
  roots(): Map<string, string> {
    const found = new Map([[ANALYZER_PARTY, this.analyzer.b64]]);
    for (const [id, key] of this.shufflers) found.set(shufflerParty(id), key.b64);
    return found;
  }
}

/** A verified document and its signer's lineage (pinned key first, signer last). */
interface Vouched<T> {
  value: T;
  lineage: PinnedKey[];
}

function signature(text: unknown, what: string): Uint8Array {
  if (typeof text !== "string") throw new CollectionConfigError(`${what} is not signed (missing signature)`);
  try {
    return b64decode(text);
  } catch {
    throw new CollectionConfigError(`${what} signature is not base64`);
  }
}

/** The keys a chain of successions names, in order, after checking its shape. */
function chainKeys(successions: Succession[], party: string, pinned: PinnedKey): PinnedKey[] {
  if (successions.length > MAX_SUCCESSIONS) {
    throw new CollectionConfigError(`${successions.length} key successions for ${party}: at most ${MAX_SUCCESSIONS}`);
  }
  if (successions.length === 0) return [pinned];
  let keys: PinnedKey[];
  try {
    keys = [parseKey(successions[0]!.from_key, `${party} succession 0`)];
    successions.forEach((link, index) => {
      if (link.party !== party) throw new Error(`succession ${index} speaks for ${link.party}`);
      const before = successions[index - 1];
      if (before !== undefined && link.from_key !== before.to_key) throw new Error(`succession ${index} does not start where ${index - 1} ended`);
      if (before !== undefined && link.issued_at < before.issued_at) throw new Error(`succession ${index} is issued before ${index - 1}`);
      keys.push(parseKey(link.to_key, `${party} succession ${index}`));
    });
  } catch (error) {
    throw new CollectionConfigError(`key successions of ${party}: ${(error as Error).message}`);
  }
  if (new Set(keys.map((k) => k.b64)).size !== keys.length) {
    throw new CollectionConfigError(`key successions of ${party} name a key twice`);
  }
  return keys;
}

/**
 * The keys from `pinned` to the party's newest: one unbroken, cycle-free chain for `party`,
 * every link from `pinned` on signed by its `from_key`; a chain that does not pass through
 * `pinned` is refused (a fork made later with an older key).
 */
export async function followSuccessions(successions: Succession[], party: string, pinned: PinnedKey): Promise<PinnedKey[]> {
  const keys = chainKeys(successions, party, pinned);
  const start = keys.findIndex((key) => equalBytes(key.raw, pinned.raw));
  if (start < 0) {
    throw new CollectionConfigError(
      `the signing keys of ${party} do not descend from the key pinned for it (${await fingerprint(pinned)}): re-pinned elsewhere, or a fork from an older key`,
    );
  }
  for (let index = start; index < successions.length; index++) {
    const link = successions[index]!;
    const raw = signature(link.signature, `key succession ${index} of ${party}`);
    const message = concat(SUCCESSION_CONTEXT, canonical(successionStatement(link)));
    if (!(await verifyEd25519(keys[index]!.raw, raw, message))) {
      throw new CollectionConfigError(`key succession ${index} of ${party} is not signed by the key it hands over from (forged or tampered)`);
    }
  }
  return keys.slice(start);
}

function successionsOf(data: JsonValue | undefined, what: string): Succession[] {
  if (!Array.isArray(data)) throw new CollectionConfigError(`${what}: successions must be a list`);
  if (data.length > MAX_SUCCESSIONS) throw new CollectionConfigError(`${what}: ${data.length} key successions, at most ${MAX_SUCCESSIONS}`);
  try {
    return data.map((item, i) => succession(item, `successions[${i}]`));
  } catch (error) {
    throw new CollectionConfigError(`${what}: a malformed key succession: ${(error as Error).message}`);
  }
}

function checkValidity(what: string, issuedAt: number, expiresAt: number, now: number): void {
  if (now > expiresAt) throw new CollectionConfigError(`${what} expired at ${expiresAt}`);
  if (expiresAt < issuedAt) throw new CollectionConfigError(`${what} expires (${expiresAt}) before it is issued`);
}

/** The config inside a signed document, if the analyzer's key (or one it handed over to) signed it and it has not expired. */
export async function verifyConfigChain(document: JsonObject, key: PinnedKey, now: number): Promise<Vouched<CollectionConfig>> {
  const config = document["config"];
  if (!isObject(config)) throw new CollectionConfigError("collection config is not signed (missing config)");
  const raw = signature(document["signature"], "collection config");
  const successions = successionsOf("successions" in document ? document["successions"] : [], "collection config");
  const lineage = await followSuccessions(successions, ANALYZER_PARTY, key);
  if (!(await verifyEd25519(lineage[lineage.length - 1]!.raw, raw, canonical(config)))) {
    throw new CollectionConfigError("collection config signature does not verify (wrong key or tampered)");
  }
  let parsed: CollectionConfig;
  try {
    parsed = collectionConfig(config);
  } catch (error) {
    if (!(error instanceof ValidationError)) throw error;
    throw new CollectionConfigError(`collection config is malformed: ${error.message}`);
  }
  checkValidity("collection config", parsed.issued_at, parsed.expires_at, now);
  return { value: parsed, lineage };
}

/** The shuffler id a descriptor names (unverified: only to find the key to check it with). */
function descriptorId(document: SignedDescriptor): string {
  const named = document.descriptor["id"];
  if (typeof named !== "string") throw new CollectionConfigError("shuffler descriptor names no shuffler id");
  return named;
}

/** The descriptor inside a signed document, if the key pinned for its shuffler (or one it handed over to) signed it, it names that signer and it is valid at `now`. */
export async function verifyDescriptorChain(document: SignedDescriptor, key: PinnedKey, now: number): Promise<Vouched<ShufflerDescriptor>> {
  const named = descriptorId(document);
  const name = `'${named.slice(0, 64)}'`;
  const lineage = await followSuccessions(document.successions, shufflerParty(named), key);
  const signer = lineage[lineage.length - 1]!;
  const raw = signature(document.signature, `descriptor of shuffler ${name}`);
  if (!(await verifyEd25519(signer.raw, raw, concat(DESCRIPTOR_CONTEXT, canonical(document.descriptor))))) {
    throw new CollectionConfigError(`descriptor of shuffler ${name} is not signed by the key pinned for it (another party's key, or tampered)`);
  }
  let descriptor: ShufflerDescriptor;
  try {
    descriptor = shufflerDescriptor(document.descriptor, "descriptor");
  } catch (error) {
    if (!(error instanceof ValidationError)) throw error;
    throw new CollectionConfigError(`descriptor of shuffler ${name} is malformed: ${error.message}`);
  }
  if (descriptor.signing_key !== signer.b64) throw new CollectionConfigError(`descriptor of shuffler ${name} names another signing key`);
  checkValidity(`descriptor of shuffler ${name}`, descriptor.issued_at, descriptor.expires_at, now);
  return { value: descriptor, lineage };
}

/** A collection config whose every part was vouched for by the party it speaks for. */
export interface VerifiedConfig {
  config: CollectionConfig;
  /** The shufflers it lists as their own descriptors describe them, in the config's order. */
  shufflers: ShufflerInfo[];
  /** `issued_at` of the config and each descriptor, by document and pinned key (rollback check). */
  versions: Map<string, number>;
  /** When the first of them expires. */
  expiresAt: number;
  /** Per party, the keys (base64) from the pinned one to its document's signer. */
  lineage: Map<string, string[]>;
}

/** Per party, the key its document was signed with: where a device's pin moves to. */
export function pinsOf(config: VerifiedConfig): Map<string, string> {
  return new Map([...config.lineage].map(([party, keys]) => [party, keys[keys.length - 1]!]));
}

async function descriptors(documents: SignedDescriptor[], trust: TrustAnchors, now: number): Promise<Vouched<ShufflerDescriptor>[]> {
  if (documents.length === 0) throw new CollectionConfigError("the collection config lists no shuffler to report to");
  const found: Vouched<ShufflerDescriptor>[] = [];
  for (const document of documents) {
    const named = descriptorId(document);
    const key = trust.shufflers.get(named);
    if (key === undefined) {
      throw new CollectionConfigError(
        `the collection config lists shuffler '${named.slice(0, 64)}', whose key this device does not pin (pinned: ${[...trust.shufflers.keys()].sort().join(", ")})`,
      );
    }
    found.push(await verifyDescriptorChain(document, key, now));
  }
  const ids = found.map((d) => d.value.id);
  if (new Set(ids).size !== ids.length) throw new CollectionConfigError(`the collection config lists a shuffler twice: ${ids.join(", ")}`);
  return found;
}

/**
 * Verify the analyzer's config and every shuffler descriptor it carries against the pinned
 * keys; with `everyShuffler`, refuse a config that leaves out a pinned shuffler (the analyzer
 * would otherwise choose which shufflers see every report).
 *
 * @throws CollectionConfigError naming the document and what is wrong.
 */
export async function verifyCollection(document: JsonValue, trust: TrustAnchors, now: number, everyShuffler = true): Promise<VerifiedConfig> {
  if (!isObject(document)) throw new CollectionConfigError(`not a JSON object but ${Array.isArray(document) ? "a list" : typeof document}`);
  const vouched = await verifyConfigChain(document, trust.analyzer, now);
  const config = vouched.value;
  const chains = await descriptors(config.shufflers, trust, now);
  const listed = new Set(chains.map((c) => c.value.id));
  const leftOut = [...trust.shufflers.keys()].filter((id) => !listed.has(id)).sort();
  if (everyShuffler && leftOut.length > 0) {
    throw new CollectionConfigError(
      `the collection config leaves out ${leftOut.join(", ")}, pinned by this device: it would send every report to the shufflers it names`,
    );
  }
  const versions = new Map([[`${CONFIG}/${await fingerprint(trust.analyzer)}`, config.issued_at]]);
  for (const { value } of chains) {
    versions.set(`shuffler/${value.id}/${await fingerprint(trust.shufflers.get(value.id)!)}`, value.issued_at);
  }
  const lineage = new Map([[ANALYZER_PARTY, vouched.lineage.map((k) => k.b64)]]);
  for (const chain of chains) lineage.set(shufflerParty(chain.value.id), chain.lineage.map((k) => k.b64));
  const shufflers = chains.map(({ value }) => ({
    id: value.id,
    url: value.url,
    public_key: value.keys[0]!.public_key,
    key_id: value.keys[0]!.key_id,
    signing_key: value.signing_key,
  }));
  const expiresAt = Math.min(config.expires_at, ...chains.map((c) => c.value.expires_at));
  return { config, shufflers, versions, expiresAt, lineage };
}

/** The issue times a device remembers: none later than now plus the clock skew. */
export function believed(versions: ReadonlyMap<string, number>, now: number): Map<string, number> {
  const latest = Math.trunc(now) + MAX_CLOCK_SKEW_SECONDS;
  return new Map([...versions].map(([name, issued]) => [name, Math.min(issued, latest)]));
}

/** Refuse documents older than ones already accepted (a replay). */
export function checkRollback(versions: ReadonlyMap<string, number>, seen: ReadonlyMap<string, number>): void {
  for (const [name, issued] of versions) {
    const before = seen.get(name);
    if (before !== undefined && issued < before) {
      const [kind, rest] = [name.split("/")[0], name.split("/")[1]];
      const what = kind === CONFIG ? "collection config" : `descriptor of shuffler '${rest}'`;
      throw new CollectionConfigError(
        `${what} issued at ${issued} is older than one this device accepted (issued at ${before}): a replayed old document`,
      );
    }
  }
}

/** Refuse a config whose signers do not descend from the keys a device moved its pins to. */
export function checkMoved(config: VerifiedConfig, moved: ReadonlyMap<string, string>): void {
  for (const [party, pin] of moved) {
    const keys = config.lineage.get(party);
    if (keys !== undefined && !keys.includes(pin)) {
      throw new CollectionConfigError(
        `the signing keys of ${party} do not descend from the key this device moved its pin to: a fork from an older key`,
      );
    }
  }
}
