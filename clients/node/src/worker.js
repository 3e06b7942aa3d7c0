'use strict';
/**
 * A worker peer: joins the mesh under a lease (register.lua), renews it
 * (heartbeat.lua every H = T/3), stops every handler itself when no heartbeat
 * was confirmed for R = 2T/3 and rejoins under a new id, serves queues
 * (one Runner each), hears wakes and cancels on its own channels (and the
 * cancels again in every heartbeat's inbox), recycles dead peers (reap_check,
 * recycle mode "dead"), and leaves gracefully: drain, stop every handler,
 * hand each process back once its handler exited, then recycle mode "leave".
 * It also fires the due ticks of periodic tasks (fire.lua, every H) and sends
 * what its handlers did to the per-minute counts (stats.lua, every 5 s): see
 * periodic.js; the reaper is reaper.js.
 */
const os = require('node:os');
const crypto = require('node:crypto');
const { EventEmitter } = require('node:events');
const Redis = require('ioredis').default;
const { Keys, checkQueue, checkWorkerId } = require('./keys');
const { Binding } = require('./binding');
const { Runner, parsePolicy } = require('./runner');
const { FencedError } = require('./errors');
const { Periodic } = require('./periodic');
const { Reaper } = require('./reaper');

/** @typedef {import('./runner').Handler} Handler */

/** @param {number} ms */
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** One identity of the worker: an id and an incarnation, never reused after a fence. */
class Generation {
  /** @param {string} id */
  constructor(id) {
    this.id = id;
    this.incarnation = crypto.randomBytes(8).toString('hex');
    /** @type {Map<string, Runner>} */
    this.runners = new Map();
    this.fenced = false;
    /** Retiring (recycle mode "leave" on a stop): a FENCED reply from now on is no fence. */
    this.leaving = false;
    /** @type {string | null} */ this.fenceReason = null;
    /** Cancels of process ids no runner knew yet (a claim reply on its way) -> when heard.
     * @type {Map<string, number>} */
    this.earlyCancels = new Map();
    /** Cancels seen, acknowledged by the next heartbeat. @type {string[]} */
    this.acks = [];
    /** When the last confirmed heartbeat was sent (ms, this process's clock). */
    this.confirmedSent = 0;
    /** @type {NodeJS.Timeout | null} */ this.fenceTimer = null;
    this.spread = 0.5;
  }
}

/**
 * @typedef {object} WorkerOptions
 * @property {string | import('ioredis').RedisOptions} redis  a redis:// URL or ioredis options
 * @property {string} namespace
 * @property {number} [ttl]        lease TTL T in seconds (default 10)
 * @property {number} [interval]   heartbeat interval H (default T/3)
 * @property {number} [fenceAfter] self-fence R (default 2T/3)
 * @property {string} [id]         worker id (default host-pid-random)
 * @property {(level: string, message: string) => void} [log]  default: warnings to stderr
 * @property {number} [maxAttempts]  a queue's policy if it has none: attempts of a one-shot task (default 5)
 * @property {number} [backoff]      ... and the first retry delay in s (default 1)
 * @property {number} [backoffMax]   ... and the longest retry delay in s (default 60)
 * @property {number} [stopGrace]    stop(): how long to wait for handlers to exit, in s (default 10)
 * @property {string} [protocolVersion]  the version to register with (tests of the refusal only)
 */

/**
 * Events: 'start' {queue, task, token, worker, persistent, group}, 'stop' {..., reason}
 * ('cancelled' | 'moved' | 'stopped' | 'fenced' | 'timeout', the last a failed
 * attempt with its error), 'done' {..., ok, error?},
 * 'fenced' {worker, reason}, 'rejoined' {worker, previous}.
 */
