/**
 * Tree-based longitudinal reports — Erlingsson et al. 2019, Algorithm 1.
 *
 * A user's 0/1 state over periods t = 1..d changes at most k times; the device keeps
 * (κ*, h*, κ, c) and, at every t divisible by 2^(h*-1) (report timing never depends on the
 * data, Theorem 5), reports (h*, t, u): (ε/2)-RR of its κ*-th change, or a uniform ±1.
 * Payload (code 3): `uint8 level | uint32 period | int8 u`. The state persists between
 * reports (the SDK's storage), as `{"tree": [κ*, h*, κ, c], "st": 0|1, "last": t}`.
 */

import { uintBE } from "../bytes.js";
import { concat } from "../bytes.js";
import { newObject, type JsonObject } from "../pyjson.js";
import { bernoulli, type RandomSource } from "../random.js";
import { frame } from "../wire.js";
import {
  MechanismError,
  ParamsError,
  StaleUpdateError,
  StateConflictError,
  checkEps,
  kwargs,
  show,
  type Encoded,
  type LocalPrivacy,
  type Mechanism,
  type StateUpdate,
  type ValueKind,
} from "./base.js";
import { isInt } from "../pyjson.js";

export const MAX_HORIZON = 1 << 20;

export interface LongitudinalParams {
  d: number;
  k: number;
  eps: number;
}

/** L = log2(d) + 1 levels. */
export function levels(params: LongitudinalParams): number {
  return Math.log2(params.d) + 1;
}

interface Tree {
  kappaStar: number;
  hStar: number;
  kappa: number;
  c: number;
  st: number;
  last: number;
}

function isCount(value: unknown): value is number {
  return typeof value === "number" && Number.isSafeInteger(value);
}

function loadTree(state: JsonObject): Tree {
  const tree = state["tree"];
  const [kappaStar, hStar, kappa, c] = Array.isArray(tree) ? tree : [];
  const { st, last } = state;
  if (!Array.isArray(tree) || tree.length !== 4 || ![kappaStar, hStar, kappa, c, st, last].every(isCount)) {
    throw new StateConflictError("longitudinal state does not parse");
  }
  return { kappaStar, hStar, kappa, c, st, last } as Tree;
}

function saveTree(tree: Tree): JsonObject {
  const out = newObject();
  out["tree"] = [tree.kappaStar, tree.hStar, tree.kappa, tree.c];
  out["st"] = tree.st;
  out["last"] = tree.last;
  return out;
}

function isStateUpdate(value: unknown): value is StateUpdate {
  return typeof value === "object" && value !== null && "period" in value && "changed" in value;
}

export class Longitudinal implements Mechanism<LongitudinalParams> {
  readonly name = "longitudinal";
  readonly code = 3;
  readonly valueKind: ValueKind = "state";
  readonly shuffleOnly = false;
  readonly encodes = true;

  parseParams(raw: JsonObject): LongitudinalParams {
    kwargs(raw, ["d", "k", "eps"]);
    const { d, k } = raw;
    const dOk = isInt(d) && typeof d === "number" && d >= 1 && d <= MAX_HORIZON && (d & (d - 1)) === 0;
    if (!dOk) throw new ParamsError(`d must be a power of two in [1, ${MAX_HORIZON}], got d=${show(d)}`);
    if (!isInt(k) || Number(k) < 1) throw new ParamsError(`k must be an integer >= 1, got k=${show(k)}`);
    return { d, k: Number(k), eps: checkEps("eps", raw["eps"]) };
  }

  sameParams(a: LongitudinalParams, b: LongitudinalParams): boolean {
    return a.d === b.d && a.k === b.k && a.eps === b.eps;
  }

  /** Theorem 5: the sequence is ε-LDP; a single report is (ε/2)-DP. */
  localPrivacy(params: LongitudinalParams): LocalPrivacy {
    const half = params.eps / 2;
    return { removal: half, replacement: params.eps, eps_l_inf: params.eps, eps_l1: half };
  }

  /** SETUP(d, k): κ* ~ U[k], h* ~ U[L]. */
  newState(params: LongitudinalParams, rng: RandomSource): JsonObject {
    const kappaStar = 1 + rng.randbelow(params.k);
    const hStar = 1 + rng.randbelow(levels(params));
    return saveTree({ kappaStar, hStar, kappa: 0, c: 0, st: 0, last: 0 });
  }

  encode(params: LongitudinalParams, value: unknown, state: JsonObject | null, rng: RandomSource): Encoded {
    if (!isStateUpdate(value)) throw new MechanismError(`a longitudinal report takes {period, changed}, got ${String(value)}`);
    const tree = loadTree(state ?? this.newState(params, rng));
    const { period, changed } = value;
    if (typeof changed !== "boolean") throw new MechanismError(`changed must be a boolean, got ${String(changed)}`);
    if (typeof period === "number" && period <= tree.last) {
      throw new StaleUpdateError(`period ${period} is not after the last period ${tree.last}`);
    }
    if (typeof period !== "number" || !Number.isInteger(period) || period < 1 || period > params.d) {
      throw new MechanismError(`t must be an integer in [1, ${params.d}], got t=${String(period)}`);
    }
    const step = !changed ? 0 : tree.st === 0 ? 1 : -1;
    const next = this.update(tree, period, step, params, rng);
    next.tree.st = tree.st ^ (changed ? 1 : 0);
    next.tree.last = period;
    return { routes: next.report === null ? [] : [[null, [next.report]]], state: saveTree(next.tree) };
  }

  /** UPDATE(t, x_t): the new state and the report for period t, if this is a reporting time. */
  private update(state: Tree, t: number, x: number, params: LongitudinalParams, rng: RandomSource): { tree: Tree; report: Uint8Array | null } {
    let { kappa, c } = state;
    if (x !== 0) {
      kappa += 1;
      if (kappa === state.kappaStar) c = x;
    }
    if (t % 2 ** (state.hStar - 1) !== 0) return { tree: { ...state, kappa, c }, report: null };
    let u: number;
    if (c === 0) u = bernoulli(rng, 0.5) ? 1 : -1;
    else u = bernoulli(rng, 1 / (1 + Math.exp(-params.eps / 2))) ? c : -c;
    const payload = concat(new Uint8Array([state.hStar]), uintBE(t, 4), new Uint8Array([u & 0xff]));
    return { tree: { ...state, kappa, c: 0 }, report: frame(this.code, payload) };
  }
}
