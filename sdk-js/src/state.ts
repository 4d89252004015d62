/**
 * The device's persistent state, behind one {@link Storage}: its identity, enrolment tokens,
 * the issue times of the newest documents accepted (an older one is a replay), where each
 * party's pin moved through successions, each channel's pinned privacy terms (never relaxed
 * while the state lives), the mechanisms' device states (backstops, longitudinal trees), the
 * (channel, epoch) pairs reported with the local ε each spent (the device budget), and the
 * outbox of sealed contributions. The same content as the Python SDK's state file.
 *
 * Every change is one transaction: applied, then the whole snapshot saved; if the save fails
 * the change is undone and a {@link StateFileError} raised. A snapshot that does not parse is
 * set aside and the device starts as a new one (new id, new backstops), never a silent mix.
 */

import { b64decode, b64encode, hex } from "./bytes.js";
import { BudgetExceededError, StateError, StateFileError } from "./errors.js";
import { dumps, isObject, parse, type JsonObject, type JsonValue } from "./pyjson.js";
import { randomBytes } from "./random.js";
import type { Storage } from "./storage.js";
import { termsFromJson, termsJson, type ChannelTerms } from "./terms.js";

/** Relative slack when comparing spend with a budget (k reports of ε fit a budget of kε). */
export const BUDGET_SLACK = 1e-9;

/** One cap on local-ε spend: over a channel (null: all) and reports since a time (null: ever). */
export interface Limit {
  eps: number;
  channelId: string | null;
  since: number | null;
  byApp: boolean;
}

export function describeLimit(limit: Limit): string {
  const scope = limit.channelId === null ? "all channels" : `channel '${limit.channelId}'`;
  const span = limit.since === null ? "lifetime" : "rolling window";
  return `${limit.byApp ? "the app's" : "the"} ${span} budget ε=${limit.eps} of ${scope}`;
}

/** What one report costs: its local ε, the start of its epoch, and the caps it must fit. */
export interface Charge {
  eps: number;
  epochStart: number;
  limits: Limit[];
}

/** A sealed contribution waiting for its shuffler's 202. */
export interface OutboxItem {
  id: number;
  shufflerId: string;
  body: Uint8Array;
  attempts: number;
}

interface Spend {
  channel: string;
  epoch: number;
  epoch_start: number;
  /** The local ε spent ("inf" for a mechanism with none: JSON has no infinity). */
  eps: number | "inf";
}

interface Queued {
  id: number;
  shuffler_id: string;
  body: string;
  created_at: number;
  attempts: number;
  next_attempt_at: number;
}

interface Snapshot {
  version: 1;
  device_id: string;
  created_at: number;
  tokens: Record<string, string>;
  seen: Record<string, number>;
  pins: Record<string, { root: string; key: string }>;
  /** Each channel's pinned terms, as Python-compatible JSON text (parameters keep 2.0 apart from 2). */
  terms: Record<string, string>;
  /** Each channel's mechanism state, as Python-compatible JSON text. */
  channel_state: Record<string, { kind: string; data: string }>;
  reported: Record<string, number[]>;
  spend: Spend[];
  outbox: Queued[];
  next_id: number;
}

function fresh(): Snapshot {
  return {
    version: 1,
    device_id: hex(randomBytes(16)),
    created_at: Date.now() / 1000,
    tokens: {},
    seen: {},
    pins: {},
    terms: {},
    channel_state: {},
    reported: {},
    spend: [],
    outbox: [],
    next_id: 1,
  };
}

const KEYS = ["device_id", "tokens", "seen", "pins", "terms", "channel_state", "reported", "spend", "outbox", "next_id"];

/** A saved snapshot, or null when it is not one (damaged, edited, another program's). */
function decode(text: string): Snapshot | null {
  try {
    const value = JSON.parse(text) as Snapshot;
    if (typeof value !== "object" || value === null || value.version !== 1 || !KEYS.every((k) => k in value)) return null;
    if (typeof value.device_id !== "string" || !Array.isArray(value.outbox) || !Array.isArray(value.spend)) return null;
    return value;
  } catch {
    return null;
  }
}

/** The snapshot as plain JSON (native speed: it holds the outbox, rewritten at each change). */
function encode(snapshot: Snapshot): string {
  return JSON.stringify(snapshot);
}

