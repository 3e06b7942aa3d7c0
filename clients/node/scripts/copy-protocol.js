'use strict';
/**
 * prepack: copy the repository's protocol/*.lua and protocol/include/*.lua
 * into the package (protocol/),
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
let n = 0;
// The scripts and their includes (include/NAME.lua), keeping the layout the
// include lines name.
for (const sub of ['', 'include']) {
  fs.mkdirSync(path.join(dst, sub), { recursive: true });
  for (const name of fs.readdirSync(path.join(src, sub))) {
    if (name.endsWith('.lua')) {
      fs.copyFileSync(path.join(src, sub, name), path.join(dst, sub, name));
      n += 1;
    }
  }
}
process.stdout.write(`copy-protocol: ${n} files copied to ${dst}\n`);
