#!/usr/bin/env node
'use strict';
/**
 * The conformance line protocol's peer (protocol/conformance/README.md):
 * commands as JSON lines on stdin, events as JSON lines on stdout, logs on
 * stderr. Redis and namespace from MESH_REDIS_URL and MESH_NAMESPACE.
 */
const readline = require('node:readline');
const Redis = require('ioredis').default;
const { Client, Worker, PROTOCOL_VERSION } = require('../src/index');
const { scriptByName } = require('../src/scripts');
const { parseStandin } = require('../src/blob');

/** The error codes of the scripts (protocol/README.md, "Error codes"). */
const SCRIPT_CODES = new Set(['FENCED', 'DUPLICATE_WORKER', 'VERSION', 'CONFLICT', 'NOT_SERVING', 'BAD_ARG', 'OOM']);

/** A command the peer cannot run as given (code BAD_COMMAND). */
class BadCommand extends Error {}

/**
 * The line protocol's code of an error: the script's code, BAD_COMMAND, or ERROR.
 * @param {unknown} err
 */
function codeOf(err) {
  if (err instanceof BadCommand) return 'BAD_COMMAND';
  const code = err instanceof Error && 'code' in err ? /** @type {any} */ (err).code : undefined;
  if (typeof code === 'string' && SCRIPT_CODES.has(code)) return code;
  const first = err instanceof Error ? err.message.split(' ', 1)[0] : '';
  return SCRIPT_CODES.has(first) ? first : 'ERROR';
}

/**
 * The Lua the conformance vectors put before a script so that TIME answers
 * their time (protocol/conformance/README.md, "Script vectors").
 * @param {number} s @param {number} us
 */
function timePrelude(s, us) {
  const t = `return {'${s}', '${us}'}`;
  return 'local __mesh_redis = redis\n'
    + 'local redis = setmetatable({\n'
    + '  call = function(cmd, ...)\n'
    + `    if cmd == 'TIME' or cmd == 'time' then ${t} end\n`
    + '    return __mesh_redis.call(cmd, ...)\n'
    + '  end,\n'
    + '  pcall = function(cmd, ...)\n'
    + `    if cmd == 'TIME' or cmd == 'time' then ${t} end\n`
    + '    return __mesh_redis.pcall(cmd, ...)\n'
    + '  end,\n'
    + '}, {__index = __mesh_redis})\n';
}

/**
 * A script's reply as JSON: bulk strings as text (UTF-8), integers as
 * numbers, nil as null, arrays as arrays.
 * @param {unknown} x
 * @returns {unknown}
 */
function asJson(x) {
  if (Buffer.isBuffer(x)) return x.toString('utf8');
  if (Array.isArray(x)) return x.map(asJson);
  return x === undefined ? null : x;
}

const url = process.env.MESH_REDIS_URL || '';
const namespace = process.env.MESH_NAMESPACE || '';
if (!url || !namespace) {
  process.stderr.write('mesh-peer: set MESH_REDIS_URL and MESH_NAMESPACE\n');
  process.exit(2);
}

/** @param {Record<string, unknown>} obj */
function emit(obj) {
  process.stdout.write(`${JSON.stringify(obj)}\n`);
}

/** @type {import('../src/worker').Worker | null} */
let worker = null;
/** @type {import('../src/client').Client | null} */
let client = null;
/** The connection of the `script` command. @type {import('ioredis').Redis | null} */
let scriptRedis = null;
let stopped = false;

/** @returns {import('../src/client').Client} */
function getClient() {
  if (!client) client = new Client({ redis: url, namespace });
  return client;
}

/** @param {number} ms @param {AbortSignal} signal */
function abortableSleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal.aborted) { reject(signal.reason); return; }
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(t); reject(signal.reason); }, { once: true });
  });
}

/**
 * @param {unknown} h
 * @returns {import('../src/runner').Handler}
 */
function makeHandler(h) {
  if (h === 'hold') return (_task, ctx) => abortableSleep(2 ** 31 - 1, ctx.signal);
  if (h === 'done') return () => undefined;
  if (h === 'echo') return (task) => task;
  if (h === 'fail') return () => { throw new Error('conformance failure'); };
  if (h && typeof h === 'object' && typeof (/** @type {any} */ (h).sleep) === 'number') {
    const ms = /** @type {any} */ (h).sleep * 1000;
    return (_task, ctx) => abortableSleep(ms, ctx.signal);
  }
  throw new BadCommand(`unknown handler ${JSON.stringify(h)}`);
}

/**
 * A task as events name it: its text; a payload stored out of line (a
 * stand-in, protocol 10) by its text before its first '.' (a task enqueued
 * with "size" is T padded with '.' bytes).
 * @param {any} e
 */
const taskText = (e) => {
  const big = parseStandin(e.task);
  if (!big) return e.task.toString('utf8');
  const head = big.head.toString('utf8');
  return head.split('.', 1)[0];
};

/**
 * The payloads of an enqueue command: with "size" N, each task T padded with
 * '.' bytes to N bytes (a big payload: protocol 10).
 * @param {Record<string, any>} cmd @returns {(string | Buffer)[]}
 */
