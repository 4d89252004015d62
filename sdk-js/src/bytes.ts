/** Bytes: base64 (standard alphabet, as the wire carries keys and signatures), hex, UTF-8. */

const ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
const LOOKUP = new Int16Array(128).fill(-1);
for (let i = 0; i < ALPHABET.length; i++) LOOKUP[ALPHABET.charCodeAt(i)] = i;

/** Standard base64 with padding. */
export function b64encode(data: Uint8Array): string {
  let out = "";
  let i = 0;
  for (; i + 2 < data.length; i += 3) {
    const n = (data[i]! << 16) | (data[i + 1]! << 8) | data[i + 2]!;
    out += ALPHABET[n >> 18]! + ALPHABET[(n >> 12) & 63]! + ALPHABET[(n >> 6) & 63]! + ALPHABET[n & 63]!;
  }
  const rest = data.length - i;
  if (rest === 1) {
    const n = data[i]! << 16;
    out += ALPHABET[n >> 18]! + ALPHABET[(n >> 12) & 63]! + "==";
  } else if (rest === 2) {
    const n = (data[i]! << 16) | (data[i + 1]! << 8);
    out += ALPHABET[n >> 18]! + ALPHABET[(n >> 12) & 63]! + ALPHABET[(n >> 6) & 63]! + "=";
  }
  return out;
}

/**
 * Strict base64 (Python's `base64.b64decode(text, validate=True)`): only the standard
 * alphabet, correct padding, nothing after it.
 *
 * @throws Error naming what is wrong.
 */
export function b64decode(text: string): Uint8Array {
  if (text.length % 4 !== 0) throw new Error("base64 text whose length is not a multiple of 4");
  const pad = text.endsWith("==") ? 2 : text.endsWith("=") ? 1 : 0;
  const out = new Uint8Array((text.length / 4) * 3 - pad);
  let o = 0;
  for (let i = 0; i < text.length; i += 4) {
    let n = 0;
    for (let j = 0; j < 4; j++) {
      const c = text.charCodeAt(i + j);
      const last = i + 4 === text.length;
      if (c === 61 && last && j >= 4 - pad) {
        n <<= 6;
        continue;
      }
      const v = c < 128 ? LOOKUP[c]! : -1;
      if (v < 0) throw new Error(`not base64: character ${JSON.stringify(text[i + j])}`);
      n = (n << 6) | v;
    }
    if (o < out.length) out[o++] = (n >> 16) & 255;
    if (o < out.length) out[o++] = (n >> 8) & 255;
    if (o < out.length) out[o++] = n & 255;
  }
  return out;
}

/**
 * Lenient base64 (Python's `base64.b64decode(text)` without `validate`, as the SDK reads
 * HPKE keys): characters outside the alphabet are dropped before the padding is checked.
 *
 * @throws Error when what is left is not base64.
 */
export function b64decodeLenient(text: string): Uint8Array {
  return b64decode(text.replace(/[^A-Za-z0-9+/=]/g, ""));
}

export function hex(data: Uint8Array): string {
  let out = "";
  for (const byte of data) out += byte.toString(16).padStart(2, "0");
  return out;
}

export function unhex(text: string): Uint8Array {
  if (text.length % 2 !== 0 || /[^0-9a-fA-F]/.test(text)) throw new Error("not hex");
  const out = new Uint8Array(text.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(text.slice(2 * i, 2 * i + 2), 16);
  return out;
}

const ENCODER = new TextEncoder();

/** UTF-8 bytes of a string (lone surrogates become U+FFFD, as they never name a channel). */
export function utf8(text: string): Uint8Array {
  return ENCODER.encode(text);
}

/** Whether a string holds a lone surrogate (its UTF-8 encoding would not be exact). */
export function hasLoneSurrogate(text: string): boolean {
  return /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/.test(text);
}

export function concat(...parts: Uint8Array[]): Uint8Array {
  let size = 0;
  for (const part of parts) size += part.length;
  const out = new Uint8Array(size);
  let offset = 0;
  for (const part of parts) {
    out.set(part, offset);
    offset += part.length;
  }
  return out;
}

export function equalBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** A big-endian unsigned integer of `size` bytes (`value` a safe integer). */
export function uintBE(value: number, size: number): Uint8Array {
  const out = new Uint8Array(size);
  let rest = value;
  for (let i = size - 1; i >= 0; i--) {
    out[i] = rest % 256;
    rest = Math.floor(rest / 256);
  }
  return out;
}
