'use strict';
/**
 * Test helpers: a real redis-server on a free loopback port (never 6379),
 * a peer process driven through the line protocol, and waiting for a
 * condition (no fixed sleeps as synchronisation).
 */
const { spawn, execFile } = require('node:child_process');
const net = require('node:net');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const readline = require('node:readline');

const ROOT = path.resolve(__dirname, '..');
const REPO = path.resolve(ROOT, '..', '..');
const PEER = path.join(ROOT, 'bin', 'mesh-peer.js');

/** @returns {Promise<number>} a free loopback port other than 6379 */
function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => {
      const addr = /** @type {net.AddressInfo} */ (s.address());
      s.close(() => (addr.port === 6379 ? freePort().then(resolve, reject) : resolve(addr.port)));
    });
    s.on('error', reject);
  });
}

/**
 * Start a redis-server ($MESH_REDIS_SERVER, else `redis-server` on PATH) on a
 * free loopback port, with key-expiry events on.
 * @returns {Promise<{url: string, port: number, stop: () => Promise<void>}>}
 */
async function startRedis() {
  const bin = process.env.MESH_REDIS_SERVER || 'redis-server';
  const port = await freePort();
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'mesh-node-redis-'));
  const proc = spawn(bin, ['--port', String(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no',
    '--dir', dir, '--notify-keyspace-events', 'Ex', '--maxmemory-policy', 'noeviction'],
  { stdio: ['ignore', 'ignore', 'inherit'] });
  const url = `redis://127.0.0.1:${port}/0`;
  await waitFor(() => new Promise((resolve) => {
    const c = net.connect(port, '127.0.0.1', () => { c.end(); resolve(true); });
    c.on('error', () => resolve(false));
  }), { timeout: 10000, what: `redis-server on port ${port}` });
  return {
    url,
    port,
    stop: () => new Promise((resolve) => {
      proc.once('exit', () => { fs.rmSync(dir, { recursive: true, force: true }); resolve(); });
      proc.kill('SIGKILL');
    }),
  };
}

/**
 * Wait until `cond()` is truthy (polled every 20 ms); throws after `timeout` ms.
 * @template T
 * @param {() => T | Promise<T>} cond
 * @param {{timeout?: number, what?: string}} [o]
 * @returns {Promise<NonNullable<T>>}
 */
async function waitFor(cond, o = {}) {
  const until = Date.now() + (o.timeout ?? 15000);
  for (;;) {
    const v = await cond();
    if (v) return /** @type {NonNullable<T>} */ (v);
    if (Date.now() > until) throw new Error(`timed out waiting for ${o.what ?? 'a condition'}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

/**
 * A peer process under the line protocol: send commands, read its events.
 */
class Peer {
  /**
   * @param {string[]} command  e.g. ['node', PEER]
   * @param {{url: string, namespace: string}} env
   */
  constructor(command, env) {
    this.proc = spawn(command[0], command.slice(1), {
      env: { ...process.env, MESH_REDIS_URL: env.url, MESH_NAMESPACE: env.namespace },
      stdio: ['pipe', 'pipe', 'pipe'],
    });
    /** @type {Record<string, any>[]} */
    this.events = [];
    this.stderr = '';
    this.proc.stderr.on('data', (d) => { this.stderr += d; });
    readline.createInterface({ input: this.proc.stdout }).on('line', (line) => {
      this.events.push(JSON.parse(line));
    });
    /** @type {Promise<number | null>} */
    this.exited = new Promise((resolve) => this.proc.once('exit', (code) => resolve(code)));
  }

  /** @param {Record<string, unknown>} cmd */
  send(cmd) { this.proc.stdin.write(`${JSON.stringify(cmd)}\n`); }

  /**
   * The first event (from index `from`) matching `pred`.
   * @param {(e: Record<string, any>) => boolean} pred
   * @param {{timeout?: number, from?: number}} [o]
   */
  async waitEvent(pred, o = {}) {
    const from = o.from ?? 0;
    return waitFor(() => this.events.slice(from).find(pred), { timeout: o.timeout,
      what: `an event of the peer (got ${JSON.stringify(this.events.slice(-5))}; stderr ${this.stderr.slice(-500)})` });
  }

  /** Send a command and wait for its reply (ack/ready/error). @param {Record<string, any>} cmd */
  async call(cmd) {
    const from = this.events.length;
    this.send(cmd);
    return this.waitEvent((e) => e.event === 'error' || (cmd.op === 'start' ? e.event === 'ready' : e.event === 'ack' && e.op === cmd.op), { from });
  }

  /** @param {NodeJS.Signals} sig */
  kill(sig) { this.proc.kill(sig); }
}

/**
 * The Python with the repository's package installed, for the mixed tests:
 * $MESH_PYTHON, else the repository's venv, else python3 on the PATH.
 */
function python() {
  if (process.env.MESH_PYTHON) return process.env.MESH_PYTHON;
  const venv = path.join(REPO, '.venv', 'bin', 'python');
  return fs.existsSync(venv) ? venv : 'python3';
}

/** The arguments that run the Python CLI: `python -m mesh.cli`. */
const MESH_CLI = ['-m', 'mesh.cli'];

/**
 * Run the Python CLI and return its stdout (asynchronously: a worker in this
 * process keeps renewing its lease meanwhile).
 * @param {string[]} args
 * @returns {Promise<string>}
 */
function meshCli(args) {
  return new Promise((resolve, reject) => {
    execFile(python(), [...MESH_CLI, ...args], { cwd: REPO, encoding: 'utf8' }, (err, stdout, stderr) => {
      if (err) reject(new Error(`mesh ${args.join(' ')}: ${err.message}\n${stderr}`));
      else resolve(stdout);
    });
  });
}

let nsCounter = 0;
/** A fresh namespace per test. */
function namespace() { return `nodetest-${process.pid}-${++nsCounter}`; }

module.exports = { startRedis, waitFor, Peer, PEER, REPO, python, meshCli, MESH_CLI, namespace };
