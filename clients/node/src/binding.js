'use strict';
/**
 * Typed calls to the scripts of one namespace: each builds the KEYS and ARGV
 * that the script's header lists, and parses its reply.
 */
const { runScript } = require('./scripts');
const { PROTOCOL_VERSION } = require('./keys');
const { BLOB_MIN, standin } = require('./blob');
const { MeshError, FencedError } = require('./errors');

/** @typedef {import('ioredis').Redis} Redis */
/** @typedef {import('./keys').Keys} Keys */

/**
 * @typedef {object} Process
 * @property {string} id      the process id, which is its fencing token
 * @property {bigint} token   the fencing token as a number
 * @property {string} queue
 * @property {Buffer} task    the payload
 * @property {boolean} persistent
 * @property {number} attempts  failed attempts of this payload before this one
 * @property {string | null} group  the group of the queue the job came from (null: none)
 */

/**
 * @typedef {object} QueueBeat
 * @property {number} state    0: tasks ready, -1: none, N: ms until a delayed one is due
 * @property {number} held     processes Redis says the worker holds on the queue
 * @property {boolean} idle    whether the worker is in the queue's idle set
 * @property {number} idleServers
 * @property {number} total    T, the total weight of the queue's persistent tasks
 * @property {number} capacityTotal  C, the total capacity of its servers
 * @property {number} capacity the worker's capacity
 * @property {number} weight   the weight the worker holds there
 * @property {string[]} release  processes a rebalance asks the worker to hand back
 */

/**
 * @typedef {object} HeartbeatReply
 * @property {number} nowMs
 * @property {number} nextDeadlineMs  ms until the earliest lease deadline (<= 0: passed)
 * @property {string[]} inbox  cancelled process ids
 * @property {QueueBeat[]} beats  per queue named, in order
 */

/** @param {any} x */
const num = (x) => Number(Buffer.isBuffer(x) ? x.toString() : x);
/** @param {any} x */
const str = (x) => (Buffer.isBuffer(x) ? x.toString('utf8') : String(x));

class Binding {
  /**
   * @param {Keys} keys
   * @param {string} [protocolVersion] the version register.lua is told (tests only)
   */
  constructor(keys, protocolVersion = PROTOCOL_VERSION) {
    this.keys = keys;
    this.protocolVersion = protocolVersion;
    /** (worker \0 queue) -> [generation, T, C, capacity, extra weight] last seen
     * @type {Map<string, [string, number, number, number, number]>} */
    this.balance = new Map();
  }

  /**
   * register.lua. Returns the Redis time in ms.
   * @param {Redis} r @param {string} worker @param {string} incarnation
   * @param {number} ttlMs @param {string} info
   */
  async register(r, worker, incarnation, ttlMs, info) {
    const k = this.keys;
    return num(await runScript(r, 'register', [k.heartbeat(worker), k.workers, k.info, k.version],
      [worker, incarnation, ttlMs, info, this.protocolVersion]));
  }

  /** serve.lua @param {Redis} r @param {string} worker @param {string} inc @param {string} queue @param {number} capacity */
  async serve(r, worker, inc, queue, capacity = 1) {
    const k = this.keys;
    await runScript(r, 'serve',
      [k.heartbeat(worker), k.serves(worker), k.queues, k.servers(queue), k.share(queue)],
      [worker, inc, queue, capacity]);
  }