class Worker extends EventEmitter {
  /** @param {WorkerOptions} options */
  constructor(options) {
    super();
    const ttl = options.ttl ?? 10;
    const h = options.interval ?? ttl / 3;
    const r = options.fenceAfter ?? (2 * ttl) / 3;
    if (!(h >= 0.01 && h < r && r < ttl)) {
      throw new TypeError(`lease timing must satisfy 0.01 s <= interval < fenceAfter < ttl; got ${h}, ${r}, ${ttl}`);
    }
    this.timing = { ttl, interval: h, fenceAfter: r };
    this.keys = new Keys(options.namespace);
    this.binding = new Binding(this.keys, options.protocolVersion);
    /** @type {import('ioredis').RedisOptions} */
    const ropts = { maxRetriesPerRequest: null, enableAutoPipelining: false,
      // a half-open socket must not hold a fenced worker's hand-back for ever
      commandTimeout: Math.max(2 * ttl * 1000, 5000) };
    this.redis = typeof options.redis === 'string'
      ? new Redis(options.redis, ropts) : new Redis({ ...options.redis, ...ropts });
    this.sub = this.redis.duplicate();
    // ioredis reconnects by itself; an outage is reported by the heartbeat
    this.redis.on('error', (err) => this._log('debug', `redis: ${err.message}`));
    this.sub.on('error', (err) => this._log('debug', `redis (pub/sub): ${err.message}`));
    const host = os.hostname().replace(/[^A-Za-z0-9_.-]/g, '-').slice(0, 60) || 'host';
    this.baseId = checkWorkerId(options.id ?? `${host}-${process.pid}-${crypto.randomBytes(3).toString('hex')}`);
    this.gen = new Generation(this.baseId);
    /** @type {Map<string, {handler: Handler, concurrency: number, capacity: number}>} */
    this.queues = new Map();
    this._logFn = options.log ?? ((level, msg) => {
      if (level === 'warn' || level === 'error') process.stderr.write(`mesh ${level}: ${msg}\n`);
    });
    this.started = false;
    this.stopping = false;
    this.closed = false;
    /** @type {Promise<void> | null} */ this._hbLoop = null;
    /** @type {(() => void) | null} */ this._hbWake = null;
    this.reaper = new Reaper(this);
    this.periodic = new Periodic(this);
    /** @type {Promise<void> | null} */ this._rejoining = null;
    this._ttlMs = Math.round(ttl * 1000);
    this._defaults = ['max_attempts', options.maxAttempts ?? 5,
      'backoff_ms', Math.round((options.backoff ?? 1) * 1000),
      'backoff_max_ms', Math.round((options.backoffMax ?? 60) * 1000)];
    this._stopGraceMs = (options.stopGrace ?? 10) * 1000;
    /** @type {NodeJS.Timeout | null} */ this._pinger = null;
  }

  /**
   * Count one handler outcome of `queue` for the per-minute counts.
   * @param {string} queue @param {boolean} ok finished (true) or failed
   */
  count(queue, ok) { this.periodic.count(queue, ok); }

  /** Send the per-minute counts gathered since the last report (see periodic.js). */
  reportCounts() { return this.periodic.reportCounts(); }

  /** Fire the due ticks of periodic tasks (see periodic.js). */
  fireDue() { return this.periodic.fireDue(); }

  /** Recycle every worker whose lease ran out; returns how many (see reaper.js). */
  reapOnce() { return this.reaper.reapOnce(); }

  /** The current worker id (a new one after every fence). */
  get id() { return this.gen.id; }

  /** @param {string} level @param {string} msg */
  _log(level, msg) { this._logFn(level, msg); }

  /**
   * Serve `queue` with `handler` (before or after start()).
   * @param {string} queue
   * @param {Handler} handler
   * @param {{concurrency?: number, capacity?: number}} [options]
   */
  async serve(queue, handler, options = {}) {
    checkQueue(queue);
    const spec = { handler, concurrency: options.concurrency ?? 1, capacity: options.capacity ?? 1 };
    this.queues.set(queue, spec);
    if (this.started && !this.gen.fenced) await this._serveIn(this.gen, queue);
  }

  /**
   * @param {Generation} gen @param {string} queue
   */
  async _serveIn(gen, queue) {
    const spec = /** @type {{handler: Handler, concurrency: number, capacity: number}} */ (this.queues.get(queue));
    // the worker's options become the queue's policy only if it has none
    const policy = parsePolicy(await this.binding.configure(this.redis, queue, 'default', `worker ${gen.id}`,
      this._defaults));
    await this.binding.serve(this.redis, gen.id, gen.incarnation, queue, spec.capacity);
    if (gen.runners.has(queue)) return;
    const runner = new Runner(this, gen, queue, spec.handler,
      { concurrency: spec.concurrency, capacity: spec.capacity, policy });
    gen.runners.set(queue, runner);
    runner.start();
  }

