/**
 * LDP-SGD (ESA-revisited §VI) as far as a device's terms need it: its parameters (the model
 * the config publishes is data, not a parameter) and local privacy. This SDK does not encode
 * gradients; a report on such a channel is refused with a ChannelError (docs/sdk-js.md).
 */

import type { JsonObject } from "../pyjson.js";
import { ParamsError, checkEps, checkInt, kwargs, type Encoded, type LocalPrivacy, type Mechanism, type ValueKind } from "./base.js";

export interface LdpSgdParams {
  dim: number;
  eps: number;
  clip: number;
  radius: number;
  learning_rate: number;
  tau: number;
  rounds: number;
}

const MODEL_KEYS = ["round", "theta"];

export class LdpSgd implements Mechanism<LdpSgdParams> {
  readonly name = "ldp-sgd";
  readonly code = 6;
  readonly valueKind: ValueKind = "category";
  readonly shuffleOnly = false;
  readonly encodes = false;

  parseParams(raw: JsonObject): LdpSgdParams {
    const kept: JsonObject = Object.create(null) as JsonObject;
    for (const [key, value] of Object.entries(raw)) if (!MODEL_KEYS.includes(key)) kept[key] = value;
    kwargs(kept, ["dim", "eps"], ["clip", "radius", "learning_rate", "tau", "rounds"]);
    const count = (name: string, fallback: number) => (name in kept ? checkInt(name, kept[name], 1) : fallback);
    const positive = (name: string, fallback: number) => (name in kept ? checkEps(name, kept[name]) : fallback);
    const params = {
      dim: count("dim", 0),
      tau: count("tau", 1),
      rounds: count("rounds", 1),
      eps: checkEps("eps", kept["eps"]),
      clip: positive("clip", 1.0),
      radius: positive("radius", 100.0),
      learning_rate: positive("learning_rate", 1.0),
    };
    if (params.dim < 2) throw new ParamsError(`dim must be >= 2, got dim=${params.dim}`);
    return params;
  }

  sameParams(a: LdpSgdParams, b: LdpSgdParams): boolean {
    return (Object.keys(a) as (keyof LdpSgdParams)[]).every((key) => a[key] === b[key]);
  }

  /** Per round: τ reports of ε each (replacement); removal ln(2e^ε/(e^ε + 1)) per report. */
  localPrivacy(params: LdpSgdParams): LocalPrivacy {
    const removal = Math.log(2 / (1 + Math.exp(-params.eps)));
    return {
      removal: params.tau * removal,
      replacement: params.tau * params.eps,
      eps_l_inf: params.tau * removal,
      eps_l1: removal,
    };
  }

  newState(): JsonObject | null {
    return null;
  }

  encode(): Encoded {
    throw new ParamsError("this SDK does not encode LDP-SGD reports");
  }
}