  /**
   * heartbeat.lua for one worker.
   * @param {Redis} r @param {string} worker @param {string} inc @param {number} ttlMs
   * @param {string[]} acks @param {string[]} queues
   * @returns {Promise<HeartbeatReply>}
   * @throws {import('./errors').FencedError} the lease is gone or superseded
   */
  async heartbeat(r, worker, inc, ttlMs, acks, queues) {
    const k = this.keys;
    /** @type {string[]} */
    const keys = [k.workers];
    for (const q of queues) {
      keys.push(k.queue(q), k.delayed(q), k.idle(q), k.moving(q), k.reserved(q), k.share(q), k.prio(q));
    }
    keys.push(k.heartbeat(worker), k.inbox(worker), ...queues.map((q) => k.held(worker, q)));
    /** @type {(string|number)[]} */
    const args = [ttlMs, queues.length, 1, worker, inc, acks.length, ...acks, queues.length];
    queues.forEach((q, i) => {
      const seen = this.balance.get(`${worker}\0${q}`);
      args.push(i + 1, seen ? seen[0] : '');
    });
    const raw = await runScript(r, 'heartbeat', keys, args);
    const nowMs = num(raw[0]);
    const nextDeadlineMs = num(raw[1]);
    const idles = raw.slice(2, 2 + queues.length).map(num);
    let pos = 2 + queues.length;
    if (Buffer.isBuffer(raw[pos])) {
      throw new FencedError(str(raw[pos]).replace(/^FENCED /, ''), 'FENCED');
    }
    const n = num(raw[pos]);
    const inbox = raw.slice(pos + 1, pos + 1 + n).map(str);
    pos += 1 + n;
    /** @type {QueueBeat[]} */
    const beats = [];
    queues.forEach((q, i) => {
      const state = num(raw[pos]);
      const held = num(raw[pos + 1]);
      const idle = num(raw[pos + 2]) === 1;
      pos += 3;
      /** @type {string[]} */
      let release = [];
      let total; let capacityTotal; let capacity; let extra;
      const memo = `${worker}\0${q}`;
      if (num(raw[pos]) === 0) {
        pos += 1;
        [, total, capacityTotal, capacity, extra] = this.balance.get(memo) || ['', 0, 1, 1, 0];
      } else {
        const gen = num(raw[pos + 1]);
        [total, capacityTotal, capacity, extra] = raw.slice(pos + 2, pos + 6).map(num);
        const nrel = num(raw[pos + 6]);
        release = raw.slice(pos + 7, pos + 7 + nrel).map(str);
        pos += 7 + nrel;
        if (gen >= 0) this.balance.set(memo, [String(gen), total, capacityTotal, capacity, extra]);
        else this.balance.delete(memo);
      }
      beats.push({ state, held, idle, idleServers: idles[i], total, capacityTotal, capacity,
        weight: held + extra, release });
    });
    return { nowMs, nextDeadlineMs, inbox, beats };
  }

  /**
   * claim.lua.
   * @param {Redis} r
   * @param {{worker: string, inc: string, queue: string, n: number, maxAttempts: number,
   *   fair: number, backoffMs: number, backoffCapMs: number, ttlMs: number, wake: boolean,
   *   rate?: [number, number] | null}} o
   *   fair: 0 no limit, 1 fair share, P >= 2 fair share with a patience of P ms
   * @returns {Promise<{nowMs: number, remaining: number, heldBack: boolean, nextDueMs: number,
   *   processes: Process[]}>}
   */
  async claim(r, o) {
    const k = this.keys;
    const q = o.queue;
    const keys = [k.heartbeat(o.worker), k.serves(o.worker), k.queue(q), k.persistent(q), k.procs(q),
      k.held(o.worker, q), k.attempts(q), k.delayed(q), k.token, k.servers(q), k.standby(q),
      k.idle(q), k.reserved(q), k.unowned(q), k.share(q), k.prio(q), k.delayedPrio(q)];
    const args = [o.worker, o.inc, q, o.n, o.maxAttempts, o.fair, o.backoffMs, o.backoffCapMs,
      o.ttlMs, o.wake ? 1 : 0, k.wakePrefix];
    // the rate bucket (its ARGV empty: no limit), then the pause flag, always
    keys.push(k.rate(q), k.paused(q));
    if (o.rate) args.push(o.rate[0], o.rate[1]);
    else args.push('', '');
    const raw = await runScript(r, 'claim', keys, args);
    /** @type {Process[]} */
    const processes = [];
    for (let i = 3; i + 3 < raw.length; i += 4) {
      const id = str(raw[i]);
      // the persistent flag: 1/0, or the name of the group of a group's job
      const flag = raw[i + 1];
      const group = Buffer.isBuffer(flag) ? flag.toString('utf8') : null;
      processes.push({ id, token: BigInt(id), queue: q, task: raw[i + 3],
        persistent: group === null && num(flag) === 1, attempts: num(raw[i + 2]), group });
    }
    const left = num(raw[1]);
    return { nowMs: num(raw[0]), remaining: Math.max(left, 0), heldBack: left < 0,
      nextDueMs: num(raw[2]), processes };
  }