  /**
   * Join the mesh and start serving the queues given so far. On an error the
   * worker's connections are closed and it cannot be started again.
   * @throws {import('./errors').VersionError} the namespace holds another protocol version
   * @throws {import('./errors').DuplicateWorkerError} the id is live or not yet recycled
   */
  async start() {
    if (this.started) return;
    this.sub.on('messageBuffer', (ch, msg) => this._onMessage(ch.toString(), msg.toString()));
    this.sub.on('smessageBuffer', (ch, msg) => this._onMessage(ch.toString(), msg.toString()));
    const db = this.redis.options.db ?? 0;
    this._expired = `__keyevent@${db}__:expired`;
    try {
      await this.sub.subscribe(this._expired);
      await this._join(this.gen);
    } catch (err) {
      // nothing was joined (register refused, or Redis unreachable): close up
      if (this.gen.fenceTimer) clearTimeout(this.gen.fenceTimer);
      for (const r of this.gen.runners.values()) r.fence();
      this.closed = true;
      this.sub.disconnect();
      this.redis.disconnect();
      throw err;
    }
    this.started = true;
    this._hbLoop = this._heartbeatLoop();
    this.reaper.start();
    this.periodic.start();
    this._pinger = setInterval(() => this._pingSub(), Math.min(Math.max(1000, this._ttlMs), 30000));
  }

  /** A dead pub/sub link is found by a ping (ioredis reconnects and subscribes again). */
  _pingSub() {
    const period = Math.min(Math.max(1000, this._ttlMs), 30000);
    withTimeout(this.sub.ping(), period).catch(() => {
      if (!this.closed) this.sub.disconnect(true);
    });
  }

  /** @param {Generation} gen */
  async _join(gen) {
    const info = JSON.stringify({ host: os.hostname(), pid: process.pid, lang: 'node' });
    const sent = Date.now();
    await this.binding.register(this.redis, gen.id, gen.incarnation, this._ttlMs, info);
    gen.confirmedSent = sent;
    this._armFence(gen);
    const channels = [this.keys.cancelChannel(gen.id), this.keys.wakeChannel(gen.id)];
    await this.sub.subscribe(...channels);
    try { await this.sub.ssubscribe(...channels); } catch { /* before Redis 7.0: PUBLISH only */ }
    for (const q of this.queues.keys()) await this._serveIn(gen, q);
  }

  /** @param {string} ch @param {string} msg */
  _onMessage(ch, msg) {
    const k = this.keys;
    const gen = this.gen;
    if (ch === this._expired) {
      if (msg.startsWith(`${k.prefix}worker:`)) this.reaper.heardExpiry();
      return;
    }
    if (ch === k.wakeChannel(gen.id)) {
      const r = gen.runners.get(msg);
      if (r) r.nudge();
    } else if (ch === k.cancelChannel(gen.id)) {
      this._cancel(gen, msg);
    }
  }

  /** @param {Generation} gen @param {string} pid */
  _cancel(gen, pid) {
    for (const r of gen.runners.values()) if (r.cancelProcess(pid)) return;
    gen.earlyCancels.set(pid, Date.now());
  }

  /** (Re)arm the self-fence timer at the last confirmed send + R. @param {Generation} gen */
  _armFence(gen) {
    if (gen.fenceTimer) clearTimeout(gen.fenceTimer);
    const at = gen.confirmedSent + this.timing.fenceAfter * 1000;
    gen.fenceTimer = setTimeout(() => {
      this._fence(gen, `no heartbeat confirmed within ${this.timing.fenceAfter} s`);
    }, Math.max(0, at - Date.now()));
  }

