'use strict';
/**
 * The client: put work into a namespace and follow it (enqueue, ensure,
 * cancel, reconcile, await a result). Needs no worker.
 */
const Redis = require('ioredis').default;
const { Keys, checkQueue, checkGroup, payloadBytes, rawBytes } = require('./keys');
const { Binding } = require('./binding');
const { DeadLetterError, ConflictError } = require('./errors');
const { BLOB_MIN, standin, stored } = require('./blob');

// result(): the queue's awaiting key (finish publishes done messages only
// while it exists) lives this long and is renewed this often while waiting
const AWAITING_TTL_MS = 10000;
const AWAITING_REFRESH_MS = 1000;

/** @typedef {string | Buffer | Uint8Array} Task */

/**
 * @param {string | import('ioredis').Redis} redis a URL or a connection
 * @returns {{redis: import('ioredis').Redis, owned: boolean}}
 */
function connect(redis) {
  if (typeof redis === 'string') {
    return { redis: new Redis(redis, { maxRetriesPerRequest: null, lazyConnect: false }), owned: true };
  }
  return { redis, owned: false };
}

class Client {
  /**
   * @param {{redis: string | import('ioredis').Redis, namespace: string}} options
   *   redis: a redis:// URL (the client opens and closes its connection) or an
   *   ioredis connection (left open by close()).
   * @throws {TypeError} a bad namespace
   */
  constructor(options) {
    this.keys = new Keys(options.namespace);
    this.binding = new Binding(this.keys);
    const c = connect(options.redis);
    this.redis = c.redis;
    this._owned = c.owned;
    // ioredis reconnects by itself; a call during an outage waits or fails
    if (c.owned) this.redis.on('error', () => {});
    /** @type {import('ioredis').RedisOptions} */
    this._options = { ...this.redis.options };
  }

  /**
   * Append one-shot tasks to `queue`.
   * @param {string} queue
   * @param {Task | Task[]} tasks
   * @param {{priority?: number, delayMs?: number, atMs?: number, group?: string}} [options]
   *   priority 0..9 (higher first); delayMs: due that many ms from now (Redis
   *   clock); atMs: due at that time (ms since the epoch, Redis clock; with a
   *   group only); group: put them at the back of this group of the queue
   *   (workers take turns among the groups with jobs ready, and the group's
   *   settings cap its jobs across the mesh: configureGroup); with a priority,
   *   the group's higher ones start first.
   * @returns {Promise<number>} the queue's length afterwards (with a priority: the
   *   number of prioritized tasks; with a group: the group's length; with a
   *   delay: how many were newly delayed)
   * @throws {import('./errors').ConflictError} a payload is a persistent task of the queue
   * @throws {TypeError} a bad queue or group name or priority (nothing written)
   */
  async enqueue(queue, tasks, options = {}) {
    checkQueue(queue);
    const payloads = (Array.isArray(tasks) ? tasks : [tasks]).map(payloadBytes);
    const priority = options.priority ?? 0;
    if (!Number.isInteger(priority) || priority < 0 || priority > 9) {
      throw new TypeError(`priority must be a whole number from 0 to 9, got ${priority}`);
    }
    if (options.group !== undefined) return this._enqueueGroup(queue, payloads, options);
    if (options.atMs !== undefined) throw new TypeError('atMs needs a group (use delayMs without one)');
    if (payloads.length === 0) return 0;
    if (options.delayMs !== undefined && options.delayMs > 0) {
      const ms = Math.round(options.delayMs);
      return this._withBlobs(payloads, async (ps) => (await this.binding.delay(this.redis, queue, ps, ms, priority)).added);
    }
    return this._withBlobs(payloads, (ps) => this.binding.enqueue(this.redis, queue, ps, priority));
  }

