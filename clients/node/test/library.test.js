'use strict';
// The library in one process: the script loader, the client and a worker,
// against a real redis-server started here.
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { execFile } = require('node:child_process');
const Redis = require('ioredis').default;
const { Client, Worker, PROTOCOL_VERSION, ConflictError, VersionError } = require('../src/index');
const { loadScripts, runScript, expand } = require('../src/scripts');
const { startRedis, waitFor, namespace, python, REPO } = require('./helpers');

/** @type {{url: string, port: number, stop: () => Promise<void>}} */
let server;
/** @type {import('ioredis').Redis} */
let redis;
test.before(async () => {
  server = await startRedis();
  redis = new Redis(server.url);
});
test.after(async () => {
  redis.disconnect();
  await server.stop();
});

/**
 * A worker of `ns` with a short lease, and the events it reports.
 * @param {string} ns @param {Record<string, any>} [extra]
 */
function makeWorker(ns, extra = {}) {
  const w = new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {}, ...extra });
  /** @type {Record<string, any>[]} */
  const events = [];
  for (const kind of ['start', 'stop', 'done']) {
    w.on(kind, (e) => events.push({ kind, ...e, task: e.task.toString() }));
  }
  return { w, events };
}

/** A handler that runs until its signal is aborted. @param {Buffer} _t @param {{signal: AbortSignal}} ctx */
const hold = (_t, ctx) => new Promise((_resolve, reject) => {
  ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason), { once: true });
});

test('the loader splices the includes in, as the Python loader does (same SHA-1s)', async () => {
  const scripts = loadScripts();
  for (const s of scripts.values()) {
    assert.doesNotMatch(s.source, /^--!include/m, `${s.name} still has an include line`);
    assert.match(s.sha, /^[0-9a-f]{40}$/);
  }
  // enqueue.lua names wake_idle, which brings nudge, and nothing it does not call
  const enqueue = /** @type {import('../src/scripts').Script} */ (scripts.get('enqueue'));
  assert.match(enqueue.source, /^local function nudge\(/m);
  assert.match(enqueue.source, /^local function wake_idle\(/m);
  assert.doesNotMatch(enqueue.source, /^local function fair_share\(/m);
  const code = 'import json; from mesh._scripts import load_scripts; '
    + 'print(json.dumps({n: s.sha for n, s in load_scripts().items()}))';
  const out = await new Promise((resolve, reject) => {
    execFile(python(), ['-c', code], { cwd: REPO, encoding: 'utf8' }, (err, stdout, stderr) => {
      if (err) reject(new Error(`${err.message}\n${stderr}`)); else resolve(stdout);
    });
  });
  const py = JSON.parse(/** @type {string} */ (out));
  for (const s of scripts.values()) assert.equal(s.sha, py[s.name], `${s.name}: SHA-1 differs from Python's`);
});

test('an include cycle is an error', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'mesh-include-'));
  fs.mkdirSync(path.join(dir, 'include'));
  fs.writeFileSync(path.join(dir, 'include', 'a.lua'), '--!include include/b.lua\n');
  fs.writeFileSync(path.join(dir, 'include', 'b.lua'), '--!include include/a.lua\n');
  fs.writeFileSync(path.join(dir, 's.lua'), '--!include include/a.lua\nreturn 1\n');
  assert.throws(() => expand(dir, 's.lua'), /include cycle s\.lua -> include\/a\.lua -> include\/b\.lua/);
  fs.rmSync(dir, { recursive: true, force: true });
});

test('a script runs again after SCRIPT FLUSH (EVALSHA falls back to EVAL on NOSCRIPT)', async () => {
  const ns = namespace();
  const { Keys } = require('../src/keys');
  const k = new Keys(ns);
  await redis.script('FLUSH');
  const r = await runScript(redis, 'reap_check', [k.workers], [10, 0]);
  assert.equal(Number(r[2]), 0);
  const [exists] = /** @type {any} */ (await redis.script('EXISTS', loadScripts().get('reap_check')?.sha ?? ''));
  assert.equal(exists, 1);
});

