'use strict';
/**
 * One queue served by one generation (identity) of a worker: claims tasks,
 * runs their handlers, reports each outcome (finish, give_back), hands back
 * what a rebalance or a stop asks for once its handler has exited
 * (invariant 10), and asks peers for tasks when below its fair share.
 */
const { isStandin, fetchBlob } = require('./blob');

/** @typedef {import('./binding').Process} Process */
/** @typedef {import('./binding').QueueBeat} QueueBeat */
/** @typedef {'cancelled' | 'moved' | 'stopped' | 'fenced'} StopReason */

/**
 * What a handler gets besides the payload.
 * @typedef {object} TaskContext
 * @property {AbortSignal} signal  aborted when the handler must stop (signal.reason: a StopReason)
 * @property {bigint} token        the fencing token (increases at every claim, namespace-wide)
 * @property {string} id           the process id (the token as text)
 * @property {string} queue
 * @property {boolean} persistent
 * @property {string | null} group the group of the queue the job came from (null: none)
 * @property {number} attempts     failed attempts before this one
 * @property {string} worker       the worker id that runs it
 */

/**
 * A handler: runs a task until it returns (finished) or throws (a failed
 * attempt: retried with backoff, dead-lettered at the limit). Once its signal
 * is aborted it must exit soon, returning or throwing: then the process is
 * handed back unharmed (reason 'moved' or 'stopped'), dropped ('cancelled',
 * 'fenced': Redis no longer holds it for this worker), or counted as a failed
 * attempt ('timeout', the policy's time limit).
 * What it returns (a string or Buffer) is kept as the result on a queue whose
 * policy keeps results.
 * @typedef {(task: Buffer, ctx: TaskContext) => Promise<unknown> | unknown} Handler
 */

/**
 * @typedef {object} Slot
 * @property {Process} process
 * @property {AbortController} ac
 * @property {StopReason | null} reason
 * @property {boolean} timedOut  cancelled by the policy's handler timeout (a failed attempt)
 */

const CLAIM_MAX = 250;
const STOP_CHUNK = 100;
const STOP_PACE_MS = 10;
const HERD = 3;