  /**
   * `call` with what the queue holds for `payloads`: those longer than 1 MiB
   * (BLOB_MIN) are uploaded first and passed as stand-ins (src/blob.js). An
   * upload that expired before the call (its CONFLICT says so) is made again, once.
   * @template T
   * @param {Buffer[]} payloads @param {(ps: Buffer[]) => Promise<T>} call
   * @returns {Promise<T>}
   */
  async _withBlobs(payloads, call) {
    if (!payloads.some((p) => p.length > BLOB_MIN)) return call(payloads);
    const stored = payloads.map(standin);
    for (let again = false; ; again = true) {
      await this.binding.putBlobs(this.redis, payloads);
      try {
        return await call(stored);
      } catch (err) {
        if (again || !(err instanceof ConflictError) || !err.message.includes('blob is gone')) throw err;
      }
    }
  }

  /**
   * enqueue() into a group: enqueue_group.lua.
   * @param {string} queue @param {Buffer[]} payloads
   * @param {{priority?: number, delayMs?: number, atMs?: number, group?: string}} options
   * @returns {Promise<number>}
   */
  async _enqueueGroup(queue, payloads, options) {
    const group = checkGroup(options.group);
    for (const [name, v] of [['delayMs', options.delayMs], ['atMs', options.atMs]]) {
      if (v !== undefined && (!Number.isInteger(v) || /** @type {number} */ (v) < 0)) {
        throw new TypeError(`${name} must be a whole number of ms >= 0, got ${v}`);
      }
    }
    if (payloads.length === 0) return 0;
    /** @type {{in?: number, at?: number} | undefined} */
    let when;
    if (options.atMs !== undefined) when = { at: options.atMs };
    else if (options.delayMs) when = { in: options.delayMs };
    return this._withBlobs(payloads,
      async (ps) => (await this.binding.enqueueGroup(this.redis, queue, group, ps, when, options.priority ?? 0)).count);
  }

  /**
   * Set the settings of `group` of `queue` (group "" : the queue's default for
   * every group); those not given keep their stored value. They hold across
   * the mesh from the next claim on.
   * @param {string} queue @param {string} group
   * @param {{concurrency?: number, rateLimit?: number, ratePeriodMs?: number, weight?: number}} settings
   *   concurrency: at most this many of its jobs run at once on all workers (0:
   *   no cap; 1 keeps its jobs in strict order); rateLimit per ratePeriodMs
   *   (default 1000) jobs started (0: none); weight 1..1000 (its share of the
   *   claims while other groups have jobs ready)
   * @returns {Promise<string>} the settings stored, "concurrency,rate,period_ms,weight"
   *   (an empty field: the default's)
   * @throws {TypeError} a bad queue or group name (nothing written)
   * @throws {import('./errors').CommandError} BAD_ARG: a value out of range (nothing written)
   */
  async configureGroup(queue, group, settings) {
    checkQueue(queue);
    if (group !== '') checkGroup(group);
    const f = (/** @type {number | undefined} */ v) => (v === undefined ? '' : String(v));
    const fields = [f(settings.concurrency), f(settings.rateLimit), f(settings.ratePeriodMs), f(settings.weight)];
    return /** @type {string} */ (await this.binding.configureGroup(this.redis, queue, group, 'set', fields));
  }

  /**
   * Remove the settings of `group` ("": the queue's default): it follows the
   * queue's default again.
   * @param {string} queue @param {string} group
   * @throws {TypeError} a bad queue or group name
   */
  async clearGroup(queue, group) {
    checkQueue(queue);
    if (group !== '') checkGroup(group);
    await this.binding.configureGroup(this.redis, queue, group, 'clear', []);
  }

  /**
   * Pause `group` of `queue`: no worker starts a job of it until resumeGroup;
   * its running jobs go on, enqueues still add to it.
   * @param {string} queue @param {string} group
   * @returns {Promise<boolean>} false if it was paused already
   * @throws {TypeError} a bad queue or group name
   */
  async pauseGroup(queue, group) {
    checkQueue(queue);
    return this.binding.pauseGroup(this.redis, queue, checkGroup(group), 'pause');
  }

  /**
   * Resume a paused group (idle workers of the queue are woken).
   * @param {string} queue @param {string} group
   * @returns {Promise<boolean>} false if it was not paused
   * @throws {TypeError} a bad queue or group name
   */
  async resumeGroup(queue, group) {
    checkQueue(queue);
    return this.binding.pauseGroup(this.redis, queue, checkGroup(group), 'resume');
  }