  /**
   * Stop every handler of `gen` (reported as 'fenced'), retire the id and
   * rejoin under a new one (unless stopping).
   * @param {Generation} gen @param {string} reason
   */
  _fence(gen, reason) {
    if (gen.fenced || gen.leaving || this.closed) return;
    gen.fenced = true;
    gen.fenceReason = reason;
    if (gen.fenceTimer) clearTimeout(gen.fenceTimer);
    for (const r of gen.runners.values()) r.fence();
    this._log('warn', `worker ${gen.id} fenced (${reason}); its processes were stopped; rejoining`);
    this.emit('fenced', { worker: gen.id, reason });
    if (this._hbWake) this._hbWake();
    this._rejoining = this._rejoin(gen);
  }

  /** @param {Generation} old */
  async _rejoin(old) {
    // every handler exited (bounded by T: by then peers may take over anyway)
    await Promise.race([Promise.allSettled([...old.runners.values()].map((r) => r.loopDone)),
      sleep(this._ttlMs)]);
    await this._retire(old);
    const channels = [this.keys.cancelChannel(old.id), this.keys.wakeChannel(old.id)];
    await this.sub.unsubscribe(...channels).catch(() => {});
    await this.sub.sunsubscribe(...channels).catch(() => {});
    let backoff = 50;
    while (!this.closed && !this.stopping) {
      const gen = new Generation(`${this.baseId}.${crypto.randomBytes(3).toString('hex')}`);
      try {
        this.gen = gen;
        await this._join(gen);
        this._log('info', `worker ${old.id} rejoined the mesh as ${gen.id}`);
        this.emit('rejoined', { worker: gen.id, previous: old.id });
        if (this._hbWake) this._hbWake();
        return;
      } catch (err) {
        gen.fenced = true;
        if (gen.fenceTimer) clearTimeout(gen.fenceTimer);
        for (const r of gen.runners.values()) r.fence();
        this._log('warn', `worker ${old.id} could not rejoin yet (${err instanceof Error ? err.message : err})`);
        await sleep(backoff);
        backoff = Math.min(backoff * 2, this.timing.interval * 1000);
      }
    }
  }

  /** Hand back what `gen` still holds and remove it (recycle mode "leave"). @param {Generation} gen */
  async _retire(gen) {
    const until = Date.now() + this._ttlMs;
    let backoff = 50;
    while (Date.now() < until) {
      try {
        const r = await this.binding.recycle(this.redis, [gen.id], 'leave', gen.incarnation, [...this.queues.keys()]);
        if (r.returned) this._log('info', `worker ${gen.id} handed back ${r.returned} processes`);
        return;
      } catch (err) {
        if (err instanceof FencedError) return;
        await sleep(backoff);
        backoff = Math.min(backoff * 2, 1000);
      }
    }
  }