/** @param {number} ms */
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * The error text of a failed attempt (protocol/README.md, "Dead-letter
 * record"): "Type: message" on the first line (at most 500 characters), then
 * the error's stack frames ("    at ...", innermost first, as V8 writes them),
 * as many as fit in 2000 bytes in all; the line alone when there is no stack.
 * @param {unknown} err
 */
function describeError(err) {
  const name = err instanceof Error ? err.name : typeof err;
  const msg = (err instanceof Error ? err.message : String(err)).split(/\s+/).filter(Boolean).join(' ');
  let head = msg ? `${name}: ${msg}` : name;
  if (head.length > 500) head = `${head.slice(0, 497)}...`;
  const stack = err instanceof Error && typeof err.stack === 'string' ? err.stack : '';
  const frames = stack.split('\n').filter((line) => /^\s+at /.test(line));
  let text = head;
  for (const frame of frames) {
    const line = frame.length > 300 ? `${frame.slice(0, 296)}...` : frame;
    if (Buffer.byteLength(text) + 1 + Buffer.byteLength(line) > 2000) break;
    text += `\n${line}`;
  }
  return text;
}

/** A number as Python's `%g` writes it (6 significant digits, no trailing zeros). @param {number} x */
function formatG(x) {
  return String(Number(x.toPrecision(6)));
}

class Runner {
  /**
   * @param {import('./worker').Worker} worker
   * @param {import('./worker').Generation} gen
   * @param {string} queue
   * @param {Handler} handler
   * @param {{concurrency: number, capacity: number, policy: Policy}} options
   */
  constructor(worker, gen, queue, handler, options) {
    this.worker = worker;
    this.gen = gen;
    this.queue = queue;
    this.handler = handler;
    this.concurrency = options.concurrency;
    this.policy = options.policy;
    /** @type {Map<string, Slot>} */
    this.running = new Map();
    /** @type {string[]} */ this.done = [];
    /** @type {Map<string, [Buffer, Buffer | null]>} */ this.results = new Map();
    /** @type {[string, string][]} */ this.failed = [];
    /** @type {string[]} */ this.returned = [];
    this.maybeWork = true;
    this.lastClaimFull = false;
    /** @type {number | null} */ this.heldBackSince = null;
    this.nextDue = Infinity;
    this.resyncNeeded = false;
    this.stopping = false;
    this.pull = 0;
    /** @type {string | null} */ this.fruitless = null;
    /** @type {string[]} */ this.servers = [];
    /** @type {[number, boolean]} */ this.dueDrawn = [-1, false];
    /** @type {(() => void) | null} */ this._wake = null;
    this._woken = false;
    /** @type {NodeJS.Timeout | null} */ this._timer = null;
    /** @type {Promise<void> | null} */ this.loopDone = null;
    /** Settled once no handler runs. @type {Set<Promise<void>>} */
    this.handlers = new Set();
  }

  get free() { return this.concurrency - this.running.size; }

  /** Wake the loop. */
  wake() {
    this._woken = true;
    if (this._wake) this._wake();
  }

  /** There may be tasks to claim. */
  nudge() {
    this.maybeWork = true;
    this.wake();
  }

  /** @param {number} ms */
  wakeIn(ms) {
    this.nextDue = Math.min(this.nextDue, Date.now() + ms);
    this.wake();
  }

  /**
   * What the heartbeat says about this queue (no I/O).
   * @param {QueueBeat} beat
   */
  onHeartbeat(beat) {
    this.release(beat.release);
    if (!this.stopping) {
      this.pull = pullCount(beat);
      const sig = `${beat.weight}/${beat.total}/${beat.capacityTotal}`;
      if (this.pull && this.fruitless === sig) this.pull = 0;
      if (this.pull) this.wake();
    }
    const ours = this.running.size + this.done.length + this.failed.length + this.returned.length;
    if (beat.held < ours) {
      this.resyncNeeded = true;
      this.wake();
    }
    if (!beat.idle && !this.maybeWork && this.heldBackSince === null && this.free > 0) this.nudge();
    if (beat.state === 0) this.nudge();
    else if (beat.state > 0) {
      const due = Date.now() + beat.state;
      if (Math.abs(this.dueDrawn[0] - due) > 50) {
        const act = beat.idleServers <= HERD || Math.random() * beat.idleServers < HERD;
        this.dueDrawn = [due, act];
      }
      if (this.dueDrawn[1]) this.wakeIn(beat.state);
    }
  }

  /**
   * Cancel a process here (cancelled in the mesh). Returns whether it ran here.
   * @param {string} pid @param {StopReason} [reason]
   */
  cancelProcess(pid, reason = 'cancelled') {
    const slot = this.running.get(pid);
    if (!slot) return false;
    this._abort(slot, reason);
    return true;
  }

  /** @param {Slot} slot @param {StopReason} reason */
  _abort(slot, reason) {
    if (slot.reason !== null) {
      // a cancel or a fence overrides a hand-back: nothing is to be handed back then
      if (reason === 'cancelled' || reason === 'fenced') slot.reason = reason;
      return;
    }
    slot.reason = reason;
    slot.ac.abort(reason);
  }

  /** Hand these processes back for balance, once their handlers exit. @param {string[]} pids */
  release(pids) {
    for (const pid of pids) {
      const slot = this.running.get(pid);
      if (slot && slot.reason === null) this._abort(slot, 'moved');
    }
  }

  /**
   * Stop claiming and stop every handler, 100 every 10 ms (a large stop does
   * not flood Redis with hand-backs at once); the loop hands each process back
   * as its handler exits.
   */
  beginStop() {
    this.stopping = true;
    const slots = [...this.running.values()];
    const next = () => {
      for (const slot of slots.splice(0, STOP_CHUNK)) this._abort(slot, 'stopped');
      if (slots.length) setTimeout(next, STOP_PACE_MS);
      this.wake();
    };
    next();
  }

  /** The generation is fenced: stop every handler, report nothing. */
  fence() {
    for (const slot of this.running.values()) this._abort(slot, 'fenced');
    this.wake();
  }

  /** Run the loop (returns at once; `loopDone` settles when it ends). */
  start() {
    this.loopDone = this._loop();
  }

  async _loop() {
    let backoff = 50;
    const w = this.worker;
    for (;;) {
      if (this.gen.fenced) {
        await Promise.allSettled([...this.handlers]);
        return;
      }
      this._woken = false;
      try {
        if (this.resyncNeeded) await this._resync();
        if (this.failed.length) await this._giveBackFailed();
        if (this.returned.length) await this._giveBackReturned();
        if (this.done.length) await this._finish();
        if (!this.stopping) {
          if (this.nextDue <= Date.now()) {
            this.nextDue = Infinity;
            this.maybeWork = true;
          }
          if (this.free > 0 && this.maybeWork) {
            await this._claim(Math.min(this.free, CLAIM_MAX));
            backoff = 50;
            continue;
          }
          if (this.pull) await this._rebalance();
        } else if (this.running.size === 0 && !this.done.length && !this.failed.length
          && !this.returned.length) {
          return;
        }
        backoff = 50;
      } catch (err) {
        if (err instanceof Error && err.name === 'FencedError') {
          this.worker._fence(this.gen, err.message);
          continue;
        }
        w._log('warn', `queue ${this.queue}: ${err instanceof Error ? err.message : err}; retrying in ${backoff} ms`);
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 1000);
        if (this.stopping) for (const s of this.running.values()) this._abort(s, 'stopped');
        continue;
      }
      if (this._woken || this.done.length || this.failed.length || this.returned.length) continue;
      await new Promise((resolve) => {
        this._wake = () => resolve(undefined);
        if (this.nextDue !== Infinity && !this.stopping) {
          this._timer = setTimeout(resolve, Math.max(0, this.nextDue - Date.now()));
        }
      });
      this._wake = null;
      if (this._timer) clearTimeout(this._timer);
      this._timer = null;
    }
  }

  async _claim(/** @type {number} */ n) {
    const w = this.worker;
    const gen = this.gen;
    const now = Date.now();
    const waited = this.heldBackSince !== null && now - this.heldBackSince >= w.timing.interval * 1000;
    this.maybeWork = false;
    const p = this.policy;
    /** @type {any} */
    let reply;
    try {
      reply = await w.binding.claim(w.redis, {
        worker: gen.id, inc: gen.incarnation, queue: this.queue, n, maxAttempts: p.maxAttempts,
        fair: waited ? Math.max(2, Math.floor(w.timing.interval * 900)) : 1,
        backoffMs: p.backoffMs, backoffCapMs: p.backoffMaxMs, ttlMs: Math.round(w.timing.ttl * 1000),
        wake: true, rate: p.rateLimit > 0 ? [p.rateLimit, p.ratePeriodMs] : null,
      });
    } catch (err) {
      this.maybeWork = true;
      throw err;
    }
    if (reply.heldBack) {
      if (this.heldBackSince === null) this.heldBackSince = now;
      // claim again one heartbeat interval later, with a patience
      this.wakeIn(w.timing.interval * 1000);
    } else {
      this.heldBackSince = null;
    }
    if (reply.nextDueMs >= 0) this.wakeIn(reply.nextDueMs);
    this.lastClaimFull = reply.processes.length >= n;
    if (this.lastClaimFull && reply.remaining > 0) this.maybeWork = true;
    for (const proc of reply.processes) {
      if (gen.earlyCancels.delete(proc.id)) continue; // cancelled before its claim reply came
      this._start(proc);
    }
  }

  /** @param {Process} proc */
  _start(proc) {
    const gen = this.gen;
    const w = this.worker;
    const ac = new AbortController();
    /** @type {Slot} */
    const slot = { process: proc, ac, reason: null, timedOut: false };
    const timeoutMs = this.policy.timeoutMs;
    /** @type {NodeJS.Timeout | undefined} */
    let limit;
    if (timeoutMs > 0) {
      limit = setTimeout(() => {
        if (slot.reason === null) {
          slot.timedOut = true;
          ac.abort('timeout');
        }
      }, timeoutMs);
    }
    this.running.set(proc.id, slot);
    if (this.stopping || gen.fenced) this._abort(slot, gen.fenced ? 'fenced' : 'stopped');
    const info = { queue: this.queue, task: proc.task, token: proc.id, worker: gen.id,
      persistent: proc.persistent, group: proc.group };
    w.emit('start', info);
    const run = (async () => {
      try {
        // a big payload's stand-in: its payload is read first (src/blob.js);
        // a blob that is gone fails the attempt, the handler never sees it
        const task = isStandin(proc.task) ? await fetchBlob(w.redis, w.keys, proc.task) : proc.task;
        return { ok: true, value: await this.handler(task, {
          signal: ac.signal, token: proc.token, id: proc.id, queue: this.queue,
          persistent: proc.persistent, group: proc.group, attempts: proc.attempts, worker: gen.id }) };
      } catch (error) {
        return { ok: false, error };
      }
    })();
    const settled = run.then((out) => {
      clearTimeout(limit);
      this.running.delete(proc.id);
      if (slot.timedOut && slot.reason === null) {
        // the policy's time limit: a failed attempt, whatever the handler did after
        out = { ok: false, error: null };
      }
      if (this.lastClaimFull) this.maybeWork = true;
      const reason = slot.reason;
      if (reason === 'cancelled' || reason === 'fenced') {
        w.emit('stop', { ...info, reason });
      } else if (reason !== null) {
        // stopped or moved: handed back, whether the handler threw or returned
        // (a JS handler often just returns once its signal is aborted)
        this.returned.push(proc.id);
        w.emit('stop', { ...info, reason });
      } else if (out.ok) {
        this.done.push(proc.id);
        if (this.policy.resultTtlMs > 0) this.results.set(proc.id, [proc.task, resultBytes(out.value)]);
        w.count(this.queue, true);
        w.emit('done', { ...info, ok: true });
      } else if (slot.timedOut) {
        // stopped by the policy's time limit: a failed attempt
        const why = `TimeoutError: the handler ran longer than ${formatG(timeoutMs / 1000)} s`;
        this.failed.push([proc.id, why]);
        w.count(this.queue, false);
        w.emit('stop', { ...info, reason: 'timeout', error: why });
      } else {
        const why = describeError(out.error);
        this.failed.push([proc.id, why]);
        w.count(this.queue, false);
        w.emit('done', { ...info, ok: false, error: why });
      }
      this.wake();
    });
    this.handlers.add(settled);
    settled.finally(() => this.handlers.delete(settled));
  }

  async _finish() {
    const w = this.worker;
    const ids = this.done;
    this.done = [];
    /** @type {{ttlMs: number, values: Map<string, [Buffer, Buffer | null]>} | undefined} */
    let results;
    if (this.policy.resultTtlMs > 0) {
      const values = new Map();
      for (const id of ids) values.set(id, this.results.get(id) || [Buffer.alloc(0), null]);
      results = { ttlMs: this.policy.resultTtlMs, values };
    }
    try {
      await w.binding.finish(w.redis, this.gen.id, this.gen.incarnation, this.queue, ids, results);
    } catch (err) {
      this.done = ids.concat(this.done);
      throw err;
    }
    for (const id of ids) this.results.delete(id);
  }

  async _giveBackFailed() {
    const w = this.worker;
    const failed = this.failed;
    this.failed = [];
    try {
      await w.binding.giveBack(w.redis, this.gen.id, this.queue, failed.map((f) => f[0]), {
        mode: 'fail', backoffMs: this.policy.backoffMs, backoffCapMs: this.policy.backoffMaxMs,
        errors: failed.map((f) => f[1]),
      });
    } catch (err) {
      this.failed = failed.concat(this.failed);
      throw err;
    }
  }

  async _giveBackReturned() {
    const w = this.worker;
    const ids = this.returned;
    this.returned = [];
    try {
      await w.binding.giveBack(w.redis, this.gen.id, this.queue, ids, { mode: 'return' });
    } catch (err) {
      this.returned = ids.concat(this.returned);
      throw err;
    }
  }

  async _rebalance() {
    const w = this.worker;
    const n = Math.min(this.pull, this.free);
    this.pull = 0;
    if (n <= 0) return;
    const reply = await w.binding.rebalance(w.redis, this.gen.id, this.gen.incarnation, this.queue, n,
      Math.max(3 * Math.round(w.timing.ttl * 1000), 2000), this.servers);
    this.servers = reply.servers;
    this.fruitless = reply.marked ? null : `${reply.held}/${reply.total}/${reply.capacityTotal}`;
  }

  /**
   * Make what runs here agree with what Redis holds for this worker on the
   * queue: held but not run here (a lost claim reply) is handed back; run here
   * but no longer held (lost by Redis) is cancelled.
   */
  async _resync() {
    const w = this.worker;
    const members = await w.redis.smembers(w.keys.held(this.gen.id, this.queue));
    const held = new Set(members);
    const ours = new Set([...this.running.keys(), ...this.done, ...this.failed.map((f) => f[0]),
      ...this.returned]);
    const lost = members.filter((pid) => !ours.has(pid)).sort();
    if (lost.length) {
      await w.binding.giveBack(w.redis, this.gen.id, this.queue, lost, { mode: 'return' });
      w._log('info', `queue ${this.queue}: handed back ${lost.length} processes whose claim reply was lost`);
    }
    for (const [pid, slot] of this.running) {
      if (!held.has(pid)) {
        w._log('warn', `queue ${this.queue}: process ${pid} is no longer held in Redis; cancelling it`);
        this._abort(slot, 'cancelled');
      }
    }
    this.resyncNeeded = false;
    this.maybeWork = true;
  }
}