  /**
   * Make each task a persistent task of `queue` (unique per queue and payload):
   * it runs on exactly one worker until cancelled, and moves on when that
   * worker dies or leaves.
   * @param {string} queue
   * @param {Task | Task[]} tasks
   * @param {{weight?: number}} [options] its part of the fair share (1..1000000)
   * @returns {Promise<number>} how many were added (the others existed already)
   * @throws {import('./errors').ConflictError} a payload is queued as a one-shot task
   */
  async ensure(queue, tasks, options = {}) {
    checkQueue(queue);
    const payloads = (Array.isArray(tasks) ? tasks : [tasks]).map(payloadBytes);
    if (payloads.length === 0) return 0;
    const flags = await this._withBlobs(payloads, (ps) => this.binding.ensure(this.redis, queue, ps, options.weight ?? 1));
    return flags.filter(Boolean).length;
  }

  /**
   * Cancel a task by payload anywhere in the mesh: queued and delayed copies
   * are removed, it stops being a persistent task, and every running process of
   * it is cancelled (durably: through its worker's inbox). The copies queued
   * in a group (or waiting there for a delay or a retry) are removed when
   * `options.group` names it; a running one is cancelled whatever its group.
   * @param {string} queue
   * @param {Task} task
   * @param {{group?: string}} [options]
   * @returns {Promise<number>} queued copies removed plus processes cancelled (0: not found)
   * @throws {TypeError} a bad queue or group name
   */
  async cancel(queue, task, options = {}) {
    checkQueue(queue);
    const group = options.group === undefined ? null : checkGroup(options.group);
    // a big payload: as the queue holds it (src/blob.js)
    const [queued, running] = await this.binding.cancel(this.redis, queue, stored(rawBytes(task)), group);
    return queued + running;
  }

  /**
   * Make `task` a periodic task of `queue`: every `everyMs` (Redis clock, the
   * first tick one period from now) one one-shot copy is enqueued, exactly
   * once across the mesh (any worker fires it). Unique per (queue, task):
   * scheduling it again replaces its period.
   * @param {string} queue @param {Task} task @param {{everyMs: number}} options
   * @returns {Promise<boolean>} true if new, false if it replaced a schedule
   * @throws {RangeError} everyMs is not a whole number >= 1, or a payload over
   *   1 MiB (a schedule keeps its payload inline; nothing written)
   */
  async schedule(queue, task, options) {
    checkQueue(queue);
    const payload = payloadBytes(task);
    if (payload.length > BLOB_MIN) {
      throw new RangeError(`a schedule's payload is at most ${BLOB_MIN} bytes (1 MiB), not ${payload.length}: schedule a small key to the data instead`);
    }
    const ms = options.everyMs;
    if (!Number.isInteger(ms) || ms < 1) throw new RangeError(`everyMs must be a whole number >= 1, got ${ms}`);
    const [added] = await this.binding.schedule(this.redis, queue, payload, `every ${ms}`);
    return added;
  }

  /**
   * Set fields of `queue`'s policy, which every worker serving it applies
   * within a heartbeat interval; fields not given keep their value.
   * @param {string} queue
   * @param {Record<string, number>} fields  the policy's own names (protocol/README.md,
   *   "Keys": `max_attempts`, `backoff_ms`, `backoff_max_ms`, `timeout_ms`,
   *   `result_ttl_ms`, `rate_limit`, `rate_period_ms`, `enqueue_times` (0 or 1: keep each
   *   one-shot job's first enqueue time in `{ns}:enqt:<Q>`)), whole numbers
   * @returns {Promise<Record<string, unknown>>} the policy stored now
   * @throws {import('./errors').CommandError} BAD_ARG: an unknown field or a bad value (nothing written)
   */
  async configure(queue, fields) {
    checkQueue(queue);
    const args = Object.entries(fields).flat();
    const raw = await this.binding.configure(this.redis, queue, 'set', 'configure', args);
    return JSON.parse(/** @type {string} */ (raw));
  }