  /**
   * finish.lua, or finish_results.lua with `results` (a queue that keeps them).
   * @param {Redis} r @param {string} worker @param {string} inc @param {string} queue
   * @param {string[]} ids
   * @param {{ttlMs: number, values: Map<string, [Buffer, Buffer | null]>}} [results]
   * @returns {Promise<boolean[]>} per id: whether it was the worker's live process
   */
  async finish(r, worker, inc, queue, ids, results) {
    const k = this.keys;
    const keys = [k.heartbeat(worker), k.procs(queue), k.held(worker, queue), k.persistent(queue),
      k.attempts(queue), k.share(queue)];
    /** @type {(string|number|Buffer)[]} */
    const args = [worker, inc, k.doneChannel(queue)];
    let name = 'finish';
    if (results) {
      name = 'finish_results';
      args.push(results.ttlMs);
      for (const id of ids) {
        const [payload, value] = /** @type {[Buffer, Buffer | null]} */ (results.values.get(id));
        keys.push(k.result(queue, payload));
        args.push(id, value === null ? 'n' : 'v', value === null ? '' : value);
      }
    } else {
      args.push(...ids);
    }
    const raw = await runScript(r, name, keys, args);
    return raw.map((/** @type {any} */ x) => num(x) === 1);
  }

  /**
   * give_back.lua. Per id: [outcome (0 not ours, 1 front, 2 retry later, 3 dead), delay ms].
   * @param {Redis} r @param {string} worker @param {string} queue @param {string[]} ids
   * @param {{mode: 'return' | 'fail', backoffMs?: number, backoffCapMs?: number, errors?: string[]}} o
   * @returns {Promise<[number, number][]>}
   */
  async giveBack(r, worker, queue, ids, o) {
    const k = this.keys;
    const keys = [k.procs(queue), k.held(worker, queue), k.queue(queue), k.persistent(queue),
      k.attempts(queue), k.delayed(queue), k.dead(queue), k.standby(queue), k.idle(queue),
      k.moving(queue), k.reserved(queue), k.unowned(queue), k.share(queue), k.prio(queue),
      k.delayedPrio(queue)];
    /** @type {(string|number|Buffer)[]} */
    const args = [worker, o.mode, o.backoffMs || 0, o.backoffCapMs || 0, k.wakePrefix, queue];
    if (o.mode === 'fail' && o.errors) {
      const errors = o.errors;
      ids.forEach((id, i) => {
        const b = Buffer.from(`${id}\0${errors[i]}`, 'utf8');
        args.push(b.subarray(0, Buffer.byteLength(id) + 1 + 2000));
      });
    } else {
      args.push(...ids);
    }
    const raw = await runScript(r, 'give_back', keys, args);
    /** @type {[number, number][]} */
    const out = [];
    for (let i = 0; i < raw.length; i += 2) out.push([num(raw[i]), num(raw[i + 1])]);
    return out;
  }

  /**
   * schedule.lua mode "add": [new (false: it replaced one), the first tick ms].
   * @param {Redis} r @param {string} queue @param {Buffer} payload
   * @param {string} spec "every <ms>" or "cron <expression>"
   * @returns {Promise<[boolean, number]>}
   */
  async schedule(r, queue, payload, spec) {
    const k = this.keys;
    const raw = await runScript(r, 'schedule', [k.schedules, k.scheduleSpecs, k.queues],
      ['add', queue, payload, spec, '']);
    return [num(raw[0]) === 1, num(raw[1])];
  }

