/**
 * Where a device keeps its state (the pins, the budget spent, the channel states, the outbox):
 * one interface, three places. A snapshot is saved whole and atomically after every change,
 * so a crash leaves the last one complete, never half of one.
 *
 * - {@link MemoryStorage}: tests, or a page that reports once and forgets (no budget kept!).
 * - {@link IndexedDBStorage}: a browser (one record in an object store of the origin).
 * - `FileStorage` (`esa-device-sdk/node`): a file written by rename, mode 0600.
 */

export interface Storage {
  /** A name for messages (a path, a database name). */
  readonly name: string;
  /** The snapshot saved last, or null when there is none yet. */
  load(): Promise<string | null>;
  /** Replace the snapshot, all or nothing; resolves once it is durable. */
  save(snapshot: string): Promise<void>;
  /** Set an unusable snapshot aside (the device starts as a new one). */
  discard?(): Promise<void>;
  close?(): Promise<void>;
}

/** State in memory only: lost with the object (a new device every time). */
export class MemoryStorage implements Storage {
  readonly name = "memory";
  /** The saved snapshot (tests read it). */
  snapshot: string | null = null;
  /** Saves that must fail (tests of a full disk or a blocked database). */
  failSaves = 0;

  constructor(initial: string | null = null) {
    this.snapshot = initial;
  }

  async load(): Promise<string | null> {
    return this.snapshot;
  }

  async save(snapshot: string): Promise<void> {
    if (this.failSaves > 0) {
      this.failSaves--;
      throw new Error("memory storage told to fail");
    }
    this.snapshot = snapshot;
  }

  async discard(): Promise<void> {
    this.snapshot = null;
  }
}

function request<T>(req: IDBRequest<T>): Promise<T> {
  return new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error ?? new Error("IndexedDB request failed"));
  });
}

/**
 * State in the browser's IndexedDB: one record (`key`) in one object store of database
 * `database`. A save resolves once its transaction completes (committed to disk where the
 * browser offers it: `durability: "strict"`). One client per database at a time: two tabs
 * that report on the same channels should share one (e.g. in a SharedWorker).
 */
export class IndexedDBStorage implements Storage {
  readonly name: string;
  private db: Promise<IDBDatabase> | undefined;

  constructor(
    private readonly database = "esa-device-sdk",
    private readonly key = "state",
    private readonly factory: IDBFactory | undefined = globalThis.indexedDB,
  ) {
    this.name = `IndexedDB ${database}`;
  }

  private open(): Promise<IDBDatabase> {
    const factory = this.factory;
    if (factory === undefined) return Promise.reject(new Error("IndexedDB is not available here"));
    this.db ??= new Promise((resolve, reject) => {
      const req = factory.open(this.database, 1);
      req.onupgradeneeded = () => req.result.createObjectStore("state");
      req.onsuccess = () => resolve(req.result);
      req.onerror = () => reject(req.error ?? new Error("IndexedDB cannot be opened"));
      req.onblocked = () => reject(new Error("IndexedDB is blocked by another connection"));
    });
    return this.db;
  }

  async load(): Promise<string | null> {
    const db = await this.open();
    const found = await request(db.transaction("state", "readonly").objectStore("state").get(this.key));
    return typeof found === "string" ? found : null;
  }

  async save(snapshot: string): Promise<void> {
    const db = await this.open();
    const tx = db.transaction("state", "readwrite", { durability: "strict" });
    tx.objectStore("state").put(snapshot, this.key);
    await new Promise<void>((resolve, reject) => {
      tx.oncomplete = () => resolve();
      tx.onerror = () => reject(tx.error ?? new Error("IndexedDB write failed"));
      tx.onabort = () => reject(tx.error ?? new Error("IndexedDB write aborted"));
    });
  }

  async discard(): Promise<void> {
    const found = await this.load();
    if (found === null) return;
    const db = await this.open();
    const tx = db.transaction("state", "readwrite");
    tx.objectStore("state").put(found, `${this.key}.corrupt-${Math.floor(Date.now() / 1000)}`);
    tx.objectStore("state").delete(this.key);
    await new Promise<void>((resolve, reject) => {
      tx.oncomplete = () => resolve();
      tx.onerror = () => reject(tx.error ?? new Error("IndexedDB write failed"));
    });
  }

  async close(): Promise<void> {
    if (this.db !== undefined) (await this.db).close();
    this.db = undefined;
  }
}
