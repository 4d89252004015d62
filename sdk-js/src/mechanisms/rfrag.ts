/**
 * Report fragments with a privacy backstop — ESA-revisited Algorithm 2, §IV.
 *
 * Each one-hot bit gets a backstop `x' = R_b(x; ε_b)` drawn once per (device, channel, true
 * value) and kept in the device state; every report sends τ fresh rows `R_f(x'; ε_f)`, row r
 * routed to shuffler `r mod K`. Payload (code 2): `uint16 row | uint32 bit index`. Local
 * privacy is ε(t) of Theorem IV.1, capped at ε(τ) only while the backstop is kept: a lost or
 * mismatched state is an error, never a silent redraw.
 */

import { hex } from "../bytes.js";
import { newObject, isObject, type JsonObject, type JsonValue } from "../pyjson.js";
import { bernoulli, geometricPositions, randomBytes, randomizedOnehot, type RandomSource } from "../random.js";
import { concat, uintBE } from "../bytes.js";
import { frame } from "../wire.js";
import {
  ParamsError,
  StateConflictError,
  checkBins,
  checkEps,
  checkInt,
  checkValue,
  kwargs,
  show,
  type Encoded,
  type LocalPrivacy,
  type Mechanism,
  type ValueKind,
} from "./base.js";

export const MAX_TAU = 1 << 16;

export interface RFragParams {
  k: number;
  eps_b: number;
  eps_f: number;
  tau: number;
  /** Which parameters a backstop was drawn for (k and ε_b, as Python writes them). */
  fingerprint: string;
}

/** ε of `R2 ∘ R1` for ε1-, ε2-DP randomizers (ESA-revisited Appendix B, Corollary .2). */
export function composedEps(eps1: number, eps2: number): number {
  if (!Number.isFinite(eps1) || !Number.isFinite(eps2) || eps1 <= 0 || eps2 <= 0) {
    throw new ParamsError(`composed ε needs finite positive ε, got ${eps1}, ${eps2}`);
  }
  const big = Math.max(eps1, eps2);
  const small = Math.min(eps1, eps2);
  const numerator = big + small + Math.log1p(Math.exp(-(big + small)));
  const denominator = big + Math.log1p(Math.exp(small - big));
  return numerator - denominator;
}

/** ε(t) of Theorem IV.1 for an adversary holding t fragments. */
export function fragmentEps(epsB: number, epsF: number, t: number): number {
  return composedEps(epsB, t * epsF);
}

/** The 1-bits of each value's backstop (a state that does not parse is an error). */
function backstops(state: JsonObject, params: RFragParams): Map<number, number[]> {
  const found = new Map<number, number[]>();
  const saved = state["backstops"];
  if (!isObject(saved)) throw new StateConflictError("backstop state does not parse");
  for (const [value, ones] of Object.entries(saved)) {
    const valid = Array.isArray(ones) && ones.every((i) => typeof i === "number" && Number.isInteger(i) && i >= 0 && i < params.k);
    if (!/^\d+$/.test(value) || !valid) throw new StateConflictError("backstop state does not parse");
    found.set(Number(value), ones as number[]);
  }
  return found;
}

function saved(params: RFragParams, drawn: Map<number, number[]>, stateId: JsonValue): JsonObject {
  const out = newObject();
  const table = newObject();
  for (const [value, ones] of [...drawn.entries()].sort((a, b) => a[0] - b[0])) table[String(value)] = ones;
  out["fingerprint"] = params.fingerprint;
  out["state_id"] = stateId;
  out["backstops"] = table;
  return out;
}

/** Rank r among the zeros of a sparse 0/1 vector (sorted `ones`) as its position. */
function complementPosition(ones: number[], rank: number): number {
  let count = 0;
  for (let i = 0; i < ones.length; i++) if (ones[i]! - i <= rank) count++;
  return rank + count;
}

export class RFrag implements Mechanism<RFragParams> {
  readonly name = "rfrag";
  readonly code = 2;
  readonly valueKind: ValueKind = "category";
  readonly shuffleOnly = false;
  readonly encodes = true;

  parseParams(raw: JsonObject): RFragParams {
    kwargs(raw, ["k", "eps_b", "eps_f", "tau"]);
    const k = checkBins("k", raw["k"]);
    const epsB = checkEps("eps_b", raw["eps_b"]);
    const epsF = checkEps("eps_f", raw["eps_f"]);
    const tau = checkInt("tau", raw["tau"], 1, MAX_TAU);
    return { k, eps_b: epsB, eps_f: epsF, tau, fingerprint: `rfrag/k=${k}/eps_b=${show(raw["eps_b"])}` };
  }

  sameParams(a: RFragParams, b: RFragParams): boolean {
    return a.k === b.k && a.eps_b === b.eps_b && a.eps_f === b.eps_f && a.tau === b.tau;
  }

  /** Theorem IV.1: removal ε_ℓ∞ = ε(τ), ε_ℓ1 = ε(1); replacement touches two bits: 2 ε(τ). */
  localPrivacy(params: RFragParams): LocalPrivacy {
    const inf = fragmentEps(params.eps_b, params.eps_f, params.tau);
    const one = fragmentEps(params.eps_b, params.eps_f, 1);
    return { removal: inf, replacement: 2 * inf, eps_l_inf: inf, eps_l1: one };
  }

  newState(params: RFragParams): JsonObject {
    return saved(params, new Map(), hex(randomBytes(16)));
  }

  encode(params: RFragParams, value: unknown, state: JsonObject | null, rng: RandomSource, shufflers: number): Encoded {
    const current = state ?? this.newState(params);
    const drawn = backstops(current, params);
    const checked = checkValue(value, params.k);
    if (current["fingerprint"] !== params.fingerprint) {
      throw new StateConflictError(
        `backstops were drawn for ${show(current["fingerprint"])}, not ${params.fingerprint}; redrawing would void the ε_ℓ∞ cap: treat this as a new device`,
      );
    }
    let ones = drawn.get(checked);
    if (ones === undefined) {
      ones = randomizedOnehot(rng, checked, params.k, 1 / (1 + Math.exp(params.eps_b)));
      drawn.set(checked, ones);
    }
    const routed = new Map<number, Uint8Array[]>();
    for (let r = 0; r < params.tau; r++) {
      const slot = r % shufflers;
      const row = this.row(r, ones, params, rng);
      routed.set(slot, [...(routed.get(slot) ?? []), ...row]);
    }
    const routes = [...routed.entries()].sort((a, b) => a[0] - b[0]) as [number, Uint8Array[]][];
    return { routes, state: saved(params, drawn, current["state_id"] ?? null) };
  }

  /** Row r: each backstop 1-bit kept w.p. 1 - p_f, each 0-bit set w.p. p_f, sorted. */
  private row(r: number, ones: number[], params: RFragParams, rng: RandomSource): Uint8Array[] {
    const p = 1 / (1 + Math.exp(params.eps_f));
    const kept = ones.filter(() => !bernoulli(rng, p));
    const flipped: number[] = [];
    for (const rank of geometricPositions(rng, params.k - ones.length, p)) flipped.push(complementPosition(ones, rank));
    const prefix = uintBE(r, 2);
    return [...kept, ...flipped].sort((a, b) => a - b).map((i) => frame(this.code, concat(prefix, uintBE(i, 4))));
  }
}
