/**
 * The client: fetch and verify the collection config, encode, seal, queue, deliver. It
 * behaves as the Python SDK's `encoder_client.Client` on the same wire (docs/sdk.md): the
 * same trust rules, pinned terms, budgets, outbox and answers to each shuffler error; what a
 * browser changes is said in docs/sdk-js.md.
 *
 * A report never blocks its caller: `report()` queues the work (config check, encoding,
 * HPKE sealing, the storage transaction) behind the client's earlier reports and returns a
 * promise of its outcome; delivery runs in the background.
 */

import { b64decodeLenient } from "./bytes.js";
import { recipient, type Recipient } from "./crypto.js";
import {
  AlreadyReportedError,
  ChannelError,
  ChannelRetiredError,
  ConfigError,
  EsaError,
  InvalidArgumentError,
  StateError,
  TrustedKeyError,
  UnknownCrowdError,
  ValueOutOfDomainError,
} from "./errors.js";
import {
  MechanismError,
  StaleUpdateError,
  StateConflictError,
  mechanism as findMechanism,
  type Mechanism,
  type StateUpdate,
  type ValueKind,
} from "./mechanisms/index.js";
import { JsonSyntaxError, isObject, parse, type JsonValue } from "./pyjson.js";
import { SystemSource } from "./random.js";
import { backoff, retryAfterSeconds } from "./retry.js";
import { sealReport, shufflerSlot } from "./sealing.js";
import { DeviceState, type Charge, type Limit, type OutboxItem } from "./state.js";
import type { Storage } from "./storage.js";
import { checkCaps, review, type PrivacyCaps } from "./terms.js";
import {
  CollectionConfigError,
  TrustAnchors,
  believed,
  checkMoved,
  checkRollback,
  pinsOf,
  verifyCollection,
  type VerifiedConfig,
} from "./trust.js";
import { takes, type ChannelConfig, type DeviceBudget, type ShufflerInfo } from "./wire.js";

/** Every report's privacy noise, every nonce and every routing draw: the platform CSPRNG. */
const RNG = new SystemSource();
/** Shuffler error codes saying this device's config is behind, or the channel is suspended. */
export const OUTDATED = new Set(["channel_retired", "config_outdated", "channel_terms_changed"]);
/** Least seconds between two config fetches for channels the config does not name. */
export const UNKNOWN_CHANNEL_REFRESH_SECONDS = 10;
/** Largest answer read from a shuffler (a 202, a JSON error or a token). */
export const MAX_ANSWER_BYTES = 64 * 1024;
/** Largest config answer read (read before its signature can be checked). */
export const MAX_CONFIG_BYTES = 8 * 1024 * 1024;

export interface Logger {
  warn(message: string, extra?: Record<string, unknown>): void;
  error(message: string, extra?: Record<string, unknown>): void;
}

const CONSOLE: Logger = {
  warn: (message, extra) => console.warn(`esa: ${message}`, extra ?? ""),
  error: (message, extra) => console.error(`esa: ${message}`, extra ?? ""),
};

export interface ClientOptions {
  /** The analyzer's `/v1/config` URL (or give `configText`). */
  configUrl?: string;
  /** A saved signed config document, or a function reading it (re-read on every refresh). */
  configText?: string | (() => string | Promise<string>);
  /** One pinned key per party: `{"analyzer": key, "shufflers": {id: key}}` (or its JSON text). */
  trust: TrustAnchors | string | { analyzer: string; shufflers: Record<string, string> };
  /** Where the device state lives (IndexedDBStorage, FileStorage, MemoryStorage). */
  storage: Storage;
  /** Refuse a config that leaves out a pinned shuffler (default true). */
  everyShuffler?: boolean;
  /** Deliver the outbox in the background (default true; `flush()` always works). */
  background?: boolean;
  /** Seconds between background delivery attempts (default 5). */
  flushInterval?: number;
  /** Relative trust in each shuffler id for routing (default uniform). */
  weights?: Record<string, number>;
  /** The crowd this device reports in on every channel (default each channel's first). */
  crowd?: string;
  /** Seconds for each whole HTTP request (default 10). */
  timeout?: number;
  /** Time source in seconds (tests). */
  clock?: () => number;
  /** The app's own limits: largest local ε per channel or for all, a lifetime budget. */
  caps?: PrivacyCaps;
  /** The fetch to use (default the platform's). */
  fetch?: typeof fetch;
  /** Told of every report that failed (the returned promise rejects too). */
  onError?: (error: EsaError) => void;
  /** Where warnings go (default the console). */
  logger?: Logger;
}

