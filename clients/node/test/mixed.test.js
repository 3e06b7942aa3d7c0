'use strict';
// A Node worker and a Python worker (the repository's `mesh worker`, from its
// venv) in one namespace: work flows both ways, persistent tasks are shared by
// the fair share and taken over after a SIGKILL, and each language refuses a
// namespace the other registered under another protocol version.
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawn } = require('node:child_process');
const Redis = require('ioredis').default;
const { Client, Worker, VersionError } = require('../src/index');
const { startRedis, waitFor, namespace, python, meshCli, MESH_CLI } = require('./helpers');

const FIXTURES = path.join(__dirname, 'fixtures');

/** @type {{url: string, port: number, stop: () => Promise<void>}} */
let server;
/** @type {import('ioredis').Redis} */
let redis;
/** @type {import('node:child_process').ChildProcess[]} */
const children = [];

test.before(async () => {
  server = await startRedis();
  redis = new Redis(server.url);
});
test.after(async () => {
  for (const c of children) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
  redis.disconnect();
  await server.stop();
});

/** @param {string} ns */
function env(ns) {
  return { ...process.env, MESH_REDIS_URL: server.url, MESH_NAMESPACE: ns,
    PYTHONPATH: [FIXTURES, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter) };
}

/**
 * A Python worker serving py_app's queues.
 * @param {string} ns
 */
function pythonWorker(ns) {
  const child = spawn(python(), [...MESH_CLI, 'worker', 'py_app:queues', '--ttl', '1.5',
    '--concurrency', '10', '--log-level', 'warning'], { cwd: FIXTURES, env: env(ns), stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr?.on('data', (d) => { stderr += d; });
  children.push(child);
  return { child, stderr: () => stderr };
}

/** `mesh status --json` of `ns`. @param {string} ns */
async function status(ns) {
  return JSON.parse(await meshCli(['status', '--json', '--processes', '--redis', server.url, '--namespace', ns]));
}

/**
 * The running processes of `queue`, from their records (worker \0 kind \0 ... \0 payload).
 * @param {string} ns @param {string} queue
 * @returns {Promise<{id: string, worker: string, task: string}[]>}
 */
async function processes(ns, queue) {
  const all = await redis.hgetall(`{${ns}}:procs:${queue}`);
  return Object.entries(all).map(([id, rec]) => {
    const parts = rec.split('\0');
    return { id, worker: parts[0], task: parts.slice(8).join('\0') };
  });
}

/** A handler that runs until its signal is aborted. @param {Buffer} _t @param {{signal: AbortSignal}} ctx */
const hold = (_t, ctx) => new Promise((_resolve, reject) => {
  ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason), { once: true });
});

test('Node and Python peers share a namespace: both ways, fair share, takeover', async () => {
  const ns = namespace();
  const cli = ['--redis', server.url, '--namespace', ns];
  await meshCli(['configure', 'to.node', '--result-ttl', '60', ...cli]);
  await meshCli(['configure', 'to.python', '--result-ttl', '60', ...cli]);
  const node = new Worker({ redis: server.url, namespace: ns, ttl: 1.5, log: () => {} });
  const client = new Client({ redis: server.url, namespace: ns });
  const py = pythonWorker(ns);
  /** @type {Map<string, bigint>} */
  const nodeTokens = new Map();
  await node.serve('mixed.persistent', (t, ctx) => {
    nodeTokens.set(t.toString(), ctx.token);
    return hold(t, ctx);
  }, { concurrency: 10 });
  await node.serve('to.node', (t) => `node:${t}`, { concurrency: 4 });
  try {
    await node.start();
    const workers = () => redis.zrange(`{${ns}}:workers`, 0, -1);
    await waitFor(async () => (await workers()).length === 2, { timeout: 30000, what: 'the Python worker to join' });
    const pyId = /** @type {string} */ ((await workers()).find((id) => id !== node.id));

    // a Node worker of another protocol version is refused in the Python peer's namespace
    const newer = new Worker({ redis: server.url, namespace: ns, ttl: 3, protocolVersion: '12', log: () => {} });
    await assert.rejects(newer.start(), (err) => err instanceof VersionError && /version/i.test(err.message));

    // Python enqueues, Node runs; Node enqueues, Python runs
    await meshCli(['enqueue', 'to.node', 'a', 'b', ...cli]);
    assert.equal((await client.result('to.node', 'b', { timeoutMs: 15000 }))?.toString(), 'node:b');
    await client.enqueue('to.python', 'z');
    assert.equal((await client.result('to.python', 'z', { timeoutMs: 15000 }))?.toString(), 'python:z');

    // persistent tasks: two each, by the fair share and rebalancing
    await client.ensure('mixed.persistent', ['p1', 'p2', 'p3', 'p4']);
    await waitFor(async () => {
      const procs = await processes(ns, 'mixed.persistent');
      return procs.length === 4 && procs.filter((p) => p.worker === node.id).length === 2
        && procs.filter((p) => p.worker === pyId).length === 2;
    }, { timeout: 20000, what: 'two persistent tasks on each worker' });
    // the Python CLI sees both peers and who runs what
    const seen = await status(ns);
    assert.deepEqual(seen.workers.map((/** @type {any} */ w) => w.id).sort(), [node.id, pyId].sort());
    const onPython = seen.processes.filter((/** @type {any} */ p) => p.worker === pyId);
    assert.equal(onPython.length, 2);

    // the Python peer dies: the Node peer takes its tasks over with larger tokens
    py.child.kill('SIGKILL');
    await waitFor(() => onPython.every((/** @type {any} */ p) => (nodeTokens.get(p.task.data) ?? 0n) > BigInt(p.token)),
      { timeout: 15000, what: 'the Node worker to take over' });
    assert.deepEqual(await workers(), [node.id]);
    assert.equal((await processes(ns, 'mixed.persistent')).filter((p) => p.worker === node.id).length, 4);
  } finally {
    await node.stop();
    await client.close();
  }
});

test('a Python worker refuses a namespace a Node worker registered under another protocol version', async () => {
  const ns = namespace();
  const old = new Worker({ redis: server.url, namespace: ns, ttl: 3, protocolVersion: '6', log: () => {} });
  await old.start();
  try {
    const child = spawn(python(), [...MESH_CLI, 'worker', 'py_app:queues', '--ttl', '1.5'],
      { cwd: FIXTURES, env: env(ns), stdio: ['ignore', 'ignore', 'pipe'] });
    children.push(child);
    let stderr = '';
    child.stderr?.on('data', (d) => { stderr += d; });
    const code = await new Promise((resolve) => child.once('exit', resolve));
    assert.notEqual(code, 0);
    assert.match(stderr, /version/i);
    assert.deepEqual(await redis.zrange(`{${ns}}:workers`, 0, -1), [old.id], 'the Python worker did not join');
  } finally {
    await old.stop();
  }
});
