/**
 * Node's side of the SDK: device state in a file ({@link FileStorage}), and reading a trust
 * file or a saved config. Import from `esa-device-sdk/node`; browsers use IndexedDBStorage.
 */

import { constants } from "node:fs";
import { mkdir, open, readFile, rename } from "node:fs/promises";
import { dirname } from "node:path";
import { TrustedKeyError } from "./errors.js";
import type { Storage } from "./storage.js";
import { TrustAnchors } from "./trust.js";

export * from "./index.js";

/**
 * Device state in one file: each save writes `<path>.tmp` (mode 0600), flushes it to disk and
 * renames it over `path`, so a crash leaves the old or the new snapshot, whole. One client
 * per file at a time.
 */
export class FileStorage implements Storage {
  constructor(readonly path: string) {}

  get name(): string {
    return this.path;
  }

  async load(): Promise<string | null> {
    try {
      return await readFile(this.path, "utf8");
    } catch (error) {
      if ((error as NodeJS.ErrnoException).code === "ENOENT") return null;
      throw error;
    }
  }

  async save(snapshot: string): Promise<void> {
    await mkdir(dirname(this.path), { recursive: true });
    const temporary = `${this.path}.tmp`;
    const file = await open(temporary, constants.O_WRONLY | constants.O_CREAT | constants.O_TRUNC, 0o600);
    try {
      await file.writeFile(snapshot, "utf8");
      await file.sync();
    } finally {
      await file.close();
    }
    await rename(temporary, this.path);
  }

  /** Keep an unusable file as `<path>.corrupt-<unix time>` (the device starts anew). */
  async discard(): Promise<void> {
    await rename(this.path, `${this.path}.corrupt-${Math.floor(Date.now() / 1000)}`).catch(() => undefined);
  }
}

/**
 * The keys a trust file pins (`var/trust.json` written by `esa up`).
 *
 * @throws TrustedKeyError naming the file and what is wrong with it.
 */
export async function loadTrustFile(path: string): Promise<TrustAnchors> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (error) {
    throw new TrustedKeyError(`trust file '${path}': ${(error as Error).message}`);
  }
  try {
    return TrustAnchors.from(text);
  } catch (error) {
    throw new TrustedKeyError(`trust file '${path}': ${(error as Error).message}`);
  }
}

/** A `configText` that re-reads a saved config file at every refresh (Python's `config_file`). */
export function configFile(path: string): () => Promise<string> {
  return () => readFile(path, "utf8");
}