function checkArguments(options: ClientOptions): void {
  for (const [name, value] of [["timeout", options.timeout], ["flushInterval", options.flushInterval]] as const) {
    if (value !== undefined && (typeof value !== "number" || !(value > 0))) {
      throw new InvalidArgumentError(`${name} must be a positive number of seconds: ${String(value)}`);
    }
  }
  if (options.weights !== undefined) {
    const values = Object.values(options.weights);
    if (values.some((w) => typeof w !== "number" || !(w >= 0)) || !values.some((w) => w > 0)) {
      throw new InvalidArgumentError(`weights must be non-negative numbers, at least one positive: ${JSON.stringify(options.weights)}`);
    }
  }
  if (options.crowd !== undefined && typeof options.crowd !== "string") {
    throw new InvalidArgumentError(`crowd must be a string, not ${String(options.crowd)}`);
  }
  if (options.storage === undefined || typeof options.storage.load !== "function") {
    throw new InvalidArgumentError("storage must be a Storage (IndexedDBStorage, FileStorage or MemoryStorage)");
  }
  if (options.caps !== undefined) checkCaps(options.caps);
}

function trustOf(trust: ClientOptions["trust"]): TrustAnchors {
  if (trust instanceof TrustAnchors) return trust;
  if (trust === undefined || trust === null) {
    throw new TrustedKeyError('pin one key per party: trust = {"analyzer": key, "shufflers": {id: key}} (var/trust.json of `esa up`)');
  }
  return TrustAnchors.from(trust);
}

/** The config in use and what a report needs of it, decoded once. */
interface InUse {
  verified: VerifiedConfig;
  analyzer: Recipient;
  shufflers: Map<string, Recipient>;
  channels: Map<string, ChannelConfig>;
  refused: Map<string, ChannelError>;
}

export class Client {
  private inUse!: InUse;
  private stale = false;
  private unknownRefreshed = -Infinity;
  private accepting: Promise<unknown> = Promise.resolve();
  private reports: Promise<unknown> = Promise.resolve();
  private flushing: Promise<number> | undefined;
  private timer: ReturnType<typeof setTimeout> | undefined;
  private closed = false;
  private readonly clock: () => number;
  private readonly http: typeof fetch;
  private readonly logger: Logger;
  private readonly timeout: number;

  /** The device's persistent state (opened once the config verifies, as the Python SDK). */
  state!: DeviceState;

  private constructor(
    private readonly options: ClientOptions,
    private readonly trust: TrustAnchors,
  ) {
    this.clock = options.clock ?? (() => Date.now() / 1000);
    this.http = options.fetch ?? ((...args) => globalThis.fetch(...args));
    this.logger = options.logger ?? CONSOLE;
    this.timeout = options.timeout ?? 10;
  }

  /**
   * A client whose config is fetched, verified and accepted.
   *
   * @throws ConfigError the config cannot be fetched, read or verified (names the source).
   * @throws TrustedKeyError a pinned key missing, or not 32 bytes or their base64.
   * @throws StateFileError the storage cannot be read or written.
   * @throws InvalidArgumentError a non-positive timeout or interval, unusable weights or caps.
   */
  static async create(options: ClientOptions): Promise<Client> {
    checkArguments(options);
    const trust = trustOf(options.trust);
    if (options.configUrl === undefined && options.configText === undefined) throw new ConfigError("give configUrl or configText");
    const client = new Client(options, trust);
    try {
      const config = await client.loadConfig();
      client.state = await DeviceState.open(options.storage);
      await client.accept(config);
    } catch (error) {
      if (client.state !== undefined) await options.storage.close?.().catch(() => undefined);
      throw error instanceof EsaError ? error : new ConfigError(`collection config refused: ${String(error)}`, { cause: error });
    }
    if (options.background ?? true) client.schedule((options.flushInterval ?? 5) * 1000);
    return client;
  }

  /**
   * The config in use: the shufflers reported to (in the config's order), when it expires,
   * and the channels refused under it with the error their reports raise.
   */
  status(): { shufflers: string[]; expiresAt: number; refused: ReadonlyMap<string, ChannelError> } {
    const { verified, refused } = this.inUse;
    return { shufflers: verified.shufflers.map((s) => s.id), expiresAt: verified.expiresAt, refused };
  }