function epsOf(row: Spend): number {
  return row.eps === "inf" ? Infinity : row.eps;
}

export class DeviceState {
  /** Whether the saved state was unusable and replaced by a new device's. */
  wasReset = false;
  private saved: string;
  private lock: Promise<unknown> = Promise.resolve();

  private constructor(
    readonly storage: Storage,
    private snapshot: Snapshot,
  ) {
    this.saved = encode(snapshot);
  }

  /**
   * The state saved in `storage`, or a new device's.
   *
   * @throws StateFileError when the storage cannot be read or written.
   */
  static async open(storage: Storage): Promise<DeviceState> {
    let text: string | null;
    try {
      text = await storage.load();
    } catch (error) {
      throw new StateFileError(`device state ${storage.name} cannot be read: ${(error as Error).message}`, { cause: error });
    }
    const found = text === null ? null : decode(text);
    const state = new DeviceState(storage, found ?? fresh());
    if (text !== null && found === null) {
      state.wasReset = true;
      await storage.discard?.().catch(() => undefined);
    }
    if (found === null) await state.transaction(() => undefined);
    return state;
  }

  /** Run `change` alone, then save; undo it if it throws or the save fails. */
  private transaction<T>(change: (s: Snapshot) => T): Promise<T> {
    const run = this.lock.then(async () => {
      try {
        const result = change(this.snapshot);
        const text = encode(this.snapshot);
        if (text !== this.saved) await this.storage.save(text);
        this.saved = text;
        return result;
      } catch (error) {
        this.snapshot = decode(this.saved) ?? this.snapshot;
        if (error instanceof BudgetExceededError || error instanceof StateError) throw error;
        throw new StateFileError(`device state ${this.storage.name} cannot be written: ${(error as Error).message}`, { cause: error });
      }
    });
    this.lock = run.catch(() => undefined);
    return run;
  }

  /** Read without changing anything (after every change queued before). */
  private async read<T>(look: (s: Snapshot) => T): Promise<T> {
    await this.lock;
    return look(this.snapshot);
  }

  get deviceId(): string {
    return this.snapshot.device_id;
  }

  token(shufflerId: string): Promise<string | undefined> {
    return this.read((s) => s.tokens[shufflerId] || undefined);
  }

  setToken(shufflerId: string, token: string): Promise<void> {
    return this.transaction((s) => {
      s.tokens[shufflerId] = token;
    });
  }

  /** Issue time of the newest document accepted, by name. */
  seen(): Promise<Map<string, number>> {
    return this.read((s) => new Map(Object.entries(s.seen)));
  }

  /** The keys (base64) each party's pin moved to, for the roots pinned now. */
  pins(roots: ReadonlyMap<string, string>): Promise<Map<string, string>> {
    return this.read((s) => new Map(Object.entries(s.pins).filter(([party, pin]) => roots.get(party) === pin.root).map(([party, pin]) => [party, pin.key])));
  }

  /**
   * The privacy terms pinned for each channel.
   *
   * @throws StateError when a pinned entry does not parse.
   */
  pinnedTerms(): Promise<Map<string, ChannelTerms>> {
    return this.read((s) => {
      try {
        return new Map(Object.entries(s.terms).map(([channel, terms]) => [channel, termsFromJson(parse(terms))]));
      } catch (error) {
        throw new StateError(`device state ${this.storage.name}: unusable pinned terms (${(error as Error).message})`);
      }
    });
  }

  /** Accept a config: remember its issue times (never moving back), move pins, pin terms. */
  accept(seen: ReadonlyMap<string, number>, roots: ReadonlyMap<string, string>, pins: ReadonlyMap<string, string>, terms: ReadonlyMap<string, ChannelTerms>): Promise<void> {
    return this.transaction((s) => {
      for (const [name, issued] of seen) s.seen[name] = Math.max(s.seen[name] ?? issued, issued);
      for (const [party, key] of pins) {
        const root = roots.get(party);
        if (root !== undefined) s.pins[party] = { root, key };
      }
      for (const [channel, t] of terms) s.terms[channel] = dumps(termsJson(t));
    });
  }

