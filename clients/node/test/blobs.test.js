'use strict';
// Big payloads stored out of line (protocol 10, src/blob.js): the Node client
// uploads a payload of more than 1 MiB and enqueues its stand-in; a Node
// worker hands its handler the exact bytes; the blob leaves with its last copy.
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const Redis = require('ioredis').default;
const { Client, Worker } = require('../src/index');
const { BLOB_MIN, standin, parseStandin } = require('../src/blob');
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

/** 3 MiB starting with `tag`. @param {string} tag */
const big = (tag) => Buffer.concat([Buffer.from(tag), crypto.randomBytes(3 * 1024 * 1024)]);
/** @param {string} ns @param {Buffer} p */
const blobKey = (ns, p) => `{${ns}}:blob:${crypto.createHash('sha1').update(p).digest('hex')}`;

test('a stand-in is the one the Python peer makes', () => {
  const p = big('x');
  const s = standin(p);
  const info = parseStandin(s);
  assert.ok(info);
  assert.equal(info.size, p.length);
  assert.equal(info.sha, crypto.createHash('sha1').update(p).digest('hex'));
  assert.ok(info.head.equals(p.subarray(0, 256)));
  assert.ok(s.subarray(0, 11).equals(Buffer.from('\0mesh-blob\0', 'latin1')));
  const small = Buffer.alloc(BLOB_MIN, 'a');
  assert.equal(standin(small), small);
});

test('a big payload runs with its exact bytes; its blob leaves with its last copy', async () => {
  const ns = namespace();
  const client = new Client({ redis: server.url, namespace: ns });
  const w = new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {} });
  /** @type {Buffer[]} */
  const seen = [];
  const p = big('run');
  const other = big('cancelled');
  try {
    await assert.rejects(client.enqueue('b', Buffer.from('\0mesh-blob\0x', 'latin1')), /mesh-blob/);
    await assert.rejects(client.enqueue('b', ['ok', Buffer.from('\0mesh-blob\0x', 'latin1')]), /mesh-blob/);
    assert.equal(await redis.exists(`{${ns}}:queue:b`), 0);
    await client.enqueue('b', [p, p]);
    assert.equal(await redis.hget(blobKey(ns, p), 'n'), '2');
    assert.equal(await redis.pttl(blobKey(ns, p)), -1);
    const queued = await redis.lrangeBuffer(`{${ns}}:queue:b`, 0, -1);
    assert.ok(queued.every((q) => q.equals(standin(p))));
    await client.enqueue('b', other);
    // cancelled by the stand-in a read gives, as by the payload
    const [held] = await redis.lrangeBuffer(`{${ns}}:queue:b`, -1, -1);
    assert.ok(held.equals(standin(other)));
    assert.equal(await client.cancel('b', held), 1);
    assert.equal(await redis.exists(blobKey(ns, other)), 0);
    await assert.rejects(client.schedule('b', p, { everyMs: 1000 }), /at most 1048576 bytes/);
    await w.serve('b', (t) => { seen.push(t); });
    await w.start();
    await waitFor(() => seen.length === 2, { timeout: 10000, what: 'both copies run' });
    assert.ok(seen.every((t) => t.equals(p)));
    await waitFor(async () => (await redis.exists(blobKey(ns, p))) === 0, { timeout: 5000, what: 'the blob gone' });
  } finally {
    await w.stop();
    await client.close();
  }
});