  /** This device's identity (a new one after its state is lost). */
  get deviceId(): string {
    return this.state.deviceId;
  }

  // --- config ------------------------------------------------------------------------------

  private async loadConfig(): Promise<VerifiedConfig> {
    const { configUrl, configText } = this.options;
    let source: string;
    let text: string;
    if (configText !== undefined) {
      source = "configText";
      try {
        text = typeof configText === "string" ? configText : await configText();
      } catch (error) {
        throw new ConfigError(`configText cannot be read: ${(error as Error).message}`, { cause: error });
      }
    } else {
      source = `configUrl '${configUrl}'`;
      text = await this.fetchConfig(configUrl!);
    }
    let document: JsonValue;
    try {
      document = parse(text);
    } catch (error) {
      throw new ConfigError(`${source} is not JSON: ${(error as JsonSyntaxError).message}`);
    }
    try {
      return await verifyCollection(document, this.trust, this.clock(), this.options.everyShuffler ?? true);
    } catch (error) {
      throw new ConfigError(`collection config from ${source} refused: ${(error as Error).message}`, { cause: error });
    }
  }

  private async fetchConfig(url: string): Promise<string> {
    let parsed: URL;
    try {
      parsed = new URL(url);
    } catch {
      throw new ConfigError(`configUrl '${url}' is not a URL`);
    }
    if (!["http:", "https:"].includes(parsed.protocol) || parsed.host === "") {
      throw new ConfigError(`configUrl '${url}' is not an http:// or https:// URL`);
    }
    let answer: Answer;
    try {
      answer = await this.request(url, { method: "GET" }, MAX_CONFIG_BYTES);
    } catch (error) {
      throw new ConfigError(`cannot fetch configUrl '${url}': ${(error as Error).message}`, { cause: error });
    }
    const text = new TextDecoder().decode(answer.body);
    if (answer.status !== 200) throw new ConfigError(`configUrl '${url}' answered HTTP ${answer.status}: ${text.slice(0, 200)}`);
    return text;
  }

  /**
   * Use `config` from now on, unless it rolls back what this device accepted or its signers
   * fork from keys its pins moved to; pins move to its signers. A channel whose terms it
   * relaxes, or over the app's caps, takes no report under it; the others' terms are pinned.
   */
  private accept(config: VerifiedConfig): Promise<void> {
    const run = this.accepting.then(() => this.install(config));
    this.accepting = run.catch(() => undefined);
    return run;
  }

  private async install(config: VerifiedConfig): Promise<void> {
    const roots = this.trust.roots();
    let keys: { analyzer: Recipient; shufflers: Map<string, Recipient> };
    try {
      checkRollback(config.versions, await this.state.seen());
      checkMoved(config, await this.state.pins(roots));
      keys = await recipients(config);
    } catch (error) {
      if (!(error instanceof CollectionConfigError)) throw error;
      throw new ConfigError(`collection config refused: ${error.message}`);
    }
    const { config: signed } = config;
    const { pin, refused } = review(signed.channels, signed.device_budget, await this.state.pinnedTerms(), this.options.caps ?? {});
    await this.state.accept(believed(config.versions, this.clock()), roots, pinsOf(config), pin);
    for (const why of refused.values()) this.logger.warn(`channel refused: ${why.message}`);
    this.inUse = {
      verified: config,
      analyzer: keys.analyzer,
      shufflers: keys.shufflers,
      channels: new Map(signed.channels.map((c) => [c.id, c])),
      refused,
    };
  }

  /**
   * Fetch and verify the config again and use it from now on.
   *
   * @throws ConfigError as at creation; the current config stays in use.
   */
  async refreshConfig(): Promise<void> {
    await this.accept(await this.loadConfig());
  }

  /** The config in use, fetched again first if it expired or a shuffler said it is behind. */
  private async current(): Promise<InUse> {
    const expires = this.inUse.verified.expiresAt;
    if (this.clock() <= expires && !this.stale) return this.inUse;
    try {
      await this.refreshConfig();
      this.stale = false;
    } catch (error) {
      if (!(error instanceof ConfigError)) throw error;
      if (this.clock() <= this.inUse.verified.expiresAt) {
        this.logger.warn("collection config not refreshed", { error: error.message });
        return this.inUse;
      }
      throw new ConfigError(`collection config expired at ${this.inUse.verified.expiresAt} and no valid one could be fetched: ${error.message}`);
    }
    return this.inUse;
  }

