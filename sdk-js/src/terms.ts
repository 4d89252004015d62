/**
 * A channel's privacy terms, and which changes to them relax a device's privacy
 * (docs/sdk.md, "Pinned privacy terms"): the first config naming a channel pins its terms; a
 * later config may tighten but never relax them (that channel is refused under it); the app's
 * caps hold whatever a config says. Parameters are ordered through the mechanism's own local
 * privacy, never a list of names. The same rules, field names and order as the Python SDK.
 */

import { InvalidArgumentError, PrivacyCapError, PrivacyRelaxedError, type ChannelError } from "./errors.js";
import { NOTIONS, mechanism, type LocalPrivacy } from "./mechanisms/index.js";
import { dumps, newObject, pyEqual, type JsonObject, type JsonValue } from "./pyjson.js";
import { deviceBudget, channelConfig, type ChannelConfig, type ChannelPrivacyFields, type DeviceBudget } from "./wire.js";

/** Relative slack when comparing two ε or δ, so the same number computed twice is equal. */
export const SLACK = 1e-12;

/** Every privacy field of one channel, as the device pins it. */
export interface ChannelTerms extends ChannelPrivacyFields {
  device_budget: DeviceBudget | null;
}

/** The terms a signed config states for `channel`. */
export function termsOf(channel: ChannelConfig, deviceBudget: DeviceBudget | null): ChannelTerms {
  return {
    id: channel.id,
    epoch_seconds: channel.epoch_seconds,
    min_crowd: channel.min_crowd,
    eps_cr: channel.eps_cr,
    delta_cr: channel.delta_cr,
    max_fragments: channel.max_fragments,
    min_fragments: channel.min_fragments,
    payload_size: channel.payload_size,
    crowds: [...channel.crowds],
    retired_from_epoch: channel.retired_from_epoch,
    mechanism: channel.mechanism,
    params: channel.params,
    delta: channel.delta,
    budget: channel.budget,
    device_budget: deviceBudget,
  };
}

/** The terms as JSON (the Python `model_dump`: what the state keeps and the vectors show). */
export function termsJson(terms: ChannelTerms): JsonObject {
  const out = newObject();
  for (const [key, value] of Object.entries(terms)) out[key] = budgetJson(value as JsonValue | DeviceBudget);
  return out;
}

function budgetJson(value: JsonValue | DeviceBudget): JsonValue {
  if (value === null || typeof value !== "object" || !("lifetime_eps" in value && "window_seconds" in value)) {
    return value as JsonValue;
  }
  const out = newObject();
  out["lifetime_eps"] = value.lifetime_eps;
  out["window_eps"] = value.window_eps;
  out["window_seconds"] = value.window_seconds;
  return out;
}

/**
 * Terms read back from {@link termsJson} (the device's own state).
 *
 * @throws Error when they do not parse.
 */
export function termsFromJson(value: JsonValue): ChannelTerms {
  const o = value as JsonObject;
  const { device_budget: overall, ...channel } = o;
  const parsed = channelConfig({ ...channel } as JsonObject, "terms");
  return termsOf(parsed, overall === null || overall === undefined ? null : deviceBudget(overall, "terms.device_budget"));
}

/**
 * The mechanism's local privacy for these terms (null: this SDK does not know the mechanism,
 * or the parameters do not validate or cannot be evaluated: nothing can be ordered).
 */
export function localPrivacy(terms: Pick<ChannelTerms, "mechanism" | "params">): LocalPrivacy | null {
  const found = mechanism(terms.mechanism);
  if (found === undefined) return null;
  try {
    const local = found.localPrivacy(found.parseParams(terms.params));
    return NOTIONS.some((notion) => Number.isNaN(local[notion])) ? null : local;
  } catch {
    return null;
  }
}

/** Whether `b` gives the same mechanism parameters as `a` (as the mechanism parses them). */
export function sameParams(a: ChannelTerms, b: ChannelTerms): boolean {
  if (a.mechanism !== b.mechanism) return false;
  const found = mechanism(a.mechanism);
  try {
    if (found === undefined) throw new Error("unknown");
    return found.sameParams(found.parseParams(a.params), found.parseParams(b.params));
  } catch {
    return pyEqual(a.params, b.params);
  }
}

const COMPARED = [
  "id", "epoch_seconds", "min_crowd", "eps_cr", "delta_cr", "max_fragments", "min_fragments",
  "payload_size", "crowds", "mechanism", "delta", "budget", "device_budget",
] as const;

/** Every privacy term `b` sets differently from `a` (retirement is not one). */
export function changedTerms(a: ChannelTerms, b: ChannelTerms): string[] {
  const changed: string[] = COMPARED.filter(
    (key) => !pyEqual(budgetJson(a[key] as JsonValue), budgetJson(b[key] as JsonValue)),
  );
  if (!sameParams(a, b)) changed.push("params");
  return changed.sort();
}

/** One field a later document relaxes (or changes in a way that cannot be ordered). */
export interface Relaxation {
  field: string;
  old: JsonValue;
  new: JsonValue;
}

function more(old: number, next: number): boolean {
  return next > old * (1 + SLACK) && !(!Number.isFinite(old) && !Number.isFinite(next));
}

function relaxedLocal(old: ChannelTerms, next: ChannelTerms): Relaxation[] {
  if (old.mechanism !== next.mechanism) return [{ field: "mechanism", old: old.mechanism, new: next.mechanism }];
  if (sameParams(old, next)) return [];
  const before = localPrivacy(old);
  const after = localPrivacy(next);
  if (before === null || after === null) return [{ field: "params", old: old.params, new: next.params }];
  return NOTIONS.filter((notion) => more(before[notion], after[notion])).map((notion) => ({
    field: `local ε (${notion})`,
    old: before[notion],
    new: after[notion],
  }));
}

