'use strict';
// Every duty of a worker (protocol/README.md, "What a worker must do"), with
// Node workers only, against a real redis-server started here: ticks of a
// scheduled queue, result records, per-minute counts, the pause key, the
// rate limit, handler timeouts, and tokens above 2^53.
const test = require('node:test');
const assert = require('node:assert/strict');
const Redis = require('ioredis').default;
const { Client, Worker } = require('../src/index');
const { Keys } = require('../src/keys');
const { startRedis, waitFor, namespace } = require('./helpers');

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
 * Two Node workers of `ns` (no Python peer), each serving `queue` with
 * `handler`, and the events they report.
 * @param {string} ns @param {string} queue
 * @param {import('../src/runner').Handler} handler @param {number} [concurrency]
 */
async function nodeOnly(ns, queue, handler, concurrency = 2) {
  /** @type {Record<string, any>[]} */
  const events = [];
  const workers = [0, 1].map(() => new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {} }));
  for (const w of workers) {
    for (const kind of ['start', 'stop', 'done']) {
      w.on(kind, (e) => events.push({ kind, at: Date.now(), ...e, task: e.task.toString() }));
    }
    await w.serve(queue, handler, { concurrency });
    await w.start();
  }
  return { workers, events, stop: () => Promise.all(workers.map((w) => w.stop())) };
}

test('a Node-only worker set fires the ticks of a scheduled queue, each once', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const set = await nodeOnly(ns, 'tick', () => undefined);
  try {
    assert.equal(await client.schedule('tick', 'beat', { everyMs: 200 }), true);
    await waitFor(() => set.events.filter((e) => e.kind === 'done').length >= 4,
      { timeout: 10000, what: '4 ticks run' });
    // one copy per tick across the mesh: every run has its own token, and the
    // schedule's next tick is in the future
    const runs = set.events.filter((e) => e.kind === 'start');
    assert.equal(new Set(runs.map((e) => e.token)).size, runs.length);
    const [sec] = await redis.time();
    const next = Number(await redis.zscore(new Keys(ns).schedules, Buffer.from('tick\0beat')));
    assert.ok(next > Number(sec) * 1000 - 200, `next tick ${next}`);
  } finally {
    await set.stop();
    await client.close();
  }
});

test('a Node-only worker set writes the result records of a queue that keeps results, and the per-minute counts', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const stored = await client.configure('kept', { result_ttl_ms: 60000 });
  assert.equal(stored.result_ttl_ms, 60000);
  const set = await nodeOnly(ns, 'kept', (task) => `done ${task}`);
  try {
    await client.enqueue('kept', ['x', 'y']);
    assert.deepEqual(await client.result('kept', 'x', { timeoutMs: 10000 }), Buffer.from('done x'));
    assert.deepEqual(await client.result('kept', 'y', { timeoutMs: 10000 }), Buffer.from('done y'));
    // stats.lua every 5 s: the queue's per-minute counts count both
    const k = new Keys(ns);
    await waitFor(async () => {
      const h = await redis.hgetall(k.stats('kept'));
      return Object.entries(h).filter(([f]) => f.startsWith('p')).reduce((a, [, v]) => a + Number(v), 0) >= 2;
    }, { timeout: 8000, what: 'the per-minute counts of queue kept' });
  } finally {
    await set.stop();
    await client.close();
  }
});

test('a job the Node client enqueues into a queue that keeps enqueue times gets one, which leaves when a Node worker finishes it', async () => {
  const ns = namespace();
  const k = new Keys(ns);
  const client = new Client({ redis: server.url, namespace: ns });
  assert.equal((await client.configure('timed', { enqueue_times: 1 })).enqueue_times, 1);
  assert.equal(await redis.sismember(k.timed, 'timed'), 1);
  await assert.rejects(client.configure('timed', { enqueue_times: 2 }), /enqueue_times must be a whole number from 0 to 1/);
  const [sec] = await redis.time();
  await client.enqueue('timed', ['x', 'y']);
  await client.enqueue('timed', ['z'], { group: 'g' });
  for (const p of ['x', 'y', 'z']) {
    const at = Number(await redis.zscore(k.enqt('timed'), p));
    assert.ok(Math.abs(at - Number(sec) * 1000) < 5000, `${p} enqueued at ${at}`);
  }
  await client.enqueue('plain', ['p']);
  assert.equal(await redis.exists(k.enqt('plain')), 0);
  const set = await nodeOnly(ns, 'timed', () => {});
  try {
    await waitFor(async () => (await redis.exists(k.enqt('timed'))) === 0,
      { timeout: 10000, what: 'the enqueue times to leave with the finished jobs' });
  } finally {
    await set.stop();
    await client.close();
  }
});

