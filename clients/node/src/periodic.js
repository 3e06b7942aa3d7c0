'use strict';
/**
 * What a worker does on a period besides its heartbeat: it fires the due
 * ticks of periodic tasks (fire.lua, every H; each tick fires once across the
 * mesh) and sends what its handlers did to the per-minute counts (stats.lua,
 * every 5 s).
 */

/** How often the per-minute counts are sent (ms), and how long they are kept (minutes). */
const STATS_EVERY_MS = 5000;
const STATS_KEEP_MINUTES = 120;
/** At most this many schedules are read per round trip when firing ticks. */
const TICK_BATCH = 100;

class Periodic {
  /** @param {import('./worker').Worker} worker */
  constructor(worker) {
    this.worker = worker;
    /** Per queue: [finished, failed] not yet sent to stats.lua. @type {Map<string, [number, number]>} */
    this._counts = new Map();
    /** The tick and stats loops, once started. @type {Promise<void>[]} */
    this.loops = [];
    /** Wakers of the naps of the tick and stats loops (close() ends them). @type {Set<() => void>} */
    this._naps = new Set();
    this._cronWarned = false;
  }

  /** Start the tick and stats loops (they end when the worker closes). */
  start() {
    this.loops = [this._tickLoop(), this._statsLoop()];
  }

  /** End the loops' naps at once (the worker is closed: the loops end). */
  close() {
    for (const wake of [...this._naps]) wake();
  }

  /**
   * Count one handler outcome of `queue` for the per-minute counts.
   * @param {string} queue @param {boolean} ok finished (true) or failed
   */
  count(queue, ok) {
    const c = this._counts.get(queue) || [0, 0];
    c[ok ? 0 : 1] += 1;
    this._counts.set(queue, c);
  }

  /** Sleep `ms`, or less if the worker closes. @param {number} ms */
  _nap(ms) {
    return new Promise((resolve) => {
      const wake = () => { clearTimeout(timer); this._naps.delete(wake); resolve(undefined); };
      const timer = setTimeout(wake, Math.max(0, ms));
      this._naps.add(wake);
    });
  }

  /**
   * Send the counts gathered since the last report (nothing if none). On an
   * error they are kept for the next one.
   */
  async reportCounts() {
    if (!this._counts.size) return;
    const w = this.worker;
    const counts = this._counts;
    this._counts = new Map();
    try {
      await w.binding.stats(w.redis, counts, STATS_KEEP_MINUTES);
    } catch (err) {
      for (const [q, [p, f]] of counts) {
        const c = this._counts.get(q) || [0, 0];
        this._counts.set(q, [c[0] + p, c[1] + f]);
      }
      w._log('debug', `sending the per-minute counts failed (kept): ${err instanceof Error ? err.message : err}`);
    }
  }

  async _statsLoop() {
    while (!this.worker.closed) {
      await this._nap(STATS_EVERY_MS);
      if (!this.worker.closed) await this.reportCounts();
    }
  }

  /**
   * Fire the due ticks among the first schedules (fire.lua, compare-and-set:
   * each tick fires once across the mesh). Cron schedules are left to peers
   * that evaluate cron (this one does not).
   * @returns {Promise<number>} ms until the first tick is due (0: look again at once)
   */
  async fireDue() {
    const w = this.worker;
    const k = w.keys;
    const p = /** @type {any} */ (w.redis.pipeline());
    p.time();
    p.zrangeBuffer(k.schedules, 0, TICK_BATCH - 1, 'WITHSCORES');
    const res = await p.exec();
    for (const [err] of res) if (err) throw err;
    const [sec, usec] = res[0][1];
    const nowMs = Number(sec) * 1000 + Math.floor(Number(usec) / 1000);
    /** @type {Buffer[]} */
    const flat = res[1][1];
    if (!flat.length) return Infinity;
    /** @type {[Buffer, number][]} */
    const due = [];
    for (let i = 0; i < flat.length; i += 2) {
      const tick = Math.floor(Number(flat[i + 1].toString()));
      if (tick <= nowMs) due.push([flat[i], tick]);
    }
    if (!due.length) return Math.floor(Number(flat[1].toString())) - nowMs;
    const specs = await /** @type {any} */ (w.redis).hmgetBuffer(k.scheduleSpecs, ...due.map((d) => d[0]));
    /** @type {[Buffer, number, number][]} */
    const fire = [];
    due.forEach(([sid, tick], i) => {
      const spec = specs[i] ? specs[i].toString('utf8') : null;
      const every = spec && /^every (\d+)$/.exec(spec);
      if (every) {
        const period = Math.max(1, Number(every[1]));
        const next = nowMs < tick + period ? tick + period
          : tick + period * (Math.floor((nowMs - tick) / period) + 1);
        fire.push([sid, tick, next]);
      } else if (spec && !this._cronWarned) {
        this._cronWarned = true;
        w._log('warn', `schedule spec ${JSON.stringify(spec)}: cron is not evaluated by this peer; `
          + 'another peer fires it');
      }
    });
    if (!fire.length) return w.timing.interval * 1000;
    await w.binding.fire(w.redis, fire);
    return 0;
  }

  async _tickLoop() {
    const w = this.worker;
    const h = w.timing.interval * 1000;
    while (!w.closed) {
      let wait = h;
      try {
        wait = await this.fireDue();
      } catch (err) {
        w._log('debug', `firing periodic tasks failed: ${err instanceof Error ? err.message : err}`);
      }
      if (wait > 0 && !w.closed) await this._nap(Math.min(wait, h) + Math.random() * Math.min(20, h / 10));
    }
  }
}

module.exports = { Periodic };
