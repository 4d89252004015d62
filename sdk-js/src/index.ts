/**
 * The ESA device SDK for browsers and Node (docs/sdk-js.md):
 *
 * ```ts
 * const client = await Client.create({ configUrl, trust, storage: new IndexedDBStorage() });
 * client.histogram("homepage").report(42);
 * ```
 *
 * The trust pins one key per party (the analyzer's and every shuffler's signing key); values
 * are encoded with the channel's LDP mechanism (randomness from `crypto.getRandomValues`),
 * sealed with HPKE, queued in a persistent outbox and delivered in the background. A
 * channel's privacy terms are pinned at the first config naming it and never relaxed; the
 * app's caps hold whatever a config says. Catch `EsaError` for every SDK error.
 */

export { Client, HistogramReporter, LongitudinalReporter, type ClientOptions, type Logger } from "./client.js";
export * from "./errors.js";
export { IndexedDBStorage, MemoryStorage, type Storage } from "./storage.js";
export { TrustAnchors } from "./trust.js";
export type { PrivacyCaps } from "./terms.js";
export { backends, type Backends } from "./crypto.js";
