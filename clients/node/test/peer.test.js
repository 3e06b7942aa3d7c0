'use strict';
// Node peer processes driven through the conformance line protocol
// (bin/mesh-peer.js): takeover after SIGKILL, self-fence after SIGSTOP,
// graceful stop, refusal of another protocol version.
const test = require('node:test');
const assert = require('node:assert/strict');
const Redis = require('ioredis').default;
const { startRedis, waitFor, Peer, PEER, namespace } = require('./helpers');

/** @type {{url: string, port: number, stop: () => Promise<void>}} */
let server;
/** @type {import('ioredis').Redis} */
let redis;
/** @type {Peer[]} */
const peers = [];
test.before(async () => {
  server = await startRedis();
  redis = new Redis(server.url);
});
test.after(async () => {
  for (const p of peers) if (p.proc.exitCode === null && p.proc.signalCode === null) p.kill('SIGKILL');
  redis.disconnect();
  await server.stop();
});

/** @param {string} ns */
function peer(ns) {
  const p = new Peer(['node', PEER], { url: server.url, namespace: ns });
  peers.push(p);
  return p;
}

test('after a SIGKILL, the other peer takes every persistent task over with larger tokens', async () => {
  const ns = namespace();
  const a = peer(ns);
  const b = peer(ns);
  assert.equal((await a.call({ op: 'start', ttl: 1.5 })).event, 'ready');
  await a.call({ op: 'serve', queue: 'p', concurrency: 10, handler: 'hold' });
  await a.call({ op: 'ensure', queue: 'p', tasks: ['t1', 't2', 't3', 't4'] });
  await a.waitEvent((e) => e.event === 'start' && e.task === 't4');
  assert.equal((await b.call({ op: 'start', ttl: 1.5 })).event, 'ready');
  await b.call({ op: 'serve', queue: 'p', concurrency: 10, handler: 'hold' });
  // the fair share: b pulls two of them (a hands them back once their handlers exited)
  await b.waitEvent((e) => e.event === 'start' && b.events.filter((x) => x.event === 'start').length === 2,
    { timeout: 10000 });
  /** @type {Map<string, string>} */
  const before = new Map();
  for (const e of a.events) if (e.event === 'start') before.set(e.task, e.token);
  const onA = new Set(['t1', 't2', 't3', 't4']);
  for (const e of b.events) if (e.event === 'start') onA.delete(e.task);
  assert.equal(onA.size, 2);
  const killedAt = Date.now();
  a.kill('SIGKILL');
  await a.exited;
  for (const task of onA) {
    const e = await b.waitEvent((x) => x.event === 'start' && x.task === task, { timeout: 10000 });
    // tokens are strings of digits on the line protocol: compared as BigInts
    assert.ok(BigInt(e.token) > BigInt(/** @type {string} */ (before.get(task))), 'a new owner has a larger token');
  }
  // takeover only after the lease ran out (T = 1.5 s), and well within a few TTLs
  const took = Date.now() - killedAt;
  assert.ok(took < 6000, `takeover took ${took} ms`);
  assert.equal(await redis.zscore(`{${ns}}:workers`, a.events[0].worker), null, 'the dead peer was recycled');
  b.send({ op: 'stop' });
  assert.equal(await b.exited, 0);
  assert.equal(b.events.at(-1)?.event, 'stopped');
});

test('a peer stopped (SIGSTOP) past R fences itself; the other takes over; it rejoins under a new id', async () => {
  const ns = namespace();
  const a = peer(ns);
  const b = peer(ns);
  const ready = await a.call({ op: 'start', ttl: 1.5 });
  await a.call({ op: 'serve', queue: 'p', concurrency: 10, handler: 'hold' });
  await a.call({ op: 'ensure', queue: 'p', tasks: ['only'] });
  const first = await a.waitEvent((e) => e.event === 'start');
  await b.call({ op: 'start', ttl: 1.5 });
  await b.call({ op: 'serve', queue: 'p', concurrency: 10, handler: 'hold' });
  a.kill('SIGSTOP');
  const taken = await b.waitEvent((e) => e.event === 'start' && e.task === 'only', { timeout: 10000 });
  assert.ok(BigInt(taken.token) > BigInt(first.token));
  a.kill('SIGCONT');
  const stop = await a.waitEvent((e) => e.event === 'stop' && e.task === 'only', { timeout: 10000 });
  assert.equal(stop.reason, 'fenced');
  await a.waitEvent((e) => e.event === 'fenced' && e.worker === ready.worker);
  // it rejoins under a new id (a fenced id is never reused)
  await waitFor(async () => {
    const ids = await redis.zrange(`{${ns}}:workers`, 0, -1);
    return ids.length === 2 && !ids.includes(ready.worker);
  }, { timeout: 10000, what: 'the fenced peer to rejoin' });
  a.send({ op: 'stop' });
  b.send({ op: 'stop' });
  assert.equal(await a.exited, 0);
  assert.equal(await b.exited, 0);
});

test('stop hands a running one-shot task back; EOF on stdin means stop', async () => {
  const ns = namespace();
  const a = peer(ns);
  await a.call({ op: 'start', ttl: 3 });
  await a.call({ op: 'serve', queue: 'jobs', concurrency: 1, handler: { sleep: 60 } });
  await a.call({ op: 'enqueue', queue: 'jobs', tasks: ['long'] });
  await a.waitEvent((e) => e.event === 'start');
  a.proc.stdin.end();
  assert.equal(await a.exited, 0);
  const stop = a.events.find((e) => e.event === 'stop');
  assert.equal(stop?.reason, 'stopped');
  assert.deepEqual(await redis.lrange(`{${ns}}:queue:jobs`, 0, -1), ['long'], 'back at the head of its queue');
  assert.equal(await redis.zcard(`{${ns}}:workers`), 0);
});

test('a peer exits 3 with code VERSION in a namespace of another protocol version', async () => {
  const ns = namespace();
  await redis.set(`{${ns}}:version`, '8');
  const a = peer(ns);
  const reply = await a.call({ op: 'start', ttl: 3 });
  assert.equal(reply.event, 'error');
  assert.equal(reply.code, 'VERSION');
  assert.match(reply.message, /version/i);
  assert.equal(await a.exited, 3);
});
