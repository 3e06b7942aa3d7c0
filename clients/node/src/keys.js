'use strict';
/**
 * Key and channel names of one namespace (protocol/README.md, "Keys").
 * Every key starts with `{ns}:` so that a namespace is one Cluster hash slot.
 */
const crypto = require('node:crypto');
const { checkPayload } = require('./blob');

/** The protocol version this package speaks. */
const PROTOCOL_VERSION = '11';

const NAMESPACE = /^[A-Za-z0-9_.-]{1,64}$/;
const WORKER_ID = /^[A-Za-z0-9_.-]{1,128}$/;
const QUEUE = /^[A-Za-z0-9_.:/@+=-]{1,200}$/;

/**
 * @param {unknown} queue
 * @returns {string}
 * @throws {TypeError} not 1 to 200 of A-Z a-z 0-9 _ . : / @ + = -
 */
function checkQueue(queue) {
  if (typeof queue !== 'string' || !QUEUE.test(queue)) {
    throw new TypeError(
      `invalid queue name ${JSON.stringify(queue)}: use 1 to 200 of the characters A-Z a-z 0-9 _ . : / @ + = -`);
  }
  return queue;
}

/**
 * @param {unknown} group
 * @returns {string}
 * @throws {TypeError} not 1 to 200 of A-Z a-z 0-9 _ . : / @ + = - (the rule of queue names)
 */
function checkGroup(group) {
  if (typeof group !== 'string' || !QUEUE.test(group)) {
    throw new TypeError(
      `invalid group name ${JSON.stringify(group)}: use 1 to 200 of the characters A-Z a-z 0-9 _ . : / @ + = -`);
  }
  return group;
}

/**
 * @param {unknown} id
 * @returns {string}
 * @throws {TypeError} not 1 to 128 of A-Z a-z 0-9 _ . -
 */
function checkWorkerId(id) {
  if (typeof id !== 'string' || !WORKER_ID.test(id)) {
    throw new TypeError(
      `invalid worker id ${JSON.stringify(id)}: use 1 to 128 of the characters A-Z a-z 0-9 _ . -`);
  }
  return id;
}

class Keys {
  /**
   * @param {string} namespace
   * @throws {TypeError} not 1 to 64 of A-Z a-z 0-9 _ . -
   */
  constructor(namespace) {
    if (typeof namespace !== 'string' || !NAMESPACE.test(namespace)) {
      throw new TypeError(
        `invalid namespace ${JSON.stringify(namespace)}: use 1 to 64 of the characters A-Z a-z 0-9 _ . -`);
    }
    this.namespace = namespace;
    const p = (this.prefix = `{${namespace}}:`);
    this.token = `${p}token`;
    this.queues = `${p}queues`;
    this.workers = `${p}workers`;
    this.info = `${p}info`;
    this.version = `${p}version`;
    this.policy = `${p}policy`;
    this.timed = `${p}timed`;  // queues that keep enqueue times (configure.lua)
    this.schedules = `${p}schedules`;
    this.scheduleSpecs = `${p}schedule_specs`;
    this.wakePrefix = `${p}wake:`;
    this.cancelPrefix = `${p}cancel:`;
  }

  /** @param {string} q */ queue(q) { return `${this.prefix}queue:${q}`; }
  /** @param {string} q */ persistent(q) { return `${this.prefix}persistent:${q}`; }
  /** @param {string} q */ idle(q) { return `${this.prefix}idle:${q}`; }
  /** @param {string} q */ moving(q) { return `${this.prefix}moving:${q}`; }
  /** @param {string} q */ reserved(q) { return `${this.prefix}reserved:${q}`; }
  /** @param {string} q */ unowned(q) { return `${this.prefix}unowned:${q}`; }
  /** @param {string} q */ enqt(q) { return `${this.prefix}enqt:${q}`; }
  /** @param {string} q */ share(q) { return `${this.prefix}share:${q}`; }
  /** @param {string} q */ standby(q) { return `${this.prefix}standby:${q}`; }
  /** @param {string} q */ procs(q) { return `${this.prefix}procs:${q}`; }
  /** @param {string} q */ attempts(q) { return `${this.prefix}attempts:${q}`; }
  /** @param {string} q */ delayed(q) { return `${this.prefix}delayed:${q}`; }
  /** @param {string} q */ prio(q) { return `${this.prefix}prio:${q}`; }
  /** @param {string} q */ delayedPrio(q) { return `${this.prefix}delayed_prio:${q}`; }
  /** @param {string} q */ dead(q) { return `${this.prefix}dead:${q}`; }
  /** @param {string} q */ rate(q) { return `${this.prefix}rate:${q}`; }
  /** @param {string} q */ paused(q) { return `${this.prefix}paused:${q}`; }
  /** @param {string} q */ stats(q) { return `${this.prefix}stats:${q}`; }
  /** @param {string} q */ servers(q) { return `${this.prefix}servers:${q}`; }
  // A queue's groups (protocol/include/group.lua): the scripts make these
  // names themselves from the namespace's prefix; only cancel.lua is given one.
  /** @param {string} q @param {string} g the LIST of g's queued jobs */
  groupJobs(q, g) { return `${this.prefix}gq:${q}|${g}`; }
  /** @param {string} q the HASH of q's group counts, settings and pauses */
  groups(q) { return `${this.prefix}groups:${q}`; }
  /**
   * The result record of a payload: named by the payload's SHA-1 (hex).
   * @param {string} q
   * @param {Buffer} payload
   */
  result(q, payload) {
    return `${this.prefix}result:${crypto.createHash('sha1').update(payload).digest('hex')}:${q}`;
  }
  /** @param {string} w */ heartbeat(w) { return `${this.prefix}worker:${w}`; }
  /** @param {string} w */ serves(w) { return `${this.prefix}serves:${w}`; }
  /** @param {string} w */ inbox(w) { return `${this.prefix}inbox:${w}`; }
  /** @param {string} w @param {string} q */ held(w, q) { return `${this.prefix}held:${w}:${q}`; }
  /** @param {string} w */ wakeChannel(w) { return this.wakePrefix + w; }
  /** @param {string} w */ cancelChannel(w) { return this.cancelPrefix + w; }
  /** @param {string} q */ doneChannel(q) { return `${this.prefix}done:${q}`; }
  /**
   * STRING with a TTL that exists while someone awaits q's done messages:
   * finish.lua publishes them only then (given the key).
   * @param {string} q
   */
  awaiting(q) { return `${this.prefix}awaiting:${q}`; }
}

/**
 * A payload as bytes: a string is encoded as UTF-8.
 * @param {string | Buffer | Uint8Array} task
 * @returns {Buffer}
 * @throws {TypeError} neither a string nor bytes
 */
function rawBytes(task) {
  if (typeof task === 'string') return Buffer.from(task, 'utf8');
  if (Buffer.isBuffer(task)) return task;
  if (task instanceof Uint8Array) return Buffer.from(task);
  throw new TypeError(`a task payload must be a string or bytes, not ${typeof task}`);
}

/**
 * A payload to add as bytes (rawBytes), refused when it starts with the mark
 * of a stand-in (src/blob.js).
 * @param {string | Buffer | Uint8Array} task
 * @returns {Buffer}
 * @throws {TypeError} neither a string nor bytes
 * @throws {RangeError} it starts with the mark of a stand-in
 */
function payloadBytes(task) {
  return checkPayload(rawBytes(task));
}

module.exports = { PROTOCOL_VERSION, Keys, checkQueue, checkGroup, checkWorkerId, payloadBytes, rawBytes };