  /** A channel of the config (fetched again once when the config names no such channel). */
  private async channel(channelId: string): Promise<ChannelConfig> {
    const due = this.clock() - this.unknownRefreshed >= UNKNOWN_CHANNEL_REFRESH_SECONDS;
    if (!this.inUse.channels.has(channelId) && this.options.configUrl !== undefined && due) {
      this.unknownRefreshed = this.clock();
      try {
        await this.refreshConfig();
      } catch (error) {
        if (!(error instanceof ConfigError)) throw error;
        this.logger.warn("collection config not refreshed", { error: error.message });
      }
    }
    const config = this.inUse.channels.get(channelId);
    if (config === undefined) throw new ChannelError(`channel '${channelId}' is not in the collection config`);
    const refused = this.inUse.refused.get(channelId);
    if (refused !== undefined) throw refused;
    return config;
  }

  // --- reporting ---------------------------------------------------------------------------

  /** Reporter for a channel whose reports are a value in a domain (k-RAPPOR, k-RR, report fragments, Balcer–Cheu). */
  histogram(channelId: string, crowd?: string): HistogramReporter {
    return new HistogramReporter(this, channelId, crowd);
  }

  /** Reporter for Balcer–Cheu zero-sum histogram channels (the same as {@link histogram}). */
  counts(channelId: string, crowd?: string): HistogramReporter {
    return this.histogram(channelId, crowd);
  }

  /** Reporter for channels that follow a 0/1 state over periods (Erlingsson et al. 2019). */
  longitudinal(channelId: string, crowd?: string): LongitudinalReporter {
    return new LongitudinalReporter(this, channelId, crowd);
  }

  /** Queue one report behind the earlier ones; the promise says how it went. */
  submit(channelId: string, crowd: string | undefined, kind: ValueKind, value: unknown): Promise<void> {
    const run = this.reports.then(() => this.report(channelId, crowd, kind, value)).catch((error: unknown) => {
      throw error instanceof EsaError ? error : new EsaError(`report on '${channelId}' failed: ${String(error)}`, { cause: error });
    });
    this.reports = run.catch(() => undefined);
    run.catch((error: unknown) => {
      if (error instanceof EsaError) this.options.onError?.(error);
    });
    return run;
  }

  /** Wait until every report queued so far is settled. */
  async idle(): Promise<void> {
    await this.reports;
  }

  private async report(channelId: string, crowdArg: string | undefined, kind: ValueKind, value: unknown): Promise<void> {
    if (this.closed) throw new StateError("the client is closed");
    const inUse = await this.current();
    const config = await this.channel(channelId);
    const found = this.kind(config, kind);
    const crowd = this.crowd(config, crowdArg);
    let params: unknown;
    try {
      params = found.parseParams(config.params);
    } catch (error) {
      throw new ChannelError(`channel '${config.id}' does not validate: ${(error as Error).message}`);
    }
    const epoch = Math.floor(this.clock() / config.epoch_seconds);
    if (!takes(config, epoch)) {
      throw new ChannelRetiredError(`channel '${config.id}' is retired from epoch ${config.retired_from_epoch} on (this is epoch ${epoch})`);
    }
    const encoded = await this.encode(config, found, params, value, inUse);
    if (encoded.routes.length === 0) {
      if (encoded.state !== null) await this.state.saveState(config.id, found.name, encoded.state);
      return;
    }
    const outbox = await Promise.all(encoded.routes.map(([slot, fragments]) => this.seal(inUse, config, crowd, epoch, slot, fragments)));
    const charge = this.charge(inUse, config, epoch, found.localPrivacy(params).replacement);
    if (!(await this.state.commitReport(config.id, epoch, found.name, encoded.state, outbox, charge))) {
      throw new AlreadyReportedError(`channel '${config.id}' already has a report in epoch ${epoch}`);
    }
    this.wake();
  }

  private kind(config: ChannelConfig, kind: ValueKind): Mechanism {
    const found = findMechanism(config.mechanism);
    if (found === undefined) throw new ChannelError(`channel '${config.id}': unknown mechanism '${config.mechanism}'`);
    if (found.valueKind !== kind) {
      throw new ChannelError(`channel '${config.id}' is ${config.mechanism} (${found.valueKind} values); use the matching reporter`);
    }
    if (!found.encodes) throw new ChannelError(`channel '${config.id}': this SDK does not encode ${config.mechanism} reports`);
    return found;
  }