test('a paused queue starts nothing until resumed; the rate limit spaces the claims across workers', async () => {
  const ns = namespace();
  const k = new Keys(ns);
  const client = new Client({ redis: server.url, namespace: ns });
  await client.configure('rl', { rate_limit: 2, rate_period_ms: 1000 });
  const set = await nodeOnly(ns, 'rl', () => undefined, 4);
  try {
    await redis.set(k.paused('rl'), '1');
    await client.enqueue('rl', ['a0', 'a1', 'a2', 'a3', 'a4', 'a5']);
    // a window in which nothing may start: the queue is paused
    await new Promise((resolve) => setTimeout(resolve, 1000));
    assert.equal(set.events.filter((e) => e.kind === 'start').length, 0);
    await redis.del(k.paused('rl'));
    await waitFor(() => set.events.filter((e) => e.kind === 'done').length >= 6,
      { timeout: 10000, what: 'the 6 tasks done' });
    // a token bucket of 2 per second (a burst of 2): never more starts in a
    // window than it lets through (one start of reading jitter forgiven)
    const starts = set.events.filter((e) => e.kind === 'start').map((e) => e.at).sort((a, b) => a - b);
    for (let i = 0; i < starts.length; i++) {
      for (let j = i; j < starts.length; j++) {
        const allowed = 2 + (2 * (starts[j] - starts[i] + 50)) / 1000 + 1;
        assert.ok(j - i + 1 <= allowed, `${j - i + 1} starts within ${starts[j] - starts[i]} ms`);
      }
    }
  } finally {
    await set.stop();
    await client.close();
  }
});

test("a handler past its queue's timeout stops with reason 'timeout' and fails its attempt", async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  await client.configure('slow', { timeout_ms: 300, max_attempts: 1 });
  /** @type {import('../src/runner').Handler} */
  const hold = (_t, ctx) => new Promise((_resolve, reject) => {
    ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason), { once: true });
  });
  const set = await nodeOnly(ns, 'slow', hold);
  try {
    await client.enqueue('slow', 's0');
    await waitFor(() => set.events.some((e) => e.kind === 'stop' && e.reason === 'timeout'),
      { timeout: 5000, what: "a stop event with reason 'timeout'" });
    const dead = await waitFor(async () => {
      const d = await redis.lrange(new Keys(ns).dead('slow'), 0, -1);
      return d.length ? d : null;
    }, { timeout: 5000, what: 'the dead letter' });
    assert.equal(dead[0].split('\0')[3], 'TimeoutError: the handler ran longer than 0.3 s');
  } finally {
    await set.stop();
    await client.close();
  }
});

test('tokens above 2^53 reach the handler intact (a string id and a BigInt token)', async () => {
  const ns = namespace();
  const k = new Keys(ns);
  const client = new Client({ redis: server.url, namespace: ns });
  /** @type {{id: string, token: bigint}[]} */
  const seen = [];
  const w = new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {} });
  await w.serve('big', (_t, ctx) => {
    seen.push({ id: ctx.id, token: ctx.token });
    return new Promise((resolve) => ctx.signal.addEventListener('abort', () => resolve(undefined), { once: true }));
  }, { concurrency: 4 });
  await w.start();
  try {
    // one claim of three: ids 2^53 + 4 .. 2^53 + 6 (2^53 + 5 is no double)
    await redis.set(k.token, '9007199254740994');
    await client.ensure('big', ['b0', 'b1', 'b2']);
    await waitFor(() => seen.length === 3, { what: 'three handlers' });
    const held = (await redis.hkeys(k.procs('big'))).sort();
    assert.deepEqual(seen.map((s) => s.id).sort(), held);
    assert.ok(held.includes('9007199254740997'), `ids ${held}`);
    for (const s of seen) {
      assert.equal(typeof s.token, 'bigint');
      assert.equal(s.token, BigInt(s.id));
      assert.ok(s.token > 9007199254740994n);
    }
  } finally {
    await w.stop();
    await client.close();
  }
});
