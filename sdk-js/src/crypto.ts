/**
 * The SDK's cryptography: Ed25519 signatures of the documents a device verifies, SHA-256, and
 * one-shot HPKE (RFC 9180) base mode in our suite, DHKEM(X25519, HKDF-SHA256), HKDF-SHA256,
 * AES-128-GCM (docs/protocol-notes.md, "Sealed envelopes"), through hpke-js.
 *
 * Ed25519 and X25519 run in the platform's WebCrypto where it has them (Node 20, current
 * browsers): native code, and no key material in JavaScript. Where it lacks them the same
 * operations run in audited JavaScript (`@noble/ed25519`, RFC 8032 verification with ZIP-215
 * off as OpenSSL does; `@hpke/dhkem-x25519`). Either way every random byte comes from
 * `crypto.getRandomValues` or WebCrypto's own key generation: docs/sdk-js.md, "Cryptography".
 */

import { Aes128Gcm, CipherSuite, DhkemX25519HkdfSha256 as NativeX25519, HkdfSha256 } from "@hpke/core";
import { DhkemX25519HkdfSha256 as NobleX25519 } from "@hpke/dhkem-x25519";
import * as noble from "@noble/ed25519";
import { concat, unhex } from "./bytes.js";
import { KEY_ID_SIZE } from "./wire.js";

export type Backend = "webcrypto" | "noble";

export interface Backends {
  ed25519: Backend;
  x25519: Backend;
}

/** A copy in a plain ArrayBuffer (what WebCrypto's typings ask for). */
function own(data: Uint8Array): ArrayBuffer {
  return data.slice().buffer as ArrayBuffer;
}

function subtle(): SubtleCrypto {
  const found = globalThis.crypto?.subtle;
  if (found === undefined) throw new Error("WebCrypto (crypto.subtle) is not available: a secure context is needed");
  return found;
}

/** RFC 8032 §7.1, test 1: the empty message signed by this public key. */
const PROBE_KEY = unhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a");
const PROBE_SIGNATURE = unhex(
  "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b",
);

async function webEd25519(): Promise<boolean> {
  try {
    const key = await subtle().importKey("raw", own(PROBE_KEY), { name: "Ed25519" }, false, ["verify"]);
    return await subtle().verify({ name: "Ed25519" }, key, own(PROBE_SIGNATURE), new ArrayBuffer(0));
  } catch {
    return false;
  }
}

async function webX25519(): Promise<boolean> {
  try {
    await subtle().generateKey({ name: "X25519" }, false, ["deriveBits"]);
    return true;
  } catch {
    return false;
  }
}

let detected: Promise<Backends> | undefined;

/** Which implementation runs each curve here (probed once). */
export function backends(): Promise<Backends> {
  detected ??= (async () => ({
    ed25519: (await webEd25519()) ? "webcrypto" : "noble",
    x25519: (await webX25519()) ? "webcrypto" : "noble",
  }))();
  return detected;
}

/** Force an implementation (tests compare both; never needed by an app). */
export function useBackends(chosen: Backends): void {
  detected = Promise.resolve(chosen);
  suites.clear();
}

/** Whether `signature` is a valid Ed25519 signature of `message` by the 32-byte `publicKey`. */
export async function verifyEd25519(publicKey: Uint8Array, signature: Uint8Array, message: Uint8Array): Promise<boolean> {
  if (publicKey.length !== 32 || signature.length !== 64) return false;
  if ((await backends()).ed25519 === "noble") {
    try {
      return await noble.verifyAsync(signature, message, publicKey, { zip215: false });
    } catch {
      return false;
    }
  }
  try {
    const key = await subtle().importKey("raw", own(publicKey), { name: "Ed25519" }, false, ["verify"]);
    return await subtle().verify({ name: "Ed25519" }, key, own(signature), own(message));
  } catch {
    return false;
  }
}

export async function sha256(data: Uint8Array): Promise<Uint8Array> {
  return new Uint8Array(await subtle().digest("SHA-256", own(data)));
}

/** A recipient's key id: the first 8 bytes of SHA-256 of its raw X25519 public key. */
export async function keyId(publicKey: Uint8Array): Promise<Uint8Array> {
  return (await sha256(publicKey)).slice(0, KEY_ID_SIZE);
}

const suites = new Map<Backend, CipherSuite>();

/** The HPKE suite of the wire, with the X25519 of `backend` (default: the platform's). */
export async function suite(backend?: Backend): Promise<CipherSuite> {
  const chosen = backend ?? (await backends()).x25519;
  let found = suites.get(chosen);
  if (found === undefined) {
    const kem = chosen === "webcrypto" ? new NativeX25519() : new NobleX25519();
    found = new CipherSuite({ kem, kdf: new HkdfSha256(), aead: new Aes128Gcm() });
    suites.set(chosen, found);
  }
  return found;
}

/** A recipient's HPKE public key, ready to seal to: the key itself and its id. */
export interface Recipient {
  raw: Uint8Array;
  id: Uint8Array;
  key: CryptoKey;
}

/**
 * A recipient from a raw 32-byte X25519 public key.
 *
 * @throws Error when it is not 32 bytes or not a usable key.
 */
export async function recipient(raw: Uint8Array): Promise<Recipient> {
  if (raw.length !== 32) throw new Error(`an X25519 public key is 32 bytes, got ${raw.length}`);
  const hpke = await suite();
  const key = await hpke.kem.deserializePublicKey(own(raw));
  return { raw, id: await keyId(raw), key };
}

/** HPKE base-mode one-shot seal, prefixed with the recipient's key id: `key id | enc | ct`. */
export async function seal(plaintext: Uint8Array, to: Recipient, info: Uint8Array): Promise<Uint8Array> {
  const hpke = await suite();
  const sealed = await hpke.seal({ recipientPublicKey: to.key, info: own(info) }, own(plaintext));
  return concat(to.id, new Uint8Array(sealed.enc), new Uint8Array(sealed.ct));
}

/**
 * Open a blob made by {@link seal} with a raw X25519 private key (tests, and tools that play
 * a recipient; a device never opens anything).
 *
 * @throws Error when it does not open.
 */
export async function open(blob: Uint8Array, privateKey: Uint8Array, info: Uint8Array): Promise<Uint8Array> {
  const hpke = await suite();
  const key = await hpke.kem.importKey("raw", own(privateKey), false);
  const enc = blob.slice(KEY_ID_SIZE, KEY_ID_SIZE + 32).buffer as ArrayBuffer;
  const ct = blob.slice(KEY_ID_SIZE + 32).buffer as ArrayBuffer;
  return new Uint8Array(await hpke.open({ recipientKey: key, enc, info: own(info) }, ct));
}
