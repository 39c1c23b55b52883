// attention_client.js: a small Node client for attention-server, on
// @grpc/grpc-js with the service loaded from proto/ by @grpc/proto-loader.
//
//   const { AttentionClient } = require('./attention_client');
//   const client = new AttentionClient('127.0.0.1:50051');
//   const models = await client.listModels();
//   const response = await client.attend({ model: 'dot_product', queries: { shape: [1, 2, 4], data: [...] } });
//   client.close();
//
// Messages are plain objects with the .proto field names (snake_case, as in
// proto JSON): { model, queries: { shape, data }, valid_lens, ... }. A failed
// call rejects with a grpc-js error whose .code is the gRPC status code.
'use strict';

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const PROTO_ROOT = path.join(__dirname, '..', '..', 'proto');

function loadPackage() {
  const definition = protoLoader.loadSync('attention/v1/attention.proto', {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // the .proto names, as in proto JSON and the conformance cases
    longs: Number, // shapes are int64; any real shape fits a JS number
    defaults: false,
  });
  return grpc.loadPackageDefinition(definition).attention.v1;
}

// round_robin over every address; retries with backoff on UNAVAILABLE only.
function serviceConfig(maxAttempts) {
  const config = { loadBalancingConfig: [{ round_robin: {} }] };
  if (maxAttempts > 1) {
    config.methodConfig = [{
      name: [{ service: 'attention.v1.AttentionService' }],
      retryPolicy: {
        maxAttempts,
        initialBackoff: '0.05s',
        maxBackoff: '1s',
        backoffMultiplier: 2,
        retryableStatusCodes: ['UNAVAILABLE'],
      },
    }];
  }
  return JSON.stringify(config);
}

// 'a:1,b:2' (IPv4 literals) -> 'ipv4:a:1,b:2', which one channel balances.
function channelTarget(target) {
  const entries = target.split(',').map((entry) => entry.trim());
  return entries.length > 1 ? `ipv4:${entries.join(',')}` : target;
}

class AttentionClient {
  // target: 'HOST:PORT' or a comma-separated list of IPv4 HOST:PORT.
  // options: timeoutMs (per call), token (sent as 'authorization: Bearer'),
  // rootCerts / privateKey / certChain (Buffers, PEM) or tls: true for TLS,
  // maxAttempts (1..5).
  constructor(target = '127.0.0.1:50051', options = {}) {
    const { timeoutMs = 30000, token, tls = false, rootCerts, privateKey, certChain,
      maxAttempts = 4 } = options;
    const credentials = tls || rootCerts || certChain
      ? grpc.credentials.createSsl(rootCerts, privateKey, certChain)
      : grpc.credentials.createInsecure();
    const { AttentionService } = loadPackage();
    this.stub = new AttentionService(channelTarget(target), credentials, {
      'grpc.service_config': serviceConfig(maxAttempts),
      'grpc.max_receive_message_length': -1,
      // Requests up to 64 MiB stay retryable (gRPC's default: 256 KiB), with
      // at most 256 MiB of them held for retrying at once.
      'grpc.per_rpc_retry_buffer_size': 64 << 20,
      'grpc.retry_buffer_size': 256 << 20,
    });
    this.timeoutMs = timeoutMs;
    this.metadata = new grpc.Metadata();
    if (token) this.metadata.set('authorization', `Bearer ${token}`);
  }

  call(method, request) {
    const deadline = new Date(Date.now() + this.timeoutMs);
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata, { deadline }, (error, response) => {
        if (error) reject(error);
        else resolve(response);
      });
    });
  }

  // Resolves to the served models: [{ name, kind, num_heads, query_size, ... }].
  async listModels() {
    const response = await this.call('ListModels', {});
    return response.models || [];
  }

  // Resolves to the AttendResponse: { output: { shape, data }, attention_weights?, ... }.
  attend(request) {
    return this.call('Attend', request);
  }

  close() {
    this.stub.close();
  }
}

module.exports = { AttentionClient };