  async _heartbeatLoop() {
    const t = this.timing;
    while (!this.closed) {
      const gen = this.gen;
      if (gen.fenced || gen.leaving) {
        await new Promise((resolve) => {
          this._hbWake = () => resolve(undefined);
          setTimeout(resolve, 50);
        });
        this._hbWake = null;
        continue;
      }
      const sent = Date.now();
      const queues = [...gen.runners.keys()];
      /** @type {number} */
      let next;
      try {
        const reply = await withTimeout(this.binding.heartbeat(this.redis, gen.id, gen.incarnation,
          this._ttlMs, gen.acks, queues), t.fenceAfter * 1000);
        if (gen.fenced || this.closed) continue;
        if (Date.now() > sent + t.fenceAfter * 1000) {
          // confirmed, but too late to count: handlers may have run past R already
          this._fence(gen, `no heartbeat confirmed within ${t.fenceAfter} s`);
          continue;
        }
        gen.confirmedSent = sent;
        this._armFence(gen);
        gen.acks = reply.inbox;
        for (const pid of reply.inbox) this._cancel(gen, pid);
        for (const [pid, at] of gen.earlyCancels) if (at < sent - this._ttlMs) gen.earlyCancels.delete(pid);
        queues.forEach((q, i) => {
          const r = gen.runners.get(q);
          if (r) r.onHeartbeat(reply.beats[i]);
        });
        if (reply.nextDeadlineMs <= 0) this.reaper.deadlinePassed(-reply.nextDeadlineMs / 1000);
        if (queues.length) this._refreshPolicies(gen, queues);
        next = sent + t.interval * 1000 * (1 - gen.spread * Math.random());
        gen.spread = 0.05;
      } catch (err) {
        if (err instanceof FencedError) {
          this._fence(gen, err.message);
          continue;
        }
        this._log('warn', `worker ${gen.id}: heartbeat failed: ${err instanceof Error ? err.message : err}; retrying`);
        next = Date.now() + Math.min(t.interval * 250, 250);
      }
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, Math.max(0, next - Date.now()));
        this._hbWake = () => { clearTimeout(timer); resolve(undefined); };
      });
      this._hbWake = null;
    }
  }

  /**
   * Re-read the queues' policies (`{ns}:policy`), which every serving worker
   * applies within a heartbeat interval; an error leaves the old ones.
   * @param {Generation} gen @param {string[]} queues
   */
  _refreshPolicies(gen, queues) {
    this.redis.hmget(this.keys.policy, ...queues).then((values) => {
      queues.forEach((q, i) => {
        const r = gen.runners.get(q);
        if (r) r.policy = parsePolicy(values[i]);
      });
    }, () => {});
  }

  // --- leaving --------------------------------------------------------------

  /**
   * Leave gracefully: drain each queue, stop every handler, hand each process
   * back once its handler exited (renewing the lease meanwhile), then retire
   * (recycle mode "leave") and close the connections.
   * @returns {Promise<boolean>} false if handlers were still running after the
   *   stop grace: then nothing more was handed back, the connections are
   *   closed, and peers take the rest over when the lease runs out.
   */
  async stop() {
    if (this.closed) return true;
    this.stopping = true;
    if (this._rejoining) await this._rejoining;
    const gen = this.gen;
    if (this.started && !gen.fenced) {
      for (const q of gen.runners.keys()) {
        try {
          await withTimeout(this.binding.drain(this.redis, gen.id, gen.incarnation, q), this.timing.interval * 1000);
        } catch { /* the stop goes on: the share catches up when the worker retires */ }
      }
      for (const r of gen.runners.values()) r.beginStop();
    }
    const graceOver = Symbol('grace');
    /** @type {NodeJS.Timeout | undefined} */
    let graceTimer;
    const outcome = await Promise.race([
      Promise.allSettled([...gen.runners.values()].map((r) => r.loopDone)),
      new Promise((resolve) => { graceTimer = setTimeout(() => resolve(graceOver), this._stopGraceMs); }),
    ]);
    clearTimeout(graceTimer);
    let clean = true;
    if (outcome === graceOver) {
      // never hand back a process whose handler may still run (invariant 10):
      // peers take these over once the lease runs out, as after a crash
      clean = false;
      this._log('warn', `worker ${gen.id}: handlers still running after the stop grace; `
        + 'peers take their tasks over when the lease runs out');
    } else if (this.started) {
      gen.leaving = true;
      await this._retire(gen);
    }
    this.closed = true;
    if (this._pinger) clearInterval(this._pinger);
    if (gen.fenceTimer) clearTimeout(gen.fenceTimer);
    if (this._hbWake) this._hbWake();
    this.reaper.close();
    this.periodic.close();
    await Promise.allSettled([this._hbLoop, this.reaper.loop, ...this.periodic.loops]);
    // the last counts (bounded: the connections close next)
    if (this.started) await withTimeout(this.reportCounts(), 250).catch(() => {});
    this.sub.disconnect();
    await this.redis.quit().catch(() => this.redis.disconnect());
    return clean;
  }
}

/**
 * @template T
 * @param {Promise<T>} p @param {number} ms
 * @returns {Promise<T>}
 */
function withTimeout(p, ms) {
  /** @type {NodeJS.Timeout | undefined} */
  let timer;
  const timeout = new Promise((_resolve, reject) => {
    timer = setTimeout(() => reject(new Error(`no reply within ${ms} ms`)), ms);
  });
  return /** @type {Promise<T>} */ (Promise.race([p, timeout])).finally(() => clearTimeout(timer));
}

module.exports = { Worker, Generation };