  /** The crowd this device reports in: the reporter's, else the client's, else the channel's first. */
  private crowd(config: ChannelConfig, crowd: string | undefined): string {
    const chosen = crowd ?? this.options.crowd;
    if (chosen === undefined) return config.crowds[0]!;
    if (!config.crowds.includes(chosen)) {
      throw new UnknownCrowdError(`crowd '${chosen.slice(0, 80)}' is not declared for channel '${config.id}' (declared: ${config.crowds.map((c) => `'${c}'`).join(", ")})`);
    }
    return chosen;
  }

  private async encode(config: ChannelConfig, found: Mechanism, params: unknown, value: unknown, inUse: InUse) {
    const saved = await this.state.channelState(config.id, found.name);
    try {
      const state = saved ?? found.newState(params, RNG);
      return found.encode(params, value, state, RNG, inUse.verified.shufflers.length);
    } catch (error) {
      if (error instanceof StaleUpdateError) throw new AlreadyReportedError(error.message);
      if (error instanceof StateConflictError) throw new StateError(error.message);
      if (error instanceof MechanismError) throw new ValueOutOfDomainError(`${String(value)}: ${error.message}`);
      throw new ValueOutOfDomainError(`${String(value)}: ${(error as Error).message}`);
    }
  }

  private async seal(inUse: InUse, config: ChannelConfig, crowd: string, epoch: number, slot: number | null, fragments: Uint8Array[]): Promise<[string, Uint8Array]> {
    const shufflers = inUse.verified.shufflers;
    const weights = this.options.weights === undefined ? [] : shufflers.map((s) => this.options.weights![s.id] ?? 0);
    const shuffler = shufflers[shufflerSlot(slot, shufflers.length, RNG, weights)]!;
    try {
      const body = await sealReport({
        channelId: config.id,
        crowd,
        epoch,
        payloadSize: config.payload_size,
        fragments,
        analyzer: inUse.analyzer,
        shuffler: { id: shuffler.id, key: inUse.shufflers.get(shuffler.id)! },
      });
      return [shuffler.id, body];
    } catch (error) {
      if (error instanceof RangeError) throw new ChannelError(`channel '${config.id}': ${error.message}`);
      throw error;
    }
  }

  /** A report's local ε with the budgets of the signed config it must fit. */
  private charge(inUse: InUse, config: ChannelConfig, epoch: number, eps: number): Charge {
    const start = epoch * config.epoch_seconds;
    const limits: Limit[] = [
      ...limitsOf(config.id, config.budget, start),
      ...limitsOf(null, inUse.verified.config.device_budget, start),
    ];
    const lifetime = this.options.caps?.lifetimeEps;
    if (lifetime !== undefined) limits.push({ eps: lifetime, channelId: null, since: null, byApp: true });
    return { eps, epochStart: start, limits };
  }

  /** Local ε (replacement notion, basic composition) spent on `channelId`, or on all channels. */
  budgetSpent(channelId?: string): Promise<number> {
    return this.state.spent(channelId ?? null);
  }

  /** Sealed contributions not yet delivered. */
  outboxSize(): Promise<number> {
    return this.state.outboxSize();
  }

  // --- delivery ----------------------------------------------------------------------------

  /**
   * Try to deliver every due contribution now; resolves to how many were delivered (network
   * errors and refusals are retried later, never thrown). Each shuffler is sent to on its own,
   * each POST within `timeout`, so a slow shuffler delays no other's deliveries.
   */
  flush(): Promise<number> {
    const run = (this.flushing ?? Promise.resolve(0)).catch(() => 0).then(() => this.deliverDue());
    this.flushing = run;
    return run;
  }

  private async deliverDue(): Promise<number> {
    let inUse: InUse;
    try {
      inUse = await this.current();
    } catch (error) {
      if (!(error instanceof ConfigError)) throw error;
      this.logger.warn(`delivery postponed: ${error.message}`);
      return 0;
    }
    const queues = new Map<string, OutboxItem[]>();
    for (const item of await this.state.due(this.clock())) {
      queues.set(item.shufflerId, [...(queues.get(item.shufflerId) ?? []), item]);
    }
    const counts = await Promise.all([...queues.values()].map((items) => this.deliverQueue(inUse, items)));
    return counts.reduce((a, b) => a + b, 0);
  }

