/**
 * Randomness that protects users: `crypto.getRandomValues` only (the platform's CSPRNG).
 *
 * Encoders draw through {@link RandomSource}, the two draws the Python encoders make
 * (`random()` and `randbelow(n)`), in the same order, so a recording of one side's draws
 * replays on the other (the shared vectors check encoders that way). Tests may pass another
 * source; the SDK never does.
 */

export interface RandomSource {
  /** A uniform float in [0, 1) with 53 random bits. */
  random(): number;
  /** A uniform integer in [0, upper), `upper` a positive safe integer (no modulo bias). */
  randbelow(upper: number): number;
}

const POOL_WORDS = 256;

/** The platform CSPRNG (`crypto.getRandomValues`), read 1 KiB at a time. */
export class SystemSource implements RandomSource {
  private pool = new Uint32Array(POOL_WORDS);
  private next = POOL_WORDS;

  private word(): number {
    if (this.next === POOL_WORDS) {
      globalThis.crypto.getRandomValues(this.pool);
      this.next = 0;
    }
    return this.pool[this.next++]!;
  }

  random(): number {
    const high = this.word() >>> 5; // 27 bits
    const low = this.word() >>> 6; // 26 bits
    return (high * 67108864 + low) / 9007199254740992;
  }

  randbelow(upper: number): number {
    if (!Number.isSafeInteger(upper) || upper < 1) throw new RangeError(`randbelow needs a positive safe integer, got ${upper}`);
    if (upper <= 0x100000000) {
      // Lemire-style rejection on 32-bit words: accept words below the largest multiple.
      const limit = 0x100000000 - (0x100000000 % upper);
      for (;;) {
        const w = this.word();
        if (w < limit) return w % upper;
      }
    }
    const bits = Math.ceil(Math.log2(upper));
    for (;;) {
      const candidate = Math.floor(this.random() * 2 ** bits);
      if (candidate < upper) return candidate;
    }
  }
}

/** Fresh random bytes from the platform CSPRNG. */
export function randomBytes(size: number): Uint8Array {
  const out = new Uint8Array(size);
  globalThis.crypto.getRandomValues(out);
  return out;
}

export function bernoulli(rng: RandomSource, p: number): boolean {
  return rng.random() < p;
}

/**
 * Positions in [0, length) each selected independently with probability `p`, in order, by
 * geometric skips (cost proportional to the positions selected, not to `length`).
 */
export function* geometricPositions(rng: RandomSource, length: number, p: number): Generator<number> {
  if (p <= 0 || length <= 0) return;
  if (p >= 1) {
    for (let i = 0; i < length; i++) yield i;
    return;
  }
  const logKeep = Math.log1p(-p);
  let position = -1;
  for (;;) {
    const u = 1 - rng.random();
    position += 1 + Math.trunc(Math.log(u) / logKeep);
    if (position >= length) return;
    yield position;
  }
}

/**
 * The 1-bits of binary randomized response (flip probability `flip`) of the one-hot vector of
 * `value` over `k` bits: the true bit kept w.p. 1 - flip, each other bit set w.p. flip
 * (ESA-revisited Algorithm 1). Sorted, so the order reveals nothing.
 */
export function randomizedOnehot(rng: RandomSource, value: number, k: number, flip: number): number[] {
  const ones: number[] = [];
  for (const pos of geometricPositions(rng, k - 1, flip)) ones.push(pos < value ? pos : pos + 1);
  if (!bernoulli(rng, flip)) ones.push(value);
  return ones.sort((a, b) => a - b);
}