  /**
   * fire.lua: per tick given (schedule id, the tick read, the next tick):
   * 1 fired, 0 not (another peer did, or it changed), 2 skipped (the payload
   * is a persistent task of the queue now).
   * @param {Redis} r @param {[Buffer, number, number][]} ticks
   * @returns {Promise<number[]>}
   */
  async fire(r, ticks) {
    const k = this.keys;
    const keys = [k.schedules, k.scheduleSpecs, k.queues];
    /** @type {(string|number|Buffer)[]} */
    const args = [k.wakePrefix];
    for (const [sid, tick, next] of ticks) {
      const end = sid.indexOf(0);
      const q = sid.subarray(0, end < 0 ? sid.length : end).toString('utf8');
      keys.push(k.queue(q), k.persistent(q), k.standby(q), k.idle(q));
      args.push(sid, tick, next);
    }
    const raw = await runScript(r, 'fire', keys, args);
    return raw.map(num);
  }

  /**
   * stats.lua: add (finished, failed) per queue to the current minute of the
   * Redis clock, keeping `keepMinutes`.
   * @param {Redis} r @param {Map<string, [number, number]>} counts @param {number} keepMinutes
   * @returns {Promise<number>} the minute the counts went to
   */
  async stats(r, counts, keepMinutes) {
    const keys = [...counts.keys()].map((q) => this.keys.stats(q));
    /** @type {number[]} */
    const args = [keepMinutes];
    for (const [done, failed] of counts.values()) args.push(done, failed);
    return num(await runScript(r, 'stats', keys, args));
  }

  /**
   * configure.lua: the policy stored afterwards (JSON), or null after mode "clear".
   * @param {Redis} r @param {string} queue @param {'set' | 'default' | 'clear'} mode
   * @param {string} source @param {(string | number)[]} fields name, value, ...
   * @returns {Promise<string | null>}
   */
  async configure(r, queue, mode, source, fields) {
    const k = this.keys;
    const raw = await runScript(r, 'configure', [k.policy, k.queues], [queue, mode, source, ...fields]);
    return Buffer.isBuffer(raw) ? raw.toString('utf8') : null;
  }

  /** drain.lua: whether the worker served the queue until now.
   * @param {Redis} r @param {string} worker @param {string} inc @param {string} queue */
  async drain(r, worker, inc, queue) {
    const k = this.keys;
    return num(await runScript(r, 'drain',
      [k.heartbeat(worker), k.servers(queue), k.idle(queue), k.share(queue)], [worker, inc])) === 1;
  }

  /**
   * recycle.lua for workers (mode "dead") or one worker leaving (mode "leave"),
   * called again with the queues the script names until it is done.
   * @param {Redis} r @param {string[]} workers @param {'dead' | 'leave'} mode
   * @param {string} inc @param {string[]} queues a hint
   * @returns {Promise<{returned: number, deadLettered: number, recycled: number, alive: string[],
   *   queues: string[]}>}
   */
  async recycle(r, workers, mode, inc, queues) {
    const k = this.keys;
    const ws = [...new Set(workers)];
    const qs = [...new Set(queues)];
    for (let round = 0; round < 10; round++) {
      const keys = [k.workers, k.info];
      for (const w of ws) keys.push(k.heartbeat(w), k.serves(w), k.inbox(w));
      for (const q of qs) {
        keys.push(k.procs(q), k.queue(q), k.persistent(q), k.attempts(q), k.dead(q), k.servers(q),
          k.delayed(q), k.standby(q), k.idle(q), k.unowned(q), k.share(q), k.prio(q), k.delayedPrio(q));
      }
      for (const w of ws) for (const q of qs) keys.push(k.held(w, q));
      const raw = await runScript(r, 'recycle', keys, [mode, inc, k.wakePrefix, ws.length, ...ws, ...qs]);
      if (num(raw[0]) === 0) {
        return { returned: num(raw[1]), deadLettered: num(raw[2]), recycled: num(raw[3]),
          alive: raw[4].map(str), queues: qs };
      }
      for (const q of raw.slice(1)) if (!qs.includes(str(q))) qs.push(str(q));
    }
    throw new MeshError(`recycle of workers ${ws.join(', ')}: their queues kept changing`);
  }