  /** One shuffler's due items in order; after one that could not reach it the rest wait. */
  private async deliverQueue(inUse: InUse, items: OutboxItem[]): Promise<number> {
    let delivered = 0;
    for (const item of items) {
      const outcome = await this.deliver(inUse, item);
      if (outcome === null) break;
      delivered += outcome;
    }
    return delivered;
  }

  /** 1 delivered, 0 not (kept or dropped by its answer), null when its shuffler could not be reached. */
  private async deliver(inUse: InUse, item: OutboxItem): Promise<number | null> {
    const shuffler = inUse.verified.shufflers.find((s) => s.id === item.shufflerId);
    if (shuffler === undefined) {
      this.logger.warn("outbox entry for a shuffler no longer configured; kept");
      await this.state.retryLater(item.id, this.clock() + 3600);
      return 0;
    }
    let answer: Answer;
    try {
      const token = (await this.state.token(shuffler.id)) ?? (await this.enroll(shuffler));
      answer = await this.request(`${shuffler.url}/v1/contributions`, {
        method: "POST",
        body: item.body as BodyInit,
        headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/octet-stream" },
      }, MAX_ANSWER_BYTES);
    } catch {
      await this.backoff(item);
      return null;
    }
    return this.answered(shuffler, item, answer);
  }

  /** Act on a shuffler's answer to one item; 1 when it is delivered. */
  private async answered(shuffler: ShufflerInfo, item: OutboxItem, answer: Answer): Promise<number> {
    const code = answer.status >= 400 ? errorCode(answer.body) : null;
    if (code !== null && OUTDATED.has(code)) {
      this.logger.warn("contribution refused: config outdated; dropped", { error: code });
      this.stale = true;
      await this.state.delivered(item.id);
      return 0;
    }
    if (answer.status === 202 || answer.status === 409) {
      await this.state.delivered(item.id);
      return 1;
    }
    const wait = retryAfterSeconds(answer.headers.get("retry-after"), this.clock());
    if (code === "unknown_channel") await this.backoff(item);
    else if (answer.status === 401) {
      await this.state.setToken(shuffler.id, "");
      await this.backoff(item);
    } else if (answer.status === 429) await this.state.retryLater(item.id, this.clock() + Math.max(1, wait ?? 1));
    else if (answer.status === 400 || answer.status === 413) {
      this.logger.error("contribution refused for good; dropped", { shuffler: shuffler.id, status: answer.status, error: code });
      await this.state.delivered(item.id);
    } else await this.backoff(item, wait);
    return 0;
  }

  /** A client token from `shuffler` (a refusal throws: the item backs off). */
  private async enroll(shuffler: ShufflerInfo): Promise<string> {
    const answer = await this.request(`${shuffler.url}/v1/enroll`, { method: "POST" }, MAX_ANSWER_BYTES);
    if (answer.status !== 200) throw new Error(`enrolment at ${shuffler.id} answered HTTP ${answer.status}`);
    const body = parse(new TextDecoder().decode(answer.body));
    const token = isObject(body) ? body["client_token"] : undefined;
    if (typeof token !== "string") throw new Error(`enrolment at ${shuffler.id} answered no token`);
    await this.state.setToken(shuffler.id, token);
    return token;
  }

  private async backoff(item: OutboxItem, atLeast: number | null = null): Promise<void> {
    const delay = Math.max(backoff(item.attempts, RNG), atLeast ?? 0);
    await this.state.retryLater(item.id, this.clock() + delay);
  }

  /** One HTTP request within `timeout` for the whole of it, its answer read up to `limit` bytes. */
  private async request(url: string, init: RequestInit, limit: number): Promise<Answer> {
    const abort = new AbortController();
    const timer = setTimeout(() => abort.abort(new Error(`no answer within ${this.timeout} s`)), this.timeout * 1000);
    try {
      const response = await this.http(url, { ...init, signal: abort.signal, redirect: "error", cache: "no-store" });
      const body = await readLimited(response, limit);
      return { status: response.status, body, headers: response.headers };
    } finally {
      clearTimeout(timer);
    }
  }