/** A budget may be added or tightened, never lifted, raised or spread over a shorter window. */
function relaxedBudget(name: string, old: DeviceBudget | null, next: DeviceBudget | null): Relaxation[] {
  if (old === null || pyEqual(budgetJson(old), budgetJson(next))) return [];
  if (next === null) return [{ field: name, old: budgetJson(old), new: null }];
  const found: Relaxation[] = [];
  for (const key of ["lifetime_eps", "window_eps"] as const) {
    const before = old[key];
    const after = next[key];
    if (before !== null && (after === null || more(before, after))) found.push({ field: `${name}.${key}`, old: before, new: after });
  }
  if (old.window_seconds !== null && (next.window_seconds ?? 0) < old.window_seconds) {
    found.push({ field: `${name}.window_seconds`, old: old.window_seconds, new: next.window_seconds });
  }
  return found;
}

/**
 * What `next` relaxes of the accepted `old` (empty: as strong or stronger): another mechanism,
 * parameters with a larger local ε in any notion (or that cannot be ordered), a larger δ,
 * `eps_cr` or `delta_cr` (less randomized deletion, ESA-revisited Theorem V.1), a lower
 * `min_crowd`, shorter epochs, changed fragment bounds, payload size or crowds, a budget
 * lifted, raised or over a shorter window.
 */
export function relaxations(old: ChannelTerms, next: ChannelTerms): Relaxation[] {
  const found = relaxedLocal(old, next);
  for (const key of ["delta", "eps_cr", "delta_cr"] as const) {
    if (more(old[key], next[key])) found.push({ field: key, old: old[key], new: next[key] });
  }
  for (const key of ["min_crowd", "epoch_seconds"] as const) {
    if (next[key] < old[key]) found.push({ field: key, old: old[key], new: next[key] });
  }
  for (const key of ["min_fragments", "max_fragments", "payload_size", "crowds"] as const) {
    if (!pyEqual(old[key], next[key])) found.push({ field: key, old: old[key], new: next[key] });
  }
  return [
    ...found,
    ...relaxedBudget("budget", old.budget, next.budget),
    ...relaxedBudget("device_budget", old.device_budget, next.device_budget),
  ];
}

/** Limits the app sets that no signed config can take the device past. */
export interface PrivacyCaps {
  /** Largest local ε (replacement notion) of a report on any channel. */
  localEps?: number;
  /** The same per channel id (overrides `localEps` for that channel). */
  channelLocalEps?: Record<string, number>;
  /** Largest local ε this device spends over all channels in its lifetime. */
  lifetimeEps?: number;
}

function positive(name: string, value: unknown): void {
  if (typeof value !== "number" || !(value > 0)) {
    throw new InvalidArgumentError(`${name} must be a positive number, not ${String(value)}`);
  }
}

/** @throws InvalidArgumentError naming an unusable cap. */
export function checkCaps(caps: PrivacyCaps): PrivacyCaps {
  if (caps.localEps !== undefined) positive("localEps", caps.localEps);
  if (caps.lifetimeEps !== undefined) positive("lifetimeEps", caps.lifetimeEps);
  for (const [channel, value] of Object.entries(caps.channelLocalEps ?? {})) positive(`channelLocalEps[${channel}]`, value);
  return caps;
}

function overCap(terms: ChannelTerms, caps: PrivacyCaps): PrivacyCapError | null {
  const cap = Object.prototype.hasOwnProperty.call(caps.channelLocalEps ?? {}, terms.id)
    ? caps.channelLocalEps![terms.id]!
    : caps.localEps;
  if (cap === undefined) return null;
  const local = localPrivacy(terms);
  const value = local === null ? Infinity : local.replacement;
  if (value <= cap) return null;
  return new PrivacyCapError(
    `channel '${terms.id}': local ε ${value} (${terms.mechanism}, replacement notion) is above the app's cap ${cap}; no report is made on it`,
    { channelId: terms.id, cap, value },
  );
}

function relaxed(old: ChannelTerms, next: ChannelTerms): PrivacyRelaxedError | null {
  const found = relaxations(old, next);
  const first = found[0];
  if (first === undefined) return null;
  const described = found.map((r) => `${r.field} ${dumps(r.old)} -> ${dumps(r.new)}`);
  return new PrivacyRelaxedError(
    `channel '${next.id}': the signed config relaxes privacy terms this device accepted (${described.join("; ")}); no report is made on it under that config (a channel whose privacy changes needs a new channel id)`,
    { channelId: next.id, field: first.field, old: first.old, new: first.new },
  );
}

/**
 * Each channel of a config against the app's caps and the terms pinned for it: the terms to
 * pin (first seen, or changed and as strong or stronger) and the refused channels with the
 * error their reports raise. Pins are kept for good: waiting out a config relaxes nothing.
 */
export function review(
  channels: ChannelConfig[],
  deviceBudget: DeviceBudget | null,
  pinned: ReadonlyMap<string, ChannelTerms>,
  caps: PrivacyCaps,
): { pin: Map<string, ChannelTerms>; refused: Map<string, ChannelError> } {
  const pin = new Map<string, ChannelTerms>();
  const refused = new Map<string, ChannelError>();
  for (const channel of channels) {
    const terms = termsOf(channel, deviceBudget);
    const old = pinned.get(channel.id);
    const error = overCap(terms, caps) ?? (old === undefined ? null : relaxed(old, terms));
    if (error !== null) refused.set(channel.id, error);
    else if (old === undefined || changedTerms(old, terms).length > 0) pin.set(channel.id, terms);
  }
  return { pin, refused };
}