  /**
   * rebalance.lua, naming the queue's servers (learned from the script).
   * @param {Redis} r @param {string} worker @param {string} inc @param {string} queue
   * @param {number} limit @param {number} holdMs @param {string[]} servers
   * @returns {Promise<{marked: number, total: number, capacityTotal: number, held: number,
   *   servers: string[]}>}
   */
  async rebalance(r, worker, inc, queue, limit, holdMs, servers) {
    const k = this.keys;
    let names = [...servers];
    for (let round = 0; round < 5; round++) {
      const keys = [k.heartbeat(worker), k.servers(queue), k.persistent(queue), k.standby(queue),
        k.procs(queue), k.moving(queue), k.reserved(queue), k.queue(queue), k.share(queue),
        ...names.map((w) => k.held(w, queue))];
      const raw = await runScript(r, 'rebalance', keys,
        [worker, inc, queue, limit, holdMs, k.wakePrefix, ...names]);
      if (num(raw[0]) === 2) {
        names = raw.slice(1).map(str);
        continue;
      }
      return { marked: num(raw[1]), total: num(raw[2]), capacityTotal: num(raw[3]), held: num(raw[4]),
        servers: names };
    }
    throw new MeshError('rebalance: the servers of the queue keep changing');
  }

  /**
   * reap_check.lua.
   * @param {Redis} r @param {number} limit @param {number} leaseMs
   * @returns {Promise<{nowMs: number, nextMs: number, workers: number, dead: string[]}>}
   */
  async reapCheck(r, limit, leaseMs) {
    const raw = await runScript(r, 'reap_check', [this.keys.workers], [limit, leaseMs]);
    return { nowMs: num(raw[0]), nextMs: num(raw[1]), workers: num(raw[2]), dead: raw.slice(3).map(str) };
  }

  /**
   * put_blob.lua for each payload of `payloads` longer than BLOB_MIN (once
   * each), before the call that enqueues their stand-ins (src/blob.js). An
   * upload whose enqueue never comes expires within an hour.
   * @param {Redis} r @param {Buffer[]} payloads */
  async putBlobs(r, payloads) {
    const done = new Set();
    for (const p of payloads) {
      if (p.length <= BLOB_MIN) continue;
      const s = standin(p);
      const sha = s.subarray(11, 51).toString('latin1');
      if (done.has(sha)) continue;
      done.add(sha);
      await runScript(r, 'put_blob', [`${this.keys.prefix}blob:${sha}`], [p]);
    }
  }

