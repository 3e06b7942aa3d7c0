'use strict';
/**
 * Two Node workers share persistent "device" tasks (each device owned by
 * exactly one worker, with a fencing token), run one-shot jobs whose results
 * a client awaits, hand their devices over on a graceful stop, and stop a
 * device cancelled from outside.
 *
 *   npm run example                      # starts a redis-server of its own
 *   MESH_REDIS_URL=redis://127.0.0.1:6380/0 npm run example   # or uses yours
 *
 * It writes only to a namespace of its own (example-<random>), deleted at the end.
 */
const { spawn } = require('node:child_process');
const crypto = require('node:crypto');
const net = require('node:net');
const { Client, Worker } = require('../src/index');

/** @returns {Promise<{url: string, stop: () => void}>} */
async function redisServer() {
  if (process.env.MESH_REDIS_URL) return { url: process.env.MESH_REDIS_URL, stop: () => {} };
  const port = await new Promise((resolve) => {
    const s = net.createServer().listen(0, '127.0.0.1', () => {
      const p = /** @type {net.AddressInfo} */ (s.address()).port;
      s.close(() => resolve(p));
    });
  });
  const bin = process.env.MESH_REDIS_SERVER || 'redis-server';
  const proc = spawn(bin, ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no',
    '--notify-keyspace-events', 'Ex'], { stdio: 'ignore' });
  proc.on('error', (err) => {
    process.stderr.write(`could not start ${bin} (${err.message}); set MESH_REDIS_URL to a Redis of yours\n`);
    process.exit(2);
  });
  for (let i = 0; i < 200; i++) {
    const up = await new Promise((resolve) => {
      const c = net.connect(port, '127.0.0.1', () => { c.end(); resolve(true); });
      c.on('error', () => resolve(false));
    });
    if (up) break;
    await new Promise((r) => setTimeout(r, 25));
  }
  return { url: `redis://127.0.0.1:${port}/0`, stop: () => proc.kill() };
}

/** Resolves when `signal` is aborted (a persistent task's handler runs until then). @param {AbortSignal} signal */
const aborted = (signal) => new Promise((_resolve, reject) => {
  signal.addEventListener('abort', () => reject(signal.reason), { once: true });
});

/**
 * A worker that prints each device it takes or lets go of. `held` is what its
 * events said so far: the example waits on it, not on Redis, so that every
 * line is printed under the heading of the step that caused it (a claim is in
 * Redis a moment before its handler starts and its event is emitted).
 * @param {string} name
 */
function makeWorker(name, /** @type {string} */ url, /** @type {string} */ namespace) {
  const w = new Worker({ redis: url, namespace, ttl: 3, id: `${name}-${crypto.randomBytes(2).toString('hex')}` });
  /** @type {Set<string>} */
  const held = new Set();
  w.on('start', (e) => {
    if (!e.persistent) return;
    held.add(String(e.task));
    console.log(`  ${name} owns ${e.task} (token ${e.token})`);
  });
  w.on('stop', (e) => {
    if (!held.delete(String(e.task))) return;
    console.log(`  ${name} let go of ${e.task}: ${e.reason}`);
  });
  // a device handler: holds the device until told to stop
  w.serve('devices', (_task, ctx) => aborted(ctx.signal), { concurrency: 10 });
  // a job handler: returns a result (kept: the queue's policy has a result TTL)
  w.serve('jobs', (task) => `${name} resized ${task}`, { concurrency: 4 });
  return { w, held };
}

async function main() {
  const server = await redisServer();
  const namespace = `example-${crypto.randomBytes(3).toString('hex')}`;
  const client = new Client({ redis: server.url, namespace });
  try {
    await client.redis.hset(`{${namespace}}:policy`, 'jobs', JSON.stringify({ max_attempts: 3,
      backoff_ms: 500, backoff_max_ms: 5000, timeout_ms: 0, result_ttl_ms: 60000, source: 'configure' }));
    const { w: a, held: alpha } = makeWorker('alpha', server.url, namespace);
    const { w: b, held: beta } = makeWorker('beta', server.url, namespace);
    await a.start();
    console.log('4 devices, one worker:');
    await client.ensure('devices', ['dev-1', 'dev-2', 'dev-3', 'dev-4']);
    await waitUntil(async () => alpha.size === 4);
    console.log('a second worker joins; rebalancing moves two devices to it:');
    await b.start();
    await waitUntil(async () => alpha.size === 2 && beta.size === 2);
    console.log('a job, awaited:');
    await client.enqueue('jobs', 'photo-17.jpg');
    console.log(`  result: ${await client.result('jobs', 'photo-17.jpg', { timeoutMs: 10000 })}`);
    console.log('cancel dev-1, wherever it runs:');
    await client.cancel('devices', 'dev-1');
    await waitUntil(async () => !alpha.has('dev-1') && !beta.has('dev-1'));
    console.log('alpha stops gracefully; beta takes its devices over:');
    await a.stop();
    await waitUntil(async () => alpha.size === 0 && beta.size === 3);
    console.log('beta stops:');
    await b.stop();
    await waitUntil(async () => beta.size === 0);
    console.log('done');
  } finally {
    for await (const keys of client.redis.scanStream({ match: `{${namespace}}:*`, count: 1000 })) {
      if (keys.length) await client.redis.del(...keys);
    }
    await client.close();
    server.stop();
  }
}

/** @param {() => Promise<boolean>} cond */
async function waitUntil(cond) {
  const until = Date.now() + 15000;
  while (!(await cond())) {
    if (Date.now() > until) throw new Error('the example timed out');
    await new Promise((r) => setTimeout(r, 50));
  }
}

main().catch((err) => {
  console.error(err);
  process.exit(1);
});
