'use strict';
/**
 * Loading and running the protocol's Lua scripts (protocol/README.md,
 * "Loading the scripts"): every line `--!include FILE` is replaced by the
 * contents of FILE (a path relative to protocol/, e.g. include/nudge.lua),
 * expanded the same way, once per script (a later line naming a file already
 * spliced is dropped; a cycle is an error): plain text, no parsing of Lua.
 * The expanded source is hashed (SHA-1) and run with EVALSHA, falling back
 * to EVAL on NOSCRIPT (which also caches it).
 *
 * The scripts are read from the package's own copy (`protocol/`, made by
 * `npm pack`'s prepack step) when there is one, else from the repository's
 * `protocol/` folder two levels up (a checkout).
 */

const fs = require('node:fs');
const path = require('node:path');
const crypto = require('node:crypto');
const { mapError } = require('./errors');

/** The scripts this package calls. */
const SCRIPT_NAMES = [
  'register', 'serve', 'heartbeat', 'claim', 'finish', 'finish_results', 'give_back',
  'drain', 'recycle', 'reap_check', 'rebalance', 'enqueue', 'delay', 'ensure',
  'cancel', 'configure', 'fire', 'stats', 'schedule', 'enqueue_group', 'configure_group', 'pause_group',
  'put_blob',
];

// An include line, with its line end: the file it names (a path relative to
// protocol/) replaces it.
const INCLUDE = /^--!include ((?:[A-Za-z0-9_-]+\/)*[A-Za-z0-9_-]+\.lua)[ \t]*(?:\n|$)/gm;

/**
 * The directory holding the .lua files: the packaged copy first.
 * @returns {string}
 */
function protocolDir() {
  const packaged = path.join(__dirname, '..', 'protocol');
  if (fs.existsSync(path.join(packaged, 'claim.lua'))) return packaged;
  const repo = path.join(__dirname, '..', '..', '..', 'protocol');
  if (fs.existsSync(path.join(repo, 'claim.lua'))) return repo;
  throw new Error(`protocol scripts not found (looked in ${packaged} and ${repo})`);
}

/**
 * The text of `name` with every include line replaced by the expanded text
 * of the file it names, but for a file already spliced into this script
 * (`done`): its line is dropped. Plain text, no parsing of Lua.
 * @param {string} dir
 * @param {string} name
 * @param {string[]} stack
 * @param {Set<string>} done
 * @returns {string}
 * @throws {Error} an include cycle, or a missing file.
 */
function expandFile(dir, name, stack, done) {
  if (stack.includes(name)) {
    throw new Error(`protocol/${name}: include cycle ${[...stack, name].join(' -> ')}`);
  }
  const text = fs.readFileSync(path.join(dir, ...name.split('/')), 'utf8');
  return text.replace(INCLUDE, (_line, /** @type {string} */ file) => {
    if (done.has(file)) return '';
    const out = expandFile(dir, file, [...stack, name], done);
    done.add(file);
    return out;
  });
}

/**
 * The source of script `name` (a path relative to `dir`) as it is hashed
 * and sent (protocol/README.md, "Loading the scripts").
 * @param {string} dir
 * @param {string} name
 * @returns {string}
 */
function expand(dir, name) {
  return expandFile(dir, name, [], new Set());
}

/** @typedef {{name: string, source: string, sha: string}} Script */

/** @type {Map<string, Script> | null} */
let cache = null;

/**
 * Every script, expanded and hashed (read once per process).
 * @returns {Map<string, Script>}
 */
function loadScripts() {
  if (cache) return cache;
  const dir = protocolDir();
  /** @type {Map<string, Script>} */
  const out = new Map();
  for (const name of SCRIPT_NAMES) {
    const source = expand(dir, `${name}.lua`);
    out.set(name, { name, source, sha: crypto.createHash('sha1').update(source).digest('hex') });
  }
  cache = out;
  return out;
}

/** @typedef {string | Buffer | number} Arg */

/**
 * Run one script: EVALSHA, and EVAL with the source on NOSCRIPT. Replies come
 * back with bulk strings as Buffers.
 * @param {import('ioredis').Redis} redis
 * @param {string} name
 * @param {Arg[]} keys
 * @param {Arg[]} args
 * @returns {Promise<any>}
 * @throws {import('./errors').MeshError} the script's error codes
 *   (FencedError, VersionError, ConflictError, ...), or the client's error.
 */
async function runScript(redis, name, keys, args) {
  const script = loadScripts().get(name);
  if (!script) throw new Error(`unknown script ${name}`);
  const r = /** @type {any} */ (redis); // the Buffer variants are untyped in ioredis
  try {
    try {
      return await r.evalshaBuffer(script.sha, keys.length, ...keys, ...args);
    } catch (err) {
      if (!(err instanceof Error) || !err.message.startsWith('NOSCRIPT')) throw err;
      return await r.evalBuffer(script.source, keys.length, ...keys, ...args);
    }
  } catch (err) {
    throw mapError(err);
  }
}

/**
 * Any script of the protocol by name (not only those the package calls),
 * expanded and hashed: what the conformance suite's vectors replay through
 * this loader.
 * @param {string} name  a script's name, e.g. "claim"
 * @returns {Script}
 * @throws {Error} no such script
 */
function scriptByName(name) {
  const known = loadScripts().get(name);
  if (known) return known;
  const dir = protocolDir();
  if (!/^[a-z_]+$/.test(name) || !fs.existsSync(path.join(dir, `${name}.lua`))) {
    throw new Error(`no script named ${JSON.stringify(name)}`);
  }
  const source = expand(dir, `${name}.lua`);
  return { name, source, sha: crypto.createHash('sha1').update(source).digest('hex') };
}

module.exports = { SCRIPT_NAMES, loadScripts, runScript, protocolDir, expand, scriptByName };