test('one-shot tasks run once each, and a kept result is awaited', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { Keys } = require('../src/keys');
  await redis.hset(new Keys(ns).policy, 'jobs', JSON.stringify({ max_attempts: 3, backoff_ms: 100,
    backoff_max_ms: 1000, timeout_ms: 0, result_ttl_ms: 60000, source: 'configure' }));
  const { w, events } = makeWorker(ns);
  await w.serve('jobs', (task) => `node:${task}`, { concurrency: 4 });
  await w.start();
  try {
    const tasks = Array.from({ length: 20 }, (_, i) => `t${i}`);
    await client.enqueue('jobs', tasks);
    assert.equal((await client.result('jobs', 't7', { timeoutMs: 10000 }))?.toString(), 'node:t7');
    await waitFor(() => events.filter((e) => e.kind === 'done').length === 20);
    const ran = events.filter((e) => e.kind === 'start').map((e) => e.task).sort();
    assert.deepEqual(ran, [...tasks].sort());
    assert.equal(await redis.llen(`{${ns}}:queue:jobs`), 0);
    assert.equal(await redis.hlen(`{${ns}}:procs:jobs`), 0);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('a failing task is retried and then dead-lettered; result() says so', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { Keys } = require('../src/keys');
  await redis.hset(new Keys(ns).policy, 'bad', JSON.stringify({ max_attempts: 2, backoff_ms: 50,
    backoff_max_ms: 100, timeout_ms: 0, result_ttl_ms: 60000, source: 'configure' }));
  const { w, events } = makeWorker(ns);
  await w.serve('bad', () => { throw new Error('no luck'); });
  await w.start();
  try {
    await client.enqueue('bad', 'x');
    await assert.rejects(client.result('bad', 'x', { timeoutMs: 10000 }),
      (err) => err instanceof Error && err.name === 'DeadLetterError' && /Error: no luck/.test(err.message));
    assert.equal(events.filter((e) => e.kind === 'done' && e.ok === false).length, 2);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('persistent tasks: each runs on one worker, with growing tokens; cancel stops it', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { w, events } = makeWorker(ns);
  /** @type {bigint[]} */
  const tokens = [];
  await w.serve('devices', (t, ctx) => { tokens.push(ctx.token); return hold(t, ctx); }, { concurrency: 10 });
  await w.start();
  try {
    assert.equal(await client.ensure('devices', ['d1', 'd2', 'd3']), 3);
    assert.equal(await client.ensure('devices', 'd1'), 0, 'ensure is unique per payload');
    await assert.rejects(client.enqueue('devices', 'd1'), ConflictError);
    await waitFor(() => events.filter((e) => e.kind === 'start').length === 3);
    assert.equal(new Set(tokens).size, 3);
    const tasks = await client.persistentTasks('devices');
    assert.deepEqual([...tasks.keys()].sort(), ['d1', 'd2', 'd3']);
    assert.ok([...tasks.values()].every((pid) => pid !== null), 'every task has its process');
    assert.equal(await client.cancel('devices', 'd2'), 1);
    const stop = await waitFor(() => events.find((e) => e.kind === 'stop' && e.task === 'd2'));
    assert.equal(stop.reason, 'cancelled');
    // reconcile: d1 stays, d3 goes, d4 comes
    const r = await client.reconcile('devices', ['d1', 'd4']);
    assert.deepEqual(r, { added: ['d4'], cancelled: ['d3'] });
    const d4 = await waitFor(() => events.find((e) => e.kind === 'start' && e.task === 'd4'));
    assert.ok(BigInt(d4.token) > tokens[2], 'a later claim has a larger token');
    assert.deepEqual([...(await client.persistentTasks('devices')).keys()].sort(), ['d1', 'd4']);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('a cancel whose message is lost arrives through the heartbeat inbox', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { w, events } = makeWorker(ns);
  await w.serve('p', hold);
  await w.start();
  try {
    await client.ensure('p', 'only');
    await waitFor(() => events.find((e) => e.kind === 'start'));
    // deaf to the cancel channel: only the durable inbox can tell the worker
    const ch = w.keys.cancelChannel(w.id);
    await w.sub.unsubscribe(ch);
    await w.sub.sunsubscribe(ch).catch(() => {});
    assert.equal(await client.cancel('p', 'only'), 1);
    assert.equal(await redis.scard(w.keys.inbox(w.id)), 1);
    const stop = await waitFor(() => events.find((e) => e.kind === 'stop'), { timeout: 5000 });
    assert.equal(stop.reason, 'cancelled');
    // acknowledged by the next heartbeat
    await waitFor(async () => (await redis.scard(w.keys.inbox(w.id))) === 0, { timeout: 5000 });
  } finally {
    await w.stop();
    await client.close();
  }
});

test('a graceful stop hands persistent tasks back once their handlers exited; a peer takes them', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const a = makeWorker(ns);
  const b = makeWorker(ns);
  /** @type {Set<string>} */
  const exited = new Set();
  const slowHold = (/** @type {Buffer} */ t, /** @type {any} */ ctx) => hold(t, ctx).finally(() => exited.add(t.toString()));
  await a.w.serve('p', slowHold, { concurrency: 10 });
  await a.w.start();
  await b.w.serve('p', hold, { concurrency: 10 });
  try {
    await client.ensure('p', ['x', 'y', 'z', 'w']);
    await waitFor(() => a.events.filter((e) => e.kind === 'start').length === 4);
    await b.w.start();
    // rebalance: b asks for its share, a hands two back
    await waitFor(() => b.events.filter((e) => e.kind === 'start').length === 2, { timeout: 10000 });
    assert.equal(a.events.filter((e) => e.kind === 'stop' && e.reason === 'moved').length, 2);
    await a.w.stop();
    assert.equal(a.events.filter((e) => e.kind === 'stop' && e.reason === 'stopped').length, 2);
    assert.equal(exited.size, 4, 'every handler of a exited before its stop returned');
    await waitFor(() => b.events.filter((e) => e.kind === 'start').length === 4, { timeout: 10000 });
    assert.equal(await redis.zscore(`{${ns}}:workers`, a.w.id), null, 'a left the mesh');
  } finally {
    await b.w.stop();
    await client.close();
  }
});

test('a worker refuses a namespace of another protocol version', async () => {
  const ns = namespace();
  await redis.set(`{${ns}}:version`, '6');
  const { w } = makeWorker(ns);
  await assert.rejects(w.start(), (err) => err instanceof VersionError && err.code === 'VERSION');
  assert.equal(await redis.get(`{${ns}}:version`), '6');
  assert.equal(PROTOCOL_VERSION, '11');
});

test("a queue without a policy gets the worker's options as its policy; a handler timeout fails the attempt", async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { w } = makeWorker(ns, { maxAttempts: 1 });
  await w.serve('free', hold);
  await w.start();
  try {
    const stored = JSON.parse(/** @type {string} */ (await redis.hget(`{${ns}}:policy`, 'free')));
    assert.equal(stored.max_attempts, 1);
    assert.equal(stored.source, `worker ${w.id}`);
    await redis.hset(`{${ns}}:policy`, 'free', JSON.stringify({ ...stored, timeout_ms: 200, result_ttl_ms: 60000 }));
    // the policy is re-read at every heartbeat (H = 0.5 s here): wait until this worker has it
    const runner = /** @type {any} */ (w.gen.runners.get('free'));
    await waitFor(() => runner.policy.timeoutMs === 200);
    await client.enqueue('free', 'slow');
    await assert.rejects(client.result('free', 'slow', { timeoutMs: 10000 }),
      (err) => err instanceof Error && /TimeoutError: the handler ran longer than 0\.2 s/.test(err.message));
  } finally {
    await w.stop();
    await client.close();
  }
});

test('result() keeps the awaiting key while it waits, so finish publishes the done message', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { Keys } = require('../src/keys');
  const k = new Keys(ns);
  try {
    const waiting = client.result('r', 'x', { timeoutMs: 15000 });
    // set after subscribing, with a TTL of 10 s
    const pttl = await waitFor(async () => {
      const t = await redis.pttl(k.awaiting('r'));
      return t > 0 ? t : null;
    }, { what: 'the awaiting key' });
    assert.ok(pttl <= 10000, `pttl ${pttl}`);
    // a finish_results as a worker would do it: the record, then the message
    const value = Buffer.from('v1');
    await redis.set(k.result('r', Buffer.from('x')), Buffer.concat([
      Buffer.from(`v\0${Date.now()}\0w\0${value.length}\0`), value, Buffer.from('x')]));
    await redis.publish(k.doneChannel('r'), 'x');
    assert.equal((await waiting)?.toString(), 'v1');
  } finally {
    await client.close();
  }
});

test('a persistent task whose handler returns once stopped is handed back, not finished', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const { w, events } = makeWorker(ns);
  // returns (does not throw) when its signal is aborted
  await w.serve('p', (_t, ctx) => new Promise((resolve) => ctx.signal.addEventListener('abort', resolve)));
  await w.start();
  try {
    await client.ensure('p', 'keep-me');
    await waitFor(() => events.find((e) => e.kind === 'start'));
  } finally {
    await w.stop();
  }
  assert.equal(events.find((e) => e.kind === 'stop')?.reason, 'stopped');
  assert.equal(events.filter((e) => e.kind === 'done').length, 0);
  assert.deepEqual([...(await client.persistentTasks('p')).entries()], [['keep-me', null]], 'still a persistent task, waiting');
  assert.deepEqual(await redis.lrange(`{${ns}}:queue:p`, 0, -1), ['keep-me']);
  await client.close();
});

test('a failed attempt is recorded as its line, then its stack frames, 2000 bytes at most', () => {
  const { describeError } = require('../src/runner');
  function lookUp() { throw new TypeError(`no such thing ${'x'.repeat(5000)}`); }
  function handler() { lookUp(); }
  let text = '';
  try { handler(); } catch (err) { text = describeError(err); }
  const [head, ...frames] = text.split('\n');
  assert.ok(head.startsWith('TypeError: no such thing xxx') && head.endsWith('...'), head);
  assert.equal(head.length, 500);
  assert.ok(frames.length >= 2 && frames.every((f) => /^\s+at /.test(f)), text);
  assert.match(frames[0], /at lookUp /);
  assert.match(frames[1], /at handler /);
  assert.ok(Buffer.byteLength(text) <= 2000);
  // no stack: the line alone
  assert.equal(describeError('plain'), 'string: plain');
});
