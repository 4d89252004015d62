/**
 * The outbox's retry policy, as the Python SDK's (common/retry.py): capped exponential backoff
 * with multiplicative jitter in [0.5, 1.5), so devices that failed together retry apart, and
 * the server's own `Retry-After` (RFC 9110 §10.2.3) when it sends one.
 */

import type { RandomSource } from "./random.js";

/** `min(cap, base · 2^attempt) · U[0.5, 1.5)` seconds before retry `attempt + 1`. */
export function backoff(attempt: number, rng: RandomSource, base = 0.5, cap = 300): number {
  const ceiling = Math.min(cap, base * 2 ** Math.min(Math.max(attempt, 0), 62));
  return ceiling * (0.5 + rng.random());
}

/**
 * Seconds the server asked to wait: delta-seconds (`"120"`) or an HTTP date (a past date
 * gives 0); null when absent or unreadable.
 */
export function retryAfterSeconds(value: string | null, now: number): number | null {
  if (value === null) return null;
  const text = value.trim();
  if (/^\d+$/.test(text)) return Number(text);
  if (!/^[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} \d{2}:\d{2}:\d{2} GMT$/.test(text)) return null;
  const when = Date.parse(text);
  if (Number.isNaN(when)) return null;
  return Math.max(0, Math.ceil(when / 1000 - now));
}
