'use strict';
/**
 * The example (examples/run.js) prints each device taken or let go under the
 * heading of the step that caused it, and no heading with nothing under it
 * (issue 32, item 16: the claims of the first step once came under the
 * second heading). Run a few times: the order it once got wrong was a race.
 */
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { execFile } = require('node:child_process');
const { startRedis } = require('./helpers');

const EXAMPLE = path.resolve(__dirname, '..', 'examples', 'run.js');

/** @param {string} url @returns {Promise<string>} */
function runExample(url) {
  return new Promise((resolve, reject) => {
    execFile(process.execPath, [EXAMPLE], { env: { ...process.env, MESH_REDIS_URL: url }, timeout: 60000 },
      (err, stdout, stderr) => (err ? reject(new Error(`${err.message}\n${stderr}`)) : resolve(stdout)));
  });
}

/** The output as {heading: [its lines]}, in order. @param {string} out */
function sections(out) {
  /** @type {[string, string[]][]} */
  const got = [];
  for (const line of out.trimEnd().split('\n')) {
    if (line.startsWith('  ')) got[got.length - 1][1].push(line.trim().replace(/ \(token \d+\)$/, ''));
    else got.push([line, []]);
  }
  return got;
}

test('every line of the example is under the heading of its step', async () => {
  const redis = await startRedis();
  try {
    for (let run = 0; run < 3; run++) {
      const got = sections(await runExample(redis.url));
      assert.deepEqual(got, [
        ['4 devices, one worker:', ['alpha owns dev-1', 'alpha owns dev-2', 'alpha owns dev-3', 'alpha owns dev-4']],
        ['a second worker joins; rebalancing moves two devices to it:', got[1][1]],
        ['a job, awaited:', got[2][1]],
        ['cancel dev-1, wherever it runs:', [got[3][1][0]]],
        ['alpha stops gracefully; beta takes its devices over:', got[4][1]],
        ['beta stops:', got[5][1]],
        ['done', []],
      ]);
      const moved = got[1][1];
      assert.equal(moved.filter((l) => l.startsWith('beta owns')).length, 2, moved.join('\n'));
      assert.equal(moved.filter((l) => l.startsWith('alpha let go of') && l.endsWith(': moved')).length, 2);
      assert.match(got[2][1][0], /^result: (alpha|beta) resized photo-17\.jpg$/);
      assert.match(got[3][1][0], /^(alpha|beta) let go of dev-1: cancelled$/);
      const over = got[4][1];
      // what alpha still held (1 or 2, as dev-1 was cancelled there or not) goes to beta
      const handed = over.filter((l) => l.startsWith('alpha let go') && l.endsWith(': stopped')).length;
      const taken = over.filter((l) => l.startsWith('beta owns')).length;
      assert.ok(handed >= 1 && handed === taken && handed + taken === over.length, over.join('\n'));
      assert.deepEqual(got[5][1].map((l) => l.replace(/dev-\d/, 'dev-N')), Array(3).fill('beta let go of dev-N: stopped'));
    }
  } finally {
    await redis.stop();
  }
});
