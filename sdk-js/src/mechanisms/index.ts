/** The mechanisms this SDK knows, by the name a channel config gives (docs/mechanisms.md). */

import type { Mechanism } from "./base.js";
import { KRR, KRappor, ZSum } from "./histograms.js";
import { LdpSgd } from "./ldpsgd.js";
import { Longitudinal } from "./longitudinal.js";
import { RFrag } from "./rfrag.js";

export * from "./base.js";
export { KRR, KRappor, ZSum } from "./histograms.js";
export { LdpSgd } from "./ldpsgd.js";
export { Longitudinal } from "./longitudinal.js";
export { RFrag, composedEps, fragmentEps } from "./rfrag.js";

const BUILT_IN: Mechanism<any>[] = [new KRappor(), new RFrag(), new Longitudinal(), new ZSum(), new KRR(), new LdpSgd()];
const REGISTRY = new Map<string, Mechanism<any>>(BUILT_IN.map((m) => [m.name, m]));

/** The mechanism named `name`, or undefined when this SDK does not know it. */
export function mechanism(name: string): Mechanism<any> | undefined {
  return REGISTRY.get(name);
}

/** The names this SDK knows, sorted. */
export function names(): string[] {
  return [...REGISTRY.keys()].sort();
}
