'use strict';
/**
 * Big payloads stored out of line (protocol version 10: see "Big payloads out
 * of line" in protocol/README.md). A payload longer than BLOB_MIN lives in
 * {ns}:blob:<sha1hex> (a hash: `d` the payload, `n` the entries that
 * reference it), uploaded by put_blob.lua before the call that enqueues it;
 * every entry of a queue holds its stand-in, a pure function of the payload:
 *
 *   "\0mesh-blob\0" + sha1hex + "\0" + size + "\0" + first 256 bytes
 *
 * The scripts count the references; a worker turns a claimed stand-in back
 * into the payload (fetchBlob) before its handler runs.
 */
const crypto = require('node:crypto');

/** Payloads longer than this many bytes (1 MiB) are stored out of line. */
const BLOB_MIN = 1048576;
/** What every stand-in starts with; no task payload may. */
const BLOB_MARK = Buffer.from('\0mesh-blob\0', 'latin1');
/** Bytes of the payload a stand-in carries. */
const BLOB_HEAD = 256;

/** @param {Buffer} p @returns {boolean} whether `p` is a stand-in */
function isStandin(p) {
  return p.length >= BLOB_MARK.length && p[0] === 0 && p.subarray(0, BLOB_MARK.length).equals(BLOB_MARK);
}

/**
 * `p`, unless it starts with the mark of a stand-in.
 * @param {Buffer} p @returns {Buffer}
 * @throws {RangeError} it does (it would read as a stand-in)
 */
function checkPayload(p) {
  if (isStandin(p)) {
    throw new RangeError("task payload starts with '\\0mesh-blob\\0', the mark of a payload stored out of line: no task may start so");
  }
  return p;
}

/**
 * What a queue holds for `payload`: the payload itself up to BLOB_MIN bytes,
 * else its stand-in.
 * @param {Buffer} payload @returns {Buffer}
 */
function standin(payload) {
  if (payload.length <= BLOB_MIN) return payload;
  const sha = crypto.createHash('sha1').update(payload).digest('hex');
  return Buffer.concat([BLOB_MARK, Buffer.from(`${sha}\0${payload.length}\0`, 'latin1'),
    payload.subarray(0, BLOB_HEAD)]);
}

/**
 * What stand-in `p` says, or null when `p` is not one.
 * @param {Buffer} p @returns {{sha: string, size: number, head: Buffer} | null}
 */
function parseStandin(p) {
  if (!isStandin(p) || p.length < 52 || p[51] !== 0) return null;
  const end = p.indexOf(0, 52);
  if (end < 0) return null;
  const size = p.subarray(52, end).toString('latin1');
  if (!/^\d+$/.test(size)) return null;
  return { sha: p.subarray(11, 51).toString('latin1'), size: Number(size), head: p.subarray(end + 1) };
}

/**
 * What a queue holds for the task a caller names with `p` (cancel, result):
 * `p` itself when it is a stand-in (a read gave it), else standin(p).
 * @param {Buffer} p @returns {Buffer}
 * @throws {RangeError} `p` starts with the mark but is no stand-in
 */
function stored(p) {
  if (isStandin(p)) {
    if (!parseStandin(p)) throw new RangeError("task payload starts with '\\0mesh-blob\\0' but is no stand-in of a big payload: no task may start so");
    return p;
  }
  return standin(p);
}

/**
 * The payload whose stand-in is `p` (one HGET), or `p` itself if it is not
 * a stand-in.
 * @param {import('ioredis').Redis} r @param {import('./keys').Keys} keys @param {Buffer} p
 * @returns {Promise<Buffer>}
 * @throws {Error} its blob is gone (the attempt fails: a handler never sees a stand-in)
 */
async function fetchBlob(r, keys, p) {
  const s = parseStandin(p);
  if (!s) return p;
  const key = `${keys.prefix}blob:${s.sha}`;
  const got = await r.hgetBuffer(key, 'd');
  if (!got) {
    throw new Error(`the big payload ${s.sha} (${s.size} bytes) is gone from Redis (${key} does not exist): it cannot run`);
  }
  return got;
}

module.exports = { BLOB_MIN, BLOB_MARK, BLOB_HEAD, isStandin, checkPayload, standin, stored, parseStandin, fetchBlob };
