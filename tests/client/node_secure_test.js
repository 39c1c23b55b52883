// node_secure_test.js: the Node client's token and TLS options (client/node)
// against servers that require them. Run by tests/client/node_test.sh:
//
//   node tests/client/node_secure_test.js PKI_DIR TLS_TOKEN_ADDRESS MUTUAL_TLS_ADDRESS
//
// PKI_DIR is made by tests/support/make_pki.sh (CAs ca and rogue; server,
// client and intruder certificates); the first server takes TLS and the token
// s3cret, the second mutual TLS with client certificates of ca.
'use strict';

const assert = require('assert');
const fs = require('fs');
const path = require('path');

const SOURCE_DIR = path.join(__dirname, '..', '..');
const { AttentionClient } = require(path.join(SOURCE_DIR, 'client', 'node', 'attention_client.js'));

const [pkiDir, tlsTokenAddress, mutualAddress] = process.argv.slice(2);
const pem = (name) => fs.readFileSync(path.join(pkiDir, name));
const QUERIES = { shape: [1, 2, 2], data: [1, -2, 0.5, 3] };

// The gRPC code of one attend with these options (0 for OK); an answer must be
// a mix of the keys: each output value within the keys' range.
async function code(address, options) {
  const client = new AttentionClient(address, { timeoutMs: 10000, maxAttempts: 2, ...options });
  try {
    const response = await client.attend({ model: 'dot_product', queries: QUERIES });
    assert.deepStrictEqual(response.output.shape, [1, 2, 2]);
    response.output.data.forEach((value, i) => {
      const column = [QUERIES.data[i % 2], QUERIES.data[2 + (i % 2)]];
      assert.ok(value >= Math.min(...column) - 1e-6 && value <= Math.max(...column) + 1e-6,
        `output[${i}] = ${value} is not a mix of the keys`);
    });
    return 0;
  } catch (error) {
    if (error.code === undefined) throw error;
    return error.code;
  } finally {
    client.close();
  }
}

const OK = 0;
const UNAUTHENTICATED = 16;
const UNAVAILABLE = 14;

async function main() {
  const ca = pem('ca.crt');
  const checks = [
    ['TLS with the CA and the token', tlsTokenAddress, { rootCerts: ca, token: 's3cret' }, OK],
    ['TLS without the token', tlsTokenAddress, { rootCerts: ca }, UNAUTHENTICATED],
    ['TLS with a wrong token', tlsTokenAddress, { rootCerts: ca, token: 'wrong' }, UNAUTHENTICATED],
    ['TLS trusting a rogue CA', tlsTokenAddress, { rootCerts: pem('rogue.crt'), token: 's3cret' },
      UNAVAILABLE],
    ['plaintext to a TLS server', tlsTokenAddress, { token: 's3cret' }, UNAVAILABLE],
    ['mutual TLS with the client certificate', mutualAddress,
      { rootCerts: ca, certChain: pem('client.crt'), privateKey: pem('client.key') }, OK],
    ['mutual TLS without a client certificate', mutualAddress, { rootCerts: ca }, UNAVAILABLE],
    ['mutual TLS with an intruder certificate', mutualAddress,
      { rootCerts: ca, certChain: pem('intruder.crt'), privateKey: pem('intruder.key') },
      UNAVAILABLE],
  ];
  let failed = 0;
  for (const [name, address, options, expected] of checks) {
    const got = await code(address, options);
    if (got === expected) {
      console.log(`PASS ${name}`);
    } else {
      console.log(`FAIL ${name}: code ${got}, expected ${expected}`);
      failed += 1;
    }
  }
  process.exit(failed === 0 ? 0 : 1);
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