function enqueued(cmd) {
  if (cmd.size === undefined) return cmd.tasks;
  if (!Number.isInteger(cmd.size) || cmd.size < 0) throw new BadCommand(`size must be a whole number, got ${cmd.size}`);
  return cmd.tasks.map((/** @type {string} */ t) => {
    const b = Buffer.alloc(Math.max(cmd.size, Buffer.byteLength(t)), '.');
    b.write(t, 0, 'utf8');
    return b;
  });
}

/** @param {Record<string, any>} cmd */
async function handle(cmd) {
  switch (cmd.op) {
    case 'start': {
      const w = new Worker({ redis: url, namespace, ttl: cmd.ttl ?? 3,
        log: (level, msg) => process.stderr.write(`mesh-peer ${level}: ${msg}\n`) });
      // tokens as strings: a JSON number cannot hold every token exactly
      w.on('start', (e) => emit({ event: 'start', queue: e.queue, task: taskText(e), token: String(e.token), worker: e.worker }));
      w.on('stop', (e) => emit({ event: 'stop', queue: e.queue, task: taskText(e), token: String(e.token), reason: e.reason }));
      w.on('done', (e) => emit({ event: 'done', queue: e.queue, task: taskText(e), token: String(e.token), ok: e.ok }));
      w.on('fenced', (e) => emit({ event: 'fenced', worker: e.worker }));
      try {
        await w.start();
      } catch (err) {
        const code = codeOf(err) === 'VERSION' ? 'VERSION' : 'JOIN';
        emit({ event: 'error', op: 'start', code, message: err instanceof Error ? err.message : String(err) });
        process.exit(3);
      }
      worker = w;
      emit({ event: 'ready', worker: w.id, version: PROTOCOL_VERSION });
      return;
    }
    case 'script': {
      // one script by name, expanded by this package's loader, at the vector's time
      let script;
      try {
        script = scriptByName(cmd.name);
      } catch (err) {
        throw new BadCommand(err instanceof Error ? err.message : String(err));
      }
      if (!scriptRedis) {
        scriptRedis = new Redis(url, { maxRetriesPerRequest: 1 });
        scriptRedis.on('error', () => {});
      }
      const source = timePrelude(cmd.time[0], cmd.time[1]) + script.source;
      const keys = cmd.keys || [];
      try {
        const reply = await /** @type {any} */ (scriptRedis).evalBuffer(source, keys.length, ...keys, ...(cmd.args || []));
        emit({ event: 'ack', op: 'script', sha1: script.sha, reply: asJson(reply) });
      } catch (err) {
        emit({ event: 'ack', op: 'script', sha1: script.sha, error: err instanceof Error ? err.message : String(err) });
      }
      return;
    }
    case 'serve': {
      if (!worker) throw new BadCommand('serve before start');
      await worker.serve(cmd.queue, makeHandler(cmd.handler), { concurrency: cmd.concurrency ?? 1 });
      emit({ event: 'ack', op: 'serve', queue: cmd.queue });
      return;
    }
    case 'enqueue': {
      // with "group": into that group of the queue (enqueue_group.lua)
      // with "size": each task padded to that many bytes (a big payload)
      await getClient().enqueue(cmd.queue, enqueued(cmd), cmd.group === undefined ? {} : { group: cmd.group });
      emit({ event: 'ack', op: 'enqueue', added: cmd.tasks.length });
      return;
    }
    case 'ensure': {
      const added = await getClient().ensure(cmd.queue, cmd.tasks);
      emit({ event: 'ack', op: 'ensure', added });
      return;
    }
    case 'cancel': {
      const n = await getClient().cancel(cmd.queue, cmd.task);
      emit({ event: 'ack', op: 'cancel', found: n > 0 });
      return;
    }
    case 'reconcile': {
      const r = await getClient().reconcile(cmd.queue, cmd.tasks);
      emit({ event: 'ack', op: 'reconcile', added: r.added.length, cancelled: r.cancelled.length });
      return;
    }
    case 'stop':
      await stop();
      return;
    default:
      throw new BadCommand(`unknown op ${JSON.stringify(cmd.op)}`);
  }
}

async function stop() {
  if (stopped) return;
  stopped = true;
  if (worker) await worker.stop();
  if (client) await client.close();
  if (scriptRedis) await scriptRedis.quit().catch(() => {});
  emit({ event: 'stopped' });
  process.exit(0);
}

let chain = Promise.resolve();
const rl = readline.createInterface({ input: process.stdin });
rl.on('line', (line) => {
  if (!line.trim()) return;
  chain = chain.then(async () => {
    /** @type {Record<string, any>} */
    let cmd;
    try {
      cmd = JSON.parse(line);
    } catch {
      emit({ event: 'error', op: null, code: 'BAD_COMMAND', message: `not JSON: ${line.slice(0, 200)}` });
      return;
    }
    try {
      await handle(cmd);
    } catch (err) {
      emit({ event: 'error', op: cmd.op, code: codeOf(err), message: err instanceof Error ? err.message : String(err) });
    }
  });
});
rl.on('close', () => { chain = chain.then(stop); });
process.on('SIGTERM', () => { chain = chain.then(stop); });
