/**
 * The index-histogram mechanisms: k-RAPPOR with attribute fragments (ESA-revisited
 * Algorithm 1, §III), k-ary randomized response (Hiding Among the Clones §4.1) and
 * Balcer–Cheu's zero-sum histogram (Separating Local & Shuffled DP, Figures 1–2, Theorem 12).
 * Details: docs/mechanisms.md.
 */

import type { JsonObject } from "../pyjson.js";
import { bernoulli, randomizedOnehot, type RandomSource } from "../random.js";
import {
  IndexHistogram,
  ParamsError,
  checkBins,
  checkEps,
  indexFragment,
  kwargs,
  show,
  type LocalPrivacy,
} from "./base.js";

export interface KRapporParams {
  k: number;
  eps: number;
}

/** k-RAPPOR: binary RR on each bit of the one-hot vector, the 1-bits sent as fragments. */
export class KRappor extends IndexHistogram<KRapporParams> {
  readonly name = "krappor";
  readonly code = 1;

  parseParams(raw: JsonObject): KRapporParams {
    kwargs(raw, ["k", "eps"]);
    return { k: checkBins("k", raw["k"]), eps: checkEps("eps", raw["eps"]) };
  }

  sameParams(a: KRapporParams, b: KRapporParams): boolean {
    return a.k === b.k && a.eps === b.eps;
  }

  domainSize(params: KRapporParams): number {
    return params.k;
  }

  flipProb(params: KRapporParams): number {
    return 1 / (1 + Math.exp(params.eps));
  }

  encodeValue(params: KRapporParams, value: number, rng: RandomSource): Uint8Array[] {
    return randomizedOnehot(rng, value, params.k, this.flipProb(params)).map((i) => indexFragment(this.code, i));
  }

  /** Removal ε, replacement 2ε; every fragment is post-processing of the whole report. */
  localPrivacy(params: KRapporParams): LocalPrivacy {
    return { removal: params.eps, replacement: 2 * params.eps, eps_l_inf: params.eps, eps_l1: params.eps };
  }
}

export interface KRRParams {
  k: number;
  eps: number;
}

/** k-RR: the true value w.p. e^ε/(e^ε + k - 1), each other w.p. 1/(e^ε + k - 1). */
export class KRR extends IndexHistogram<KRRParams> {
  readonly name = "krr";
  readonly code = 5;

  parseParams(raw: JsonObject): KRRParams {
    kwargs(raw, ["k", "eps"]);
    return { k: checkBins("k", raw["k"]), eps: checkEps("eps", raw["eps"]) };
  }

  sameParams(a: KRRParams, b: KRRParams): boolean {
    return a.k === b.k && a.eps === b.eps;
  }

  domainSize(params: KRRParams): number {
    return params.k;
  }

  truthProb(params: KRRParams): number {
    return 1 / (1 + (params.k - 1) * Math.exp(-params.eps));
  }

  encodeValue(params: KRRParams, value: number, rng: RandomSource): Uint8Array[] {
    const keep = Math.expm1(params.eps) * (1 / (Math.exp(params.eps) + params.k - 1));
    if (!Number.isFinite(keep)) throw new ParamsError(`eps=${params.eps} overflows a float`);
    const reported = bernoulli(rng, keep) ? value : rng.randbelow(params.k);
    return [indexFragment(this.code, reported)];
  }

  /** Replacement ε; removal against the uniform reference ln(k e^ε/(e^ε + k - 1)). */
  localPrivacy(params: KRRParams): LocalPrivacy {
    const removal = Math.log(params.k * this.truthProb(params));
    return { removal, replacement: params.eps, eps_l_inf: removal, eps_l1: removal };
  }
}

export interface ZSumParams {
  d: number;
  eps: number;
  delta: number;
  n: number;
}

/** Each user sends about d messages (Theorem 12 (iv)); larger domains belong to k-RAPPOR. */
export const ZSUM_MAX_BINS = 1024;

function zsumNumber(name: string, value: unknown): number {
  if (typeof value === "boolean") return value ? 1 : 0;
  if (typeof value === "number") return value;
  if (value !== null && typeof value === "object" && "value" in value && typeof value.value === "number") return value.value;
  throw new ParamsError(`${name} must be a number, got ${name}=${show(value as never)}`);
}

/** Balcer–Cheu: for every bin j, b_j + Ber(p) messages "j", p fixed by the declared crowd. */
export class ZSum extends IndexHistogram<ZSumParams> {
  readonly name = "zsum";
  readonly code = 4;
  override readonly shuffleOnly = true;

  parseParams(raw: JsonObject): ZSumParams {
    kwargs(raw, ["d", "eps", "delta", "n"]);
    const d = checkBins("d", raw["d"], ZSUM_MAX_BINS + 1);
    const eps = zsumNumber("eps", raw["eps"]);
    if (!(Number.isFinite(eps) && eps > 0 && eps <= 1)) {
      throw new ParamsError(`eps must be in (0, 1] (Balcer-Cheu Theorem 11), got eps=${show(raw["eps"])}`);
    }
    const delta = zsumNumber("delta", raw["delta"]);
    if (!(delta > 0 && delta < 1)) throw new ParamsError(`delta must be in (0, 1), got delta=${show(raw["delta"])}`);
    const required = (100 * Math.log(2 / (delta / 2))) / eps ** 2;
    const n = raw["n"];
    if (typeof n !== "number" || !Number.isInteger(n) || n < required) {
      throw new ParamsError(`n must be >= 100 ln(2/δ_bin)/ε² = ${Math.ceil(required)}, got n=${show(n)}`);
    }
    return { d, eps, delta, n };
  }

  sameParams(a: ZSumParams, b: ZSumParams): boolean {
    return a.d === b.d && a.eps === b.eps && a.delta === b.delta && a.n === b.n;
  }

  domainSize(params: ZSumParams): number {
    return params.d;
  }

  /** `p = 1 - 50 ln(2/δ_bin)/(ε² n)` with δ_bin = δ/2. */
  noiseProb(params: ZSumParams): number {
    return 1 - (50 * Math.log(2 / (params.delta / 2))) / (params.eps ** 2 * params.n);
  }

  encodeValue(params: ZSumParams, value: number, rng: RandomSource): Uint8Array[] {
    const p = this.noiseProb(params);
    const messages = [value];
    for (let j = 0; j < params.d; j++) if (bernoulli(rng, p)) messages.push(j);
    return messages.sort((a, b) => a - b).map((j) => indexFragment(this.code, j));
  }

  /** None: a user's own messages reveal its value (all the privacy is the shuffle's). */
  localPrivacy(): LocalPrivacy {
    return { removal: Infinity, replacement: Infinity, eps_l_inf: Infinity, eps_l1: Infinity };
  }
}
