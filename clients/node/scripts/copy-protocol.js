'use strict';
/**
 * prepack: copy the repository's protocol/*.lua into the package (protocol/),
 * which the loader prefers to ../../protocol, so a published package carries
 * the scripts it was built with.
 */
const fs = require('node:fs');
const path = require('node:path');

const src = path.resolve(__dirname, '..', '..', '..', 'protocol');
const dst = path.resolve(__dirname, '..', 'protocol');
if (!fs.existsSync(path.join(src, 'claim.lua'))) {
  process.stderr.write(`copy-protocol: no protocol scripts in ${src}\n`);
  process.exit(1);
}
fs.rmSync(dst, { recursive: true, force: true });
fs.mkdirSync(dst);
let n = 0;
for (const name of fs.readdirSync(src)) {
  if (name.endsWith('.lua')) {
    fs.copyFileSync(path.join(src, name), path.join(dst, name));
    n += 1;
  }
}
process.stdout.write(`copy-protocol: ${n} scripts copied to ${dst}\n`);
