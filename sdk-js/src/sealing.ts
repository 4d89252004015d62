/**
 * Sealing one report for the wire (docs/protocol-notes.md, "Sealed envelopes"): each fragment
 * padded to the channel's payload size and sealed to the analyzer's HPKE key with the
 * (channel, epoch, crowd) context in `info`; the fragments, the crowd and a fresh nonce form
 * one contribution, sealed to the chosen shuffler's key with its id in `info`.
 */

import { seal, type Recipient } from "./crypto.js";
import { randomBytes, type RandomSource } from "./random.js";
import { NONCE_SIZE, encodeContribution, fragmentInfo, outerInfo, pad } from "./wire.js";

export interface SealRequest {
  channelId: string;
  crowd: string;
  epoch: number;
  payloadSize: number;
  fragments: Uint8Array[];
  analyzer: Recipient;
  shuffler: { id: string; key: Recipient };
}

/** The request body of one contribution. */
export async function sealReport(request: SealRequest): Promise<Uint8Array> {
  const info = fragmentInfo(request.channelId, request.epoch, request.crowd);
  const sealed = await Promise.all(
    request.fragments.map((fragment) => seal(pad(fragment, request.payloadSize), request.analyzer, info)),
  );
  const contribution = encodeContribution({
    channelId: request.channelId,
    crowdId: request.crowd,
    epoch: request.epoch,
    nonce: randomBytes(NONCE_SIZE),
    fragments: sealed,
  });
  return seal(contribution, request.shuffler.key, outerInfo(request.shuffler.id));
}

/**
 * Which of `count` shufflers a route goes to: `slot mod count` when the mechanism fixes it
 * (report fragments), else one drawn from the CSPRNG, in proportion to `weights` when given.
 */
export function shufflerSlot(slot: number | null, count: number, rng: RandomSource, weights: number[] = []): number {
  if (slot !== null) return slot % count;
  const total = weights.reduce((a, b) => a + b, 0);
  if (weights.length === 0 || total <= 0) return rng.randbelow(count);
  let point = (rng.randbelow(2 ** 30) / 2 ** 30) * total;
  for (let index = 0; index < weights.length; index++) {
    point -= weights[index]!;
    if (point < 0) return index;
  }
  return count - 1;
}