  /**
   * The persistent tasks of `queue`: payload (as a Buffer) -> id of the process
   * that runs it, or null while it waits.
   * @param {string} queue
   * @returns {Promise<Map<string, string | null>>} keyed by the payload as UTF-8 text
   */
  async persistentTasks(queue) {
    checkQueue(queue);
    const k = this.keys;
    const res = /** @type {[Error | null, any][]} */ (await this.redis.multi()
      .hgetallBuffer(k.persistent(queue)).smembersBuffer(k.standby(queue)).exec());
    /** @type {Map<string, string | null>} */
    const out = new Map();
    for (const m of res[1][1]) out.set(m.toString('utf8'), null);
    const running = /** @type {Record<string, Buffer>} */ (res[0][1]);
    for (const [field, value] of Object.entries(running)) {
      out.set(field, value.length ? value.toString() : null);
    }
    return out;
  }

  /**
   * Make the persistent tasks of `queue` exactly `tasks`: ensure the missing
   * ones, cancel the others wherever they run. Each step is atomic, the whole
   * is not; safe to repeat.
   * @param {string} queue
   * @param {Task[]} tasks
   * @param {{weight?: number}} [options]
   * @returns {Promise<{added: string[], cancelled: string[]}>} payloads as UTF-8 text
   */
  async reconcile(queue, tasks, options = {}) {
    checkQueue(queue);
    const want = [...new Map(tasks.map((t) => {
      const b = payloadBytes(t);
      return [b.toString('latin1'), b];
    })).values()];
    const have = await this.persistentTasks(queue);
    // the queue holds a big payload's stand-in (src/blob.js): compared so
    const wanted = new Set(want.map((b) => standin(b).toString('utf8')));
    /** @type {string[]} */
    const added = [];
    if (want.length) {
      const flags = await this._withBlobs(want, (ps) => this.binding.ensure(this.redis, queue, ps, options.weight ?? 1));
      want.forEach((b, i) => { if (flags[i]) added.push(b.toString('utf8')); });
    }
    /** @type {string[]} */
    const cancelled = [];
    for (const p of [...have.keys()].sort()) {
      if (wanted.has(p)) continue;
      const [q, r] = await this.binding.cancel(this.redis, queue, Buffer.from(p, 'utf8'));
      if (q + r > 0) cancelled.push(p);
    }
    return { added, cancelled };
  }

  /**
   * The latest outcome of `task`: its kept result, or its latest dead letter,
   * whichever is later; undefined if neither exists.
   * @param {string} queue @param {Buffer} payload
   * @returns {Promise<{value: Buffer | null} | {dead: {attempts: number, error: string,
   *   worker: string, when: number}} | undefined>}
   */
  async _outcome(queue, payload) {
    const k = this.keys;
    const res = /** @type {[Error | null, any][]} */ (await this.redis.multi()
      .getBuffer(k.result(queue, payload)).lrangeBuffer(k.dead(queue), 0, -1).exec());
    const rec = /** @type {Buffer | null} */ (res[0][1]);
    /** @type {{when: number, value: Buffer | null} | undefined} */
    let result;
    if (rec) {
      const parts = splitN(rec, 4);
      if (parts.length === 5 && ['v', 'n'].includes(parts[0].toString())) {
        const size = Number(parts[3].toString());
        const rest = parts[4];
        if (rest.subarray(size).equals(payload)) {
          result = { when: Number(parts[1].toString()), value: parts[0].toString() === 'v' ? rest.subarray(0, size) : null };
        }
      }
    }
    /** @type {{attempts: number, error: string, worker: string, when: number} | undefined} */
    let dead;
    for (const raw of /** @type {Buffer[]} */ (res[1][1])) {
      // when \0 attempts \0 worker \0 error \0 kind \0 payload (protocol 10)
      const parts = splitN(raw, 5);
      if (parts.length === 6 && parts[5].equals(payload)) {
        dead = { when: Number(parts[0].toString()), attempts: Number(parts[1].toString()),
          worker: parts[2].toString(), error: parts[3].toString() };
      }
    }
    if (dead && (!result || dead.when >= result.when)) return { dead };
    if (result) return { value: result.value };
    return undefined;
  }