  /**
   * A channel's saved mechanism state, if any.
   *
   * @throws StateError when it belongs to another kind of channel.
   */
  channelState(channelId: string, kind: string): Promise<JsonObject | null> {
    return this.read((s) => {
      const found = s.channel_state[channelId];
      if (found === undefined) return null;
      if (found.kind !== kind) throw new StateError(`state of channel '${channelId}' is ${found.kind}, not ${kind}`);
      let data: JsonValue;
      try {
        data = parse(found.data);
      } catch {
        throw new StateError(`device state ${this.storage.name}: the state of channel '${channelId}' does not parse`);
      }
      if (!isObject(data)) throw new StateError(`device state ${this.storage.name}: the state of channel '${channelId}' does not parse`);
      return data;
    });
  }

  /** Persist a channel's device state outside a report (a longitudinal update). */
  saveState(channelId: string, kind: string, data: JsonObject): Promise<void> {
    return this.transaction((s) => {
      s.channel_state[channelId] = { kind, data: dumps(data) };
    });
  }

  /**
   * Atomically mark (channel, epoch) reported, charge its local ε, save the channel state and
   * queue the contributions. False, changing nothing, when (channel, epoch) was reported.
   *
   * @throws BudgetExceededError when the charge does not fit a limit (nothing is changed).
   */
  commitReport(channelId: string, epoch: number, kind: string, data: JsonObject | null, outbox: [string, Uint8Array][], charge: Charge | null): Promise<boolean> {
    return this.transaction((s) => {
      if ((s.reported[channelId] ?? []).includes(epoch)) return false;
      if (charge !== null) this.check(s, channelId, charge);
      s.reported[channelId] = [...(s.reported[channelId] ?? []), epoch];
      if (charge !== null) {
        const eps = Number.isFinite(charge.eps) ? charge.eps : "inf";
        s.spend.push({ channel: channelId, epoch, epoch_start: charge.epochStart, eps });
      }
      if (data !== null) s.channel_state[channelId] = { kind, data: dumps(data) };
      const now = Date.now() / 1000;
      for (const [shufflerId, body] of outbox) {
        s.outbox.push({ id: s.next_id++, shuffler_id: shufflerId, body: b64encode(body), created_at: now, attempts: 0, next_attempt_at: 0 });
      }
      return true;
    });
  }

  private check(s: Snapshot, channelId: string, charge: Charge): void {
    for (const limit of charge.limits) {
      const spent = spentIn(s, limit.channelId, limit.since);
      if (spent + charge.eps > limit.eps * (1 + BUDGET_SLACK)) {
        throw new BudgetExceededError(
          `a report on channel '${channelId}' costs local ε=${charge.eps}; ${describeLimit(limit)} has ${Math.max(0, limit.eps - spent)} left`,
        );
      }
    }
  }

  /** Local ε spent on `channelId` (null: all channels) by reports of epochs starting at or after `since`. */
  spent(channelId: string | null = null, since: number | null = null): Promise<number> {
    return this.read((s) => spentIn(s, channelId, since));
  }

  /** Contributions due at `now`, oldest first. */
  due(now: number, limit = 256): Promise<OutboxItem[]> {
    return this.read((s) =>
      s.outbox
        .filter((item) => item.next_attempt_at <= now)
        .slice(0, limit)
        .map((item) => ({ id: item.id, shufflerId: item.shuffler_id, body: b64decode(item.body), attempts: item.attempts })),
    );
  }

  delivered(itemId: number): Promise<void> {
    return this.transaction((s) => {
      s.outbox = s.outbox.filter((item) => item.id !== itemId);
    });
  }

  retryLater(itemId: number, at: number): Promise<void> {
    return this.transaction((s) => {
      for (const item of s.outbox) {
        if (item.id === itemId) {
          item.attempts += 1;
          item.next_attempt_at = at;
        }
      }
    });
  }

  outboxSize(): Promise<number> {
    return this.read((s) => s.outbox.length);
  }

  /** Wait for every change queued so far. */
  async settled(): Promise<void> {
    await this.lock;
  }
}

function spentIn(s: Snapshot, channelId: string | null, since: number | null): number {
  let total = 0;
  for (const row of s.spend) {
    if ((channelId === null || row.channel === channelId) && (since === null || row.epoch_start >= since)) total += epsOf(row);
  }
  return total;
}