  private schedule(delay: number): void {
    if (this.closed) return;
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.timer = setTimeout(() => {
      this.timer = undefined;
      this.flush()
        .catch((error: unknown) => this.logger.error("background flush failed", { error: String(error) }))
        .finally(() => this.schedule((this.options.flushInterval ?? 5) * 1000));
    }, delay);
    (this.timer as { unref?: () => void }).unref?.();
  }

  /** A report was queued: deliver soon (when delivering in the background). */
  private wake(): void {
    if ((this.options.background ?? true) && !this.closed) this.schedule(0);
  }

  /** Stop background delivery, wait for queued reports, release the storage (the outbox persists). */
  async close(): Promise<void> {
    this.closed = true;
    if (this.timer !== undefined) clearTimeout(this.timer);
    await this.reports;
    await this.flushing?.catch(() => 0);
    await this.state.settled();
    await this.options.storage.close?.();
  }
}

interface Answer {
  status: number;
  body: Uint8Array;
  headers: Headers;
}

async function readLimited(response: Response, limit: number): Promise<Uint8Array> {
  const declared = Number(response.headers.get("content-length") ?? "0");
  if (declared > limit) throw new Error(`answer of ${declared} bytes, more than ${limit}`);
  const reader = response.body?.getReader();
  if (reader === undefined) return new Uint8Array();
  const chunks: Uint8Array[] = [];
  let size = 0;
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    size += value.length;
    if (size > limit) {
      await reader.cancel();
      throw new Error(`answer over ${limit} bytes`);
    }
    chunks.push(value);
  }
  const out = new Uint8Array(size);
  let offset = 0;
  for (const chunk of chunks) {
    out.set(chunk, offset);
    offset += chunk.length;
  }
  return out;
}

/** The `error` of a JSON error body, null for any other body. */
function errorCode(answer: Uint8Array): string | null {
  try {
    const body = parse(new TextDecoder().decode(answer));
    return isObject(body) && "error" in body ? String(body["error"]) : null;
  } catch {
    return null;
  }
}

/** The analyzer's current HPKE key and every shuffler's, decoded once. */
async function recipients(config: VerifiedConfig): Promise<{ analyzer: Recipient; shufflers: Map<string, Recipient> }> {
  try {
    const analyzer = await recipient(b64decodeLenient(config.config.analyzer.keys[0]!.public_key));
    const shufflers = new Map<string, Recipient>();
    for (const s of config.shufflers) shufflers.set(s.id, await recipient(b64decodeLenient(s.public_key)));
    return { analyzer, shufflers };
  } catch (error) {
    throw new CollectionConfigError(`the collection config holds no usable HPKE key: ${(error as Error).message}`);
  }
}

/** The caps of one budget for a report of the epoch that starts at `epochStart`. */
function limitsOf(scope: string | null, budget: DeviceBudget | null, epochStart: number): Limit[] {
  if (budget === null) return [];
  const limits: Limit[] = [];
  if (budget.lifetime_eps !== null) limits.push({ eps: budget.lifetime_eps, channelId: scope, since: null, byApp: false });
  if (budget.window_eps !== null && budget.window_seconds !== null) {
    limits.push({ eps: budget.window_eps, channelId: scope, since: epochStart - budget.window_seconds + 1, byApp: false });
  }
  return limits;
}

/** Reports on one channel through its mechanism (one contribution per epoch, whatever the crowd). */
export class HistogramReporter {
  constructor(
    private readonly client: Client,
    readonly channelId: string,
    readonly crowd?: string,
  ) {}

  /**
   * Encode, seal and queue this epoch's report of `value` (an integer of the channel's
   * domain). Returns at once; the promise settles when the report is queued or refused
   * (ValueOutOfDomainError, AlreadyReportedError, BudgetExceededError, ChannelError...).
   */
  report(value: number): Promise<void> {
    return this.client.submit(this.channelId, this.crowd, "category", value);
  }
}

/** Reports a 0/1 state over periods (Erlingsson et al. 2019, Algorithm 1). */
export class LongitudinalReporter {
  constructor(
    private readonly client: Client,
    readonly channelId: string,
    readonly crowd?: string,
  ) {}

  /** Tell the SDK whether the state changed at `period` (1..d, increasing). */
  update(period: number, changed: boolean): Promise<void> {
    const value: StateUpdate = { period, changed };
    return this.client.submit(this.channelId, this.crowd, "state", value);
  }
}