  /** enqueue.lua: the queue's length afterwards.
   * @param {Redis} r @param {string} queue @param {Buffer[]} payloads @param {number} priority */
  async enqueue(r, queue, payloads, priority = 0) {
    const k = this.keys;
    return num(await runScript(r, 'enqueue',
      [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue), k.prio(queue)],
      [queue, k.wakePrefix, priority, ...payloads]));
  }

  /**
   * enqueue_group.lua: `payloads` at the back of `group` (of their
   * `priority` in it) now (`when` undefined), or delayed: {in: ms from now}
   * or {at: ms since the epoch, Redis clock}. {count: the group's length
   * (now) or the jobs newly delayed, dueMs, nowMs}.
   * @param {Redis} r @param {string} queue @param {string} group @param {Buffer[]} payloads
   * @param {{in?: number, at?: number}} [when] @param {number} [priority]
   */
  async enqueueGroup(r, queue, group, payloads, when, priority = 0) {
    const k = this.keys;
    let mode = 'now'; let ms = 0;
    if (when && when.at !== undefined) { mode = 'at'; ms = when.at; }
    else if (when && when.in !== undefined) { mode = 'in'; ms = when.in; }
    const raw = await runScript(r, 'enqueue_group',
      [k.queues, k.persistent(queue), k.standby(queue), k.idle(queue)],
      [queue, k.wakePrefix, group, mode, ms, priority, ...payloads]);
    return { count: num(raw[0]), dueMs: num(raw[1]), nowMs: num(raw[2]) };
  }

  /**
   * configure_group.lua: the settings stored afterwards,
   * "concurrency,rate,period_ms,weight" (an empty field: the default's), or
   * null after mode "clear". `group` "" is the queue's default.
   * @param {Redis} r @param {string} queue @param {string} group @param {'set' | 'clear'} mode
   * @param {string[]} fields concurrency, rate, period ms, weight ("": unchanged)
   * @returns {Promise<string | null>}
   */
  async configureGroup(r, queue, group, mode, fields) {
    const k = this.keys;
    const raw = await runScript(r, 'configure_group', [k.idle(queue), k.queues],
      [queue, k.wakePrefix, group, mode, ...fields]);
    return Buffer.isBuffer(raw) ? raw.toString('utf8') : null;
  }

  /** pause_group.lua: whether it changed anything.
   * @param {Redis} r @param {string} queue @param {string} group @param {'pause' | 'resume'} mode */
  async pauseGroup(r, queue, group, mode) {
    const k = this.keys;
    return num(await runScript(r, 'pause_group', [k.idle(queue)], [mode, queue, k.wakePrefix, group])) === 1;
  }

  /** delay.lua: {added, dueMs, nowMs}.
   * @param {Redis} r @param {string} queue @param {Buffer[]} payloads @param {number} inMs @param {number} priority */
  async delay(r, queue, payloads, inMs, priority = 0) {
    const k = this.keys;
    const raw = await runScript(r, 'delay',
      [k.delayed(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue), k.delayedPrio(queue)],
      [queue, k.wakePrefix, 'in', inMs, priority, ...payloads]);
    return { added: num(raw[0]), dueMs: num(raw[1]), nowMs: num(raw[2]) };
  }

  /** ensure.lua: per payload, whether it was added.
   * @param {Redis} r @param {string} queue @param {Buffer[]} payloads @param {number} weight */
  async ensure(r, queue, payloads, weight = 1) {
    const k = this.keys;
    const raw = await runScript(r, 'ensure',
      [k.queue(queue), k.queues, k.persistent(queue), k.standby(queue), k.idle(queue), k.delayed(queue),
        k.unowned(queue), k.share(queue), k.procs(queue), k.prio(queue)],
      [queue, k.wakePrefix, weight, ...payloads]);
    return raw.map((/** @type {any} */ x) => num(x) === 1);
  }

  /**
   * cancel.lua, called again with the workers it names: [queued copies removed,
   * running processes cancelled]. With `group`, the copies queued or delayed
   * in that group go too (its list is the script's last key).
   * @param {Redis} r @param {string} queue @param {Buffer} payload @param {string | null} [group]
   * @returns {Promise<[number, number]>}
   */
  async cancel(r, queue, payload, group = null) {
    const k = this.keys;
    const base = [k.queue(queue), k.persistent(queue), k.procs(queue), k.attempts(queue), k.delayed(queue),
      k.standby(queue), k.reserved(queue), k.unowned(queue), k.share(queue), k.prio(queue),
      k.delayedPrio(queue)];
    /** @type {string[]} */
    const workers = [];
    const tail = group === null ? [] : [k.groupJobs(queue, group)];
    for (let round = 0; round < 10; round++) {
      const wkeys = workers.flatMap((w) => [k.held(w, queue), k.inbox(w)]);
      const raw = await runScript(r, 'cancel', [...base, ...wkeys, ...tail], [payload, k.cancelPrefix, ...workers]);
      if (num(raw[0]) === 0) return [num(raw[1]), num(raw[2])];
      for (const w of raw.slice(1)) workers.push(str(w));
    }
    throw new MeshError(`cancel on queue ${queue}: the running processes kept changing`);
  }
}

module.exports = { Binding };
