/**
 * The SDK's errors; catch {@link EsaError} to catch them all. The same tree, and the same
 * class names, as the Python SDK (docs/sdk.md, "Errors"):
 *
 * ```
 * EsaError
 * ├── ConfigError            unsigned, mis-signed, tampered, expired or unreachable config
 * │   └── TrustedKeyError    a pinned key that is not base64 of 32 bytes
 * ├── ChannelError           unknown channel, or a reporter of the wrong kind for it
 * │   ├── ChannelRetiredError  the channel was retired at the analyzer
 * │   ├── UnknownCrowdError  a crowd the channel's signed config does not declare
 * │   ├── PrivacyRelaxedError  a config relaxes privacy terms this device accepted
 * │   └── PrivacyCapError    a channel's local ε above the app's cap
 * ├── ValueOutOfDomainError  a value the channel cannot encode
 * ├── AlreadyReportedError   a second report on a channel in the same epoch
 * ├── StateError             the device state cannot be used for this channel
 * │   └── StateFileError     the storage cannot be read or written
 * ├── BudgetExceededError    the report would spend more local ε than a budget allows
 * └── InvalidArgumentError   an argument the SDK cannot use
 * ```
 */

/** Base of every error the SDK raises; `name` is the class name (as in the Python SDK). */
export class EsaError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** The collection config cannot be trusted or fetched. */
export class ConfigError extends EsaError {}

/** A pinned key is not an Ed25519 public key (32 raw bytes or their base64). */
export class TrustedKeyError extends ConfigError {}

/** Unknown channel, or a reporter of the wrong kind for it. */
export class ChannelError extends EsaError {}

/** The channel was retired at the analyzer: it takes no report for this epoch or later. */
export class ChannelRetiredError extends ChannelError {}

/** A crowd that the channel's signed config does not declare. */
export class UnknownCrowdError extends ChannelError {}

/**
 * A signed config relaxes what this device accepted about a channel's privacy: the channel
 * takes no report while that config is in force (docs/sdk.md, "Pinned privacy terms").
 */
export class PrivacyRelaxedError extends ChannelError {
  readonly channelId: string;
  /** The first relaxed field (the message names every one). */
  readonly field: string;
  /** Its value as accepted. */
  readonly old: unknown;
  /** Its value in the refused config. */
  readonly new: unknown;

  constructor(
    message: string,
    details: { channelId: string; field: string; old: unknown; new: unknown },
  ) {
    super(message);
    this.channelId = details.channelId;
    this.field = details.field;
    this.old = details.old;
    this.new = details.new;
  }
}

/** A channel's local ε (replacement notion) is above the cap the app set. */
export class PrivacyCapError extends ChannelError {
  readonly channelId: string;
  readonly cap: number;
  readonly value: number;

  constructor(message: string, details: { channelId: string; cap: number; value: number }) {
    super(message);
    this.channelId = details.channelId;
    this.cap = details.cap;
    this.value = details.value;
  }
}

/** A value outside the channel's domain. */
export class ValueOutOfDomainError extends EsaError {}

/** One contribution per channel per epoch: this one was already made. */
export class AlreadyReportedError extends EsaError {}

/** The device state cannot be used for this channel (e.g. drawn for other parameters). */
export class StateError extends EsaError {}

/** The device state storage cannot be opened, read or written (names the storage). */
export class StateFileError extends StateError {}

/** The report would take this device past a local-ε budget (the config's or the app's). */
export class BudgetExceededError extends EsaError {}

/** An argument the SDK cannot use (a non-positive timeout, negative routing weights...). */
export class InvalidArgumentError extends EsaError {}
