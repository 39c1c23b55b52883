// prepare.js: copies what the package ships from outside its directory, the
// proto and the repository's LICENSE, into it. npm runs it on `npm ci` /
// `npm install` in this directory and on `npm pack`, so both a checkout and
// the tarball load the proto from the package itself; the copies are not
// committed (.gitignore).
'use strict';

const fs = require('fs');
const path = require('path');

const REPOSITORY = path.join(__dirname, '..', '..');
const COPIES = [
  [path.join(REPOSITORY, 'proto', 'attention', 'v1', 'attention.proto'),
    path.join(__dirname, 'proto', 'attention', 'v1', 'attention.proto')],
  [path.join(REPOSITORY, 'LICENSE'), path.join(__dirname, 'LICENSE')],
];

for (const [from, to] of COPIES) {
  if (!fs.existsSync(from)) {
    console.error(`prepare.js: ${from} is missing; the package is built from a checkout of attention-service`);
    process.exit(1);
  }
  fs.mkdirSync(path.dirname(to), { recursive: true });
  fs.copyFileSync(from, to);
}
