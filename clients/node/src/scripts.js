'use strict';
/**
 * Loading and running the protocol's Lua scripts (protocol/README.md,
 * "Loading the scripts"): every line `--!include FILE` is replaced by the
 * contents of FILE from the same directory (recursively), keeping only the
 * functions of the included file that the script calls, directly or through
 * each other; the expanded source is hashed (SHA-1) and run with EVALSHA,
 * falling back to EVAL on NOSCRIPT (which also caches it).
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
  'cancel', 'configure',
];

const INCLUDE = /^--!include ([A-Za-z0-9_.]+)[ \t]*$/gm;
// A top-level function of an included file: its leading comment lines, then
// `local function NAME(` at column 0, up to and including `end` at column 0.
const UNIT = /^(?:--[^\n]*\n)*local function ([A-Za-z_][A-Za-z0-9_]*)\([\s\S]*?^end[ \t]*\n?/gm;
// A Lua comment to the end of its line: `--` at the start of a line or after a space.
const COMMENT = /(?:^|(?<=\s))--[^\n]*/gm;
const IDENT = /[A-Za-z_][A-Za-z0-9_]*/g;

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
 * Keep only the functions of `lib` that `user` calls, directly or through
 * each other (definition order kept; text outside functions kept as is).
 * @param {string} lib
 * @param {string} user
 * @returns {string}
 */
function prune(lib, user) {
  const units = [...lib.matchAll(UNIT)];
  if (units.length === 0) return lib;
  /** @type {Map<string, string>} */
  const bodies = new Map(units.map((m) => [m[1], m[0]]));
  /** @type {Set<string>} */
  const wanted = new Set();
  const todo = [user];
  while (todo.length > 0) {
    const text = /** @type {string} */ (todo.pop()).replace(COMMENT, '');
    for (const word of new Set(text.match(IDENT) || [])) {
      const body = bodies.get(word);
      if (body !== undefined && !wanted.has(word)) {
        wanted.add(word);
        todo.push(body);
      }
    }
  }
  let out = '';
  let pos = 0;
  for (const m of units) {
    const start = /** @type {number} */ (m.index);
    out += lib.slice(pos, start);
    if (wanted.has(m[1])) out += m[0];
    pos = start + m[0].length;
  }
  return out + lib.slice(pos);
}

/**
 * The source of `name` with its includes spliced in.
 * @param {string} dir
 * @param {string} name
 * @param {string[]} [seen]
 * @returns {string}
 */
function expand(dir, name, seen = []) {
  if (seen.includes(name)) {
    throw new Error(`protocol/${name}: include cycle ${[...seen, name].join(' -> ')}`);
  }
  const text = fs.readFileSync(path.join(dir, name), 'utf8');
  const user = text.replace(INCLUDE, '');
  return text.replace(INCLUDE, (_line, file) => prune(expand(dir, file, [...seen, name]), user));
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

module.exports = { SCRIPT_NAMES, loadScripts, runScript, protocolDir, expand, prune };