  /**
   * Wait for the outcome of the latest finished instance of `task` on `queue`,
   * a queue whose policy keeps results (result_ttl_ms), and return what its
   * handler returned (a Buffer, or null). Listens on the queue's done channel
   * and checks again after 50 ms, 100 ms, ... up to every second. While it
   * waits it keeps the queue's awaiting key ({ns}:awaiting:<Q>, SET PX
   * 10000, renewed every second): workers publish done messages only while
   * it exists (protocol/README.md, "Done messages only while awaited").
   * @param {string} queue
   * @param {Task} task
   * @param {{timeoutMs?: number}} [options] no timeout: wait for ever
   * @returns {Promise<Buffer | null>}
   * @throws {DeadLetterError} the latest outcome is a dead letter
   * @throws {Error} with code 'TIMEOUT': no outcome within timeoutMs
   */
  async result(queue, task, options = {}) {
    checkQueue(queue);
    const payload = stored(rawBytes(task)); // a big one's records hold its stand-in
    const deadline = options.timeoutMs === undefined ? Infinity : Date.now() + options.timeoutMs;
    const unwrap = (/** @type {any} */ got) => {
      if (got.dead) {
        throw new DeadLetterError(
          `the task was dead-lettered after ${got.dead.attempts} attempts: ${got.dead.error || 'failed'}`, got.dead);
      }
      return got.value;
    };
    let got = await this._outcome(queue, payload);
    if (got) return unwrap(got);
    const sub = new Redis({ ...this._options, lazyConnect: false });
    sub.on('error', () => {});
    /** @type {(() => void) | null} */
    let poke = null;
    const onMessage = (/** @type {any} */ _ch, /** @type {Buffer} */ msg) => {
      if (msg.equals(payload) && poke) poke();
    };
    sub.on('messageBuffer', onMessage);
    sub.on('smessageBuffer', onMessage);
    try {
      const channel = this.keys.doneChannel(queue);
      await sub.subscribe(channel);
      try { await sub.ssubscribe(channel); } catch { /* before Redis 7: PUBLISH only */ }
      // finish publishes done messages only while this key exists: set after
      // subscribing, renewed while waiting, left to expire
      const awaiting = this.keys.awaiting(queue);
      await this.redis.set(awaiting, '', 'PX', AWAITING_TTL_MS);
      let marked = Date.now();
      let wait = 50;
      for (;;) {
        // checked after subscribing and marking: a finish before it is seen
        // here, one after it is published
        got = await this._outcome(queue, payload);
        if (got) return unwrap(got);
        const now = Date.now();
        if (now - marked >= AWAITING_REFRESH_MS) {
          await this.redis.set(awaiting, '', 'PX', AWAITING_TTL_MS);
          marked = now;
        }
        if (now >= deadline) {
          const err = new Error(`no outcome of the task on queue ${queue} within ${options.timeoutMs} ms`);
          Object.assign(err, { code: 'TIMEOUT' });
          throw err;
        }
        await new Promise((resolve) => {
          const t = setTimeout(resolve, Math.min(wait, deadline - now));
          poke = () => { clearTimeout(t); resolve(undefined); };
        });
        poke = null;
        wait = Math.min(wait * 2, 1000);
      }
    } finally {
      sub.disconnect();
    }
  }

  /** Close the connection if the client opened it. */
  async close() {
    if (this._owned) await this.redis.quit().catch(() => this.redis.disconnect());
  }
}

/**
 * Split `buf` at its first `n` NUL bytes.
 * @param {Buffer} buf @param {number} n
 * @returns {Buffer[]}
 */
function splitN(buf, n) {
  const out = [];
  let pos = 0;
  for (let i = 0; i < n; i++) {
    const j = buf.indexOf(0, pos);
    if (j < 0) break;
    out.push(buf.subarray(pos, j));
    pos = j + 1;
  }
  out.push(buf.subarray(pos));
  return out;
}

module.exports = { Client, connect };
