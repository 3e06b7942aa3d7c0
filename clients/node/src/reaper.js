'use strict';
/**
 * A worker's reaper: recycles the workers whose lease ran out (reap_check.lua
 * by Redis time, then recycle mode "dead", in parts of about 2,000 processes
 * held). It wakes on a lease's key-expiry event, at the next deadline Redis
 * told it about (when on watch: about three reapers of the mesh are), or on a
 * periodic pass every 3 T.
 */

/** @param {number} ms */
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

class Reaper {
  /** @param {import('./worker').Worker} worker */
  constructor(worker) {
    this.worker = worker;
    /** On watch: acts on every expiry and deadline (drawn at each periodic pass). */
    this.onWatch = true;
    this.meshSize = 0;
    /** ms until the next lease deadline Redis told of (-1: none). */
    this.nextMs = -1;
    this.woken = false;
    /** @type {(() => void) | null} */ this.wake = null;
    /** @type {Promise<void> | null} */ this.loop = null;
    /** The queues dead workers served lately (a hint for recycle). @type {string[]} */
    this._deadQueues = [];
  }

  /** Start the reaper's loop (it ends when the worker closes). */
  start() {
    this.loop = this._loop();
  }

  /** End the loop's wait at once (the worker is closed: the loop ends). */
  close() {
    if (this.wake) this.wake();
  }

  /** A lease's key expired (keyspace notification). */
  heardExpiry() {
    if (this.onWatch || Math.random() * this.meshSize < 3) this._wakeUp();
  }

  /** The heartbeat says a lease deadline passed `overdue` seconds ago. @param {number} overdue */
  deadlinePassed(overdue) {
    const grace = Math.min(Math.max(this.worker.timing.ttl / 20, 0.025), 0.25);
    if (this.onWatch || overdue >= grace) this._wakeUp();
  }

  _wakeUp() {
    this.woken = true;
    if (this.wake) this.wake();
  }

  /** Recycle every worker whose lease ran out; returns how many. */
  async reapOnce() {
    const w = this.worker;
    const leaseMs = Math.max(200, Math.round(w.timing.ttl * 500));
    let total = 0;
    for (;;) {
      const check = await w.binding.reapCheck(w.redis, 1000, leaseMs);
      this.nextMs = check.nextMs;
      this.meshSize = check.workers;
      if (!check.dead.length) return total;
      for (const part of await this._parts(check.dead)) {
        const r = await w.binding.recycle(w.redis, part, 'dead', '', this._queues());
        this._deadQueues = r.queues.slice(-64);
        total += r.recycled;
        if (r.recycled) {
          w._log('info', `recycled ${r.recycled} dead workers (${r.returned} processes handed back)`);
        }
      }
    }
  }

  /** The queues dead workers most likely served: ours, and those of the last recycles. */
  _queues() {
    return [...new Set([...this.worker.queues.keys(), ...this._deadQueues])];
  }

  /**
   * `dead` in groups of about 2,000 processes held (one SCARD per worker and
   * queue, in one round trip), each worker counting 2 more, at least one
   * worker each: one recycle call holds up every client of Redis while it runs.
   * @param {string[]} dead
   * @returns {Promise<string[][]>}
   */
  async _parts(dead) {
    const queues = this._queues();
    if (dead.length < 2 || !queues.length) return [dead];
    const w = this.worker;
    const p = w.redis.pipeline();
    for (const id of dead) for (const q of queues) p.scard(w.keys.held(id, q));
    const sizes = ((await p.exec()) || []).map(([, n]) => Number(n) || 0);
    /** @type {string[][]} */
    const parts = [];
    let held = 0;
    dead.forEach((id, i) => {
      const n = 2 + sizes.slice(i * queues.length, (i + 1) * queues.length).reduce((a, b) => a + b, 0);
      if (!parts.length || held + n > 2000) {
        parts.push([]);
        held = 0;
      }
      parts[parts.length - 1].push(id);
      held += n;
    });
    return parts;
  }

  async _loop() {
    const w = this.worker;
    const intervalMs = 3 * w.timing.ttl * 1000;
    let backoff = 50;
    let periodic = true; // the first pass draws too
    while (!w.closed) {
      this.woken = false;
      this.nextMs = -1;
      try {
        await this.reapOnce();
        backoff = 50;
      } catch (err) {
        w._log('debug', `reap check failed: ${err instanceof Error ? err.message : err}; retrying`);
        await sleep(backoff);
        backoff = Math.min(backoff * 2, intervalMs);
        continue;
      }
      // drawn only at the periodic passes, which every reaper makes at the
      // same rate (one on watch also passes at every deadline)
      if (periodic) this.onWatch = Math.random() * this.meshSize < 3;
      let wait = intervalMs * (1 + 0.2 * Math.random());
      periodic = true;
      if (this.onWatch && this.nextMs >= 0 && this.nextMs < wait) {
        wait = this.nextMs + Math.random() * 20;
        periodic = false;
      }
      if (this.woken) {
        periodic = false;
        continue;
      }
      await new Promise((resolve) => {
        const timer = setTimeout(resolve, Math.max(wait, 1));
        this.wake = () => { clearTimeout(timer); periodic = false; resolve(undefined); };
      });
      this.wake = null;
    }
  }
}

module.exports = { Reaper };
