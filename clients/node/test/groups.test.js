'use strict';
// Groups of a queue (protocol/README.md, "Groups") from the Node peer: its
// claims go through claim.lua, so they honour the groups' caps, pauses and
// turns; its client puts jobs into groups, configures, pauses and cancels.
const test = require('node:test');
const assert = require('node:assert/strict');
const Redis = require('ioredis').default;
const { Client, Worker, CommandError } = require('../src/index');
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
 * A worker of `ns`, its client, and the start/done events it reports.
 * @param {string} ns
 */
function setup(ns) {
  const w = new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {} });
  const client = new Client({ redis: server.url, namespace: ns });
  /** @type {Record<string, any>[]} */
  const events = [];
  for (const kind of ['start', 'stop', 'done']) {
    w.on(kind, (e) => events.push({ kind, ...e, task: e.task.toString() }));
  }
  return { w, client, events };
}

const tick = () => new Promise((resolve) => setTimeout(resolve, 20));

test('a group of concurrency 1 runs its jobs one at a time, in order, on a worker of concurrency 4', async () => {
  const ns = namespace();
  const { w, client, events } = setup(ns);
  let active = 0; let most = 0;
  /** @type {(string | null)[]} */
  const groups = [];
  await w.serve('jobs', async (_task, ctx) => {
    groups.push(ctx.group);
    active += 1;
    most = Math.max(most, active);
    for (let i = 0; i < 3; i++) await tick();
    active -= 1;
  }, { concurrency: 4 });
  try {
    assert.equal(await client.configureGroup('jobs', 'acct-1', { concurrency: 1 }), '1,,,');
    await w.start();
    const jobs = ['j1', 'j2', 'j3', 'j4', 'j5'];
    assert.equal(await client.enqueue('jobs', jobs, { group: 'acct-1' }), 5);
    await waitFor(() => events.filter((e) => e.kind === 'done').length === 5);
    assert.equal(most, 1, 'two jobs of the group ran at once');
    assert.deepEqual(events.filter((e) => e.kind === 'start').map((e) => e.task), jobs);
    assert.deepEqual(groups, Array(5).fill('acct-1'));
    assert.ok(events.filter((e) => e.kind === 'start').every((e) => e.group === 'acct-1' && !e.persistent));
    await waitFor(async () => (await redis.hget(`{${ns}}:groups:jobs`, 'r:acct-1')) === null);
    assert.equal(await redis.exists(`{${ns}}:gq:jobs|acct-1`, `{${ns}}:gready:jobs`), 0);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('claims take turns among the groups and the ungrouped tasks; a paused group waits', async () => {
  const ns = namespace();
  const { w, client, events } = setup(ns);
  await w.serve('rr', () => undefined, { concurrency: 1 });
  try {
    await client.enqueue('rr', ['a1', 'a2', 'a3'], { group: 'a' });
    await client.enqueue('rr', ['b1', 'b2', 'b3'], { group: 'b' });
    await client.enqueue('rr', ['u1', 'u2', 'u3']);
    await client.enqueue('rr', ['p1'], { group: 'p' });
    assert.equal(await client.pauseGroup('rr', 'p'), true);
    assert.equal(await client.pauseGroup('rr', 'p'), false, 'paused already');
    await w.start();
    await waitFor(() => events.filter((e) => e.kind === 'done').length === 9);
    // a turn is three jobs: each group (and the ungrouped tasks) runs its
    // three in one turn, in order, and every one has its turn
    const order = events.filter((e) => e.kind === 'start').map((e) => e.task);
    const turns = [];
    for (let i = 0; i < 9; i += 3) {
      const turn = order.slice(i, i + 3);
      const who = turn[0][0];
      assert.deepEqual(turn, [1, 2, 3].map((k) => `${who}${k}`), `turn ${i / 3} was ${turn} (all: ${order})`);
      turns.push(who);
    }
    assert.equal(turns.sort().join(''), 'abu', `turns ${turns} (all: ${order})`);
    assert.ok(!order.includes('p1'), 'a job of a paused group started');
    assert.equal(await redis.llen(`{${ns}}:gq:rr|p`), 1);
    assert.equal(await client.resumeGroup('rr', 'p'), true);
    const p1 = await waitFor(() => events.find((e) => e.kind === 'done' && e.task === 'p1'));
    assert.equal(p1.ok, true);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('a weight of 3 gives its group three starts for each of a group of weight 1', async () => {
  const ns = namespace();
  const { w, client, events } = setup(ns);
  await w.serve('wq', () => undefined, { concurrency: 1 });
  try {
    await client.configureGroup('wq', 'heavy', { weight: 3 });
    await client.enqueue('wq', Array.from({ length: 6 }, (_, i) => `h${i}`), { group: 'heavy' });
    await client.enqueue('wq', Array.from({ length: 6 }, (_, i) => `l${i}`), { group: 'light' });
    await w.start();
    await waitFor(() => events.filter((e) => e.kind === 'done').length === 12);
    const first8 = events.filter((e) => e.kind === 'start').slice(0, 8).map((e) => e.task[0]);
    assert.equal(first8.filter((c) => c === 'h').length, 6, `first starts: ${first8}`);
  } finally {
    await w.stop();
    await client.close();
  }
});

test('cancel with a group removes its queued and delayed copies; settings are checked', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  try {
    assert.equal(await client.enqueue('cq', ['x', 'y'], { group: 'g1' }), 2);
    assert.equal(await client.enqueue('cq', ['z'], { group: 'g1', delayMs: 60000 }), 1);
    assert.equal(await client.cancel('cq', 'x'), 0, 'without the group its list is not looked at');
    assert.equal(await client.cancel('cq', 'x', { group: 'g1' }), 1);
    assert.equal(await client.cancel('cq', 'z', { group: 'g1' }), 1);
    assert.deepEqual(await redis.lrange(`{${ns}}:gq:cq|g1`, 0, -1), ['y']);
    assert.equal(await redis.zcard(`{${ns}}:gdelayed:cq`), 0);
    await assert.rejects(client.enqueue('cq', 'a', { group: 'g1', priority: 10 }), /priority must be/);
    // a group's job with a priority goes before its others (protocol 10)
    assert.equal(await client.enqueue('cq', ['p'], { group: 'g1', priority: 4 }), 2);
    const prio = await redis.zrange(`{${ns}}:gp:cq|g1`, 0, -1);
    assert.equal(prio.length, 1);
    assert.ok(prio[0].startsWith('4') && prio[0].endsWith('p'), prio[0]);
    assert.equal(await client.cancel('cq', 'p', { group: 'g1' }), 1);
    assert.equal(await redis.exists(`{${ns}}:gp:cq|g1`), 0);
    await assert.rejects(client.enqueue('cq', 'a', { group: 'bad group' }), /invalid group name/);
    await assert.rejects(client.configureGroup('cq', 'g1', { weight: 5000 }),
      (err) => err instanceof CommandError && /BAD_ARG/.test(`${err.code} ${err.message}`));
    assert.equal(await client.configureGroup('cq', '', { concurrency: 2, rateLimit: 10 }), '2,10,,');
    assert.equal(await client.configureGroup('cq', '', { weight: 4 }), '2,10,,4');
    await client.clearGroup('cq', '');
    assert.equal(await redis.hget(`{${ns}}:groups:cq`, ':default'), null);
  } finally {
    await client.close();
  }
});
