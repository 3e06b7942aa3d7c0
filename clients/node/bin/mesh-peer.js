#!/usr/bin/env node
'use strict';
/**
 * The conformance line protocol's peer (protocol/conformance/README.md):
 * commands as JSON lines on stdin, events as JSON lines on stdout, logs on
 * stderr. Redis and namespace from MESH_REDIS_URL and MESH_NAMESPACE.
 */
const readline = require('node:readline');
const { Client, Worker, PROTOCOL_VERSION } = require('../src/index');

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
  if (h === 'fail') return () => { throw new Error('conformance failure'); };
  if (h && typeof h === 'object' && typeof (/** @type {any} */ (h).sleep) === 'number') {
    const ms = /** @type {any} */ (h).sleep * 1000;
    return (_task, ctx) => abortableSleep(ms, ctx.signal);
  }
  throw new Error(`unknown handler ${JSON.stringify(h)}`);
}

/** @param {any} e */
const taskText = (e) => e.task.toString('utf8');

/** @param {Record<string, any>} cmd */
async function handle(cmd) {
  switch (cmd.op) {
    case 'start': {
      const w = new Worker({ redis: url, namespace, ttl: cmd.ttl ?? 3,
        log: (level, msg) => process.stderr.write(`mesh-peer ${level}: ${msg}\n`) });
      w.on('start', (e) => emit({ event: 'start', queue: e.queue, task: taskText(e), token: Number(e.token), worker: e.worker }));
      w.on('stop', (e) => emit({ event: 'stop', queue: e.queue, task: taskText(e), token: Number(e.token), reason: e.reason }));
      w.on('done', (e) => emit({ event: 'done', queue: e.queue, task: taskText(e), token: Number(e.token), ok: e.ok }));
      w.on('fenced', (e) => emit({ event: 'fenced', worker: e.worker }));
      try {
        await w.start();
      } catch (err) {
        const code = err instanceof Error && 'code' in err && typeof err.code === 'string' ? err.code : 'ERROR';
        emit({ event: 'error', op: 'start', code, message: err instanceof Error ? err.message : String(err) });
        process.exit(3);
      }
      worker = w;
      emit({ event: 'ready', worker: w.id, version: PROTOCOL_VERSION });
      return;
    }
    case 'serve': {
      if (!worker) throw new Error('serve before start');
      await worker.serve(cmd.queue, makeHandler(cmd.handler), { concurrency: cmd.concurrency ?? 1 });
      emit({ event: 'ack', op: 'serve', queue: cmd.queue });
      return;
    }
    case 'enqueue': {
      await getClient().enqueue(cmd.queue, cmd.tasks);
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
      throw new Error(`unknown op ${JSON.stringify(cmd.op)}`);
  }
}

async function stop() {
  if (stopped) return;
  stopped = true;
  if (worker) await worker.stop();
  if (client) await client.close();
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
      emit({ event: 'error', code: 'BAD_LINE', message: `not JSON: ${line.slice(0, 200)}` });
      return;
    }
    try {
      await handle(cmd);
    } catch (err) {
      const code = err instanceof Error && 'code' in err && typeof err.code === 'string' ? err.code : 'ERROR';
      emit({ event: 'error', op: cmd.op, code, message: err instanceof Error ? err.message : String(err) });
    }
  });
});
rl.on('close', () => { chain = chain.then(stop); });
process.on('SIGTERM', () => { chain = chain.then(stop); });