/**
 * @typedef {object} Policy
 * @property {number} maxAttempts  one-shot tasks: dead-lettered after this many failed attempts (0: never)
 * @property {number} backoffMs
 * @property {number} backoffMaxMs
 * @property {number} resultTtlMs  > 0: results are kept that long (finish_results.lua)
 * @property {number} timeoutMs    > 0: a handler running longer fails its attempt
 * @property {number} rateLimit    > 0: claims per ratePeriodMs across the mesh
 * @property {number} ratePeriodMs
 */

/**
 * A queue's policy from its JSON (`{ns}:policy`), with the Python peers' defaults.
 * @param {string | null} json
 * @returns {Policy}
 */
function parsePolicy(json) {
  /** @type {Record<string, unknown>} */
  let p = {};
  try { p = json ? JSON.parse(json) : {}; } catch { p = {}; }
  /** @param {string} k @param {number} d */
  const int = (k, d) => (typeof p[k] === 'number' ? /** @type {number} */ (p[k]) : d);
  return {
    maxAttempts: int('max_attempts', 5),
    backoffMs: int('backoff_ms', 1000),
    backoffMaxMs: int('backoff_max_ms', 60000),
    resultTtlMs: int('result_ttl_ms', 0),
    timeoutMs: int('timeout_ms', 0),
    rateLimit: int('rate_limit', 0),
    ratePeriodMs: int('rate_period_ms', 1000),
  };
}

/** @param {unknown} value @returns {Buffer | null} */
function resultBytes(value) {
  if (value === undefined || value === null) return null;
  if (typeof value === 'string') return Buffer.from(value, 'utf8');
  if (value instanceof Uint8Array) return Buffer.from(value);
  return null;
}

/**
 * How many tasks to ask peers for (rebalance.lua): 0 unless the worker holds
 * at most its share - 1 (by weight) and nothing is ready to claim; else its
 * deficit, at most 20 and 10% of the total weight (at least 1).
 * @param {QueueBeat} beat
 */
function pullCount(beat) {
  if (beat.state === 0 || beat.total <= 0) return 0;
  const deficit = (beat.total * beat.capacity) / Math.max(1, beat.capacityTotal) - beat.weight;
  if (deficit < 1) return 0;
  const limit = Math.max(1, Math.min(20, Math.ceil(0.1 * beat.total)));
  return Math.min(Math.floor(deficit), limit);
}

module.exports = { Runner, parsePolicy, pullCount, describeError };
