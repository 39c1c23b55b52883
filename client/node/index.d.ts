// index.d.ts: the TypeScript types of attention-client (attention_client.js).
// Messages use the .proto field names of attention.v1 (docs/api.md section 1);
// int64 fields are numbers. A failed call rejects with an Error shaped like
// grpc-js's: `code` (the gRPC status code), `details`, `metadata`.

/** A float32 tensor as the client sends it: row-major `data` of product(shape) values. */
export interface TensorInput {
  shape: ReadonlyArray<number>;
  /** Sent from its memory as it is when a Float32Array; other arrays are converted once. */
  data: Float32Array | ArrayLike<number>;
}

/** A float32 tensor of an answer. */
export interface Tensor {
  shape: number[];
  /**
   * Values of its own, writable, never touched by the client again. From an
   * answer of 4 KiB or more, a view on the received message's memory:
   * `data.buffer` then holds the whole message (read it through `data`, or
   * mind `data.byteOffset`); smaller answers are copied.
   */
  data: Float32Array;
}

export interface AttendRequest {
  model?: string;
  /** (B, n_q, d_q); dot_product's grouped heads: (B, n_q, H, d) */
  queries: TensorInput;
  /** (B, n_k, d_k); left out: the queries. Grouped heads: (B, n_k, H_kv, d) */
  keys?: TensorInput;
  /** (B, n_k, d_v); left out: the keys. Grouped heads: (B, n_k, H_kv, d_v) */
  values?: TensorInput;
  /** Empty, B entries, or B*n_q entries (row-major (B, n_q)). */
  valid_lens?: ReadonlyArray<number>;
  causal?: boolean;
  return_attention_weights?: boolean;
  /** Replaces the model's default scale; presence matters. */
  scale?: number;
  request_id?: string;
  /** The model version; left out: the newest ready one. */
  version?: number;
  /**
   * The queries' positions for a model with rotary positions or ALiBi
   * (docs/api.md section 5.6): empty (0..n_q-1), n_q entries (every
   * example) or B*n_q entries (row-major (B, n_q)).
   */
  position_ids?: ReadonlyArray<number>;
  /** dot_product: key j is allowed for query i only if i - j < sliding_window (0: none); presence matters. */
  sliding_window?: number;
  /** dot_product: scores become softcap * tanh(score / softcap) (0: none); presence matters. */
  softcap?: number;
}

export interface AttendResponse {
  /** (B, n_q, d_v); (B, n_q, E) for multi_head; (B, n_q, H, d_v) for grouped heads */
  output: Tensor;
  /** Only when asked: (B, n_q, n_k); (B, H, n_q, n_k) for multi_head */
  attention_weights?: Tensor;
  request_id?: string;
  model?: string;
  model_version?: number;
}

export interface ModelVersionStatus {
  version?: number;
  /** ModelVersionState: 1 LOADING, 2 READY, 3 FAILED, 4 UNLOADING */
  state?: number;
  reason?: string;
  kind?: string;
}

/** Fields at their default (0, "") are left out, as proto3 writes them. */
export interface ModelInfo {
  name?: string;
  kind?: string;
  num_heads?: number;
  query_size?: number;
  key_size?: number;
  value_size?: number;
  output_size?: number;
  version?: number;
  versions?: ModelVersionStatus[];
  precision?: string;
  /** multi_head: kv heads (H_kv) and the columns of one head. */
  num_kv_heads?: number;
  head_dim?: number;
  /** Rotary positions: "default", "linear", "llama3", "yarn"; left out: none. */
  rope_type?: string;
  rope_theta?: number;
  rope_interleaved?: boolean;
  rotary_dim?: number;
  /** The layer's sliding window and soft-cap (left out: none), ALiBi and sink logits. */
  sliding_window?: number;
  softcap?: number;
  alibi?: boolean;
  sinks?: boolean;
}

export interface ClientOptions {
  /** Deadline of each call, retries included (default 30000). */
  timeoutMs?: number;
  /** Sent as `authorization: Bearer <token>`. */
  token?: string;
  /** TLS with the system's roots. */
  tls?: boolean;
  /** PEM of the CA to trust (turns TLS on). */
  rootCerts?: Uint8Array;
  /** PEM key and certificate chain, for mutual TLS. */
  privateKey?: Uint8Array;
  certChain?: Uint8Array;
  /** Tries per call on UNAVAILABLE (1..5, default 4); streams are never retried. */
  maxAttempts?: number;
}

/** Options of one unary call (attend, listModels). */
export interface CallOptions {
  /** The call's deadline, retries included (default: the client's timeoutMs). */
  timeoutMs?: number;
  /** Aborting it cancels the call, which rejects with CANCELLED (1). */
  signal?: AbortSignal;
}

/** Why one request of an AttendStream call failed; the stream went on. */
export class AttendError extends Error {
  constructor(code: number, details: string, requestId?: string);
  /** The gRPC status code. */
  code: number;
  details: string;
  request_id: string;
}

export interface SessionOptions {
  /** 'self' (default; multi_head, dot_product): steps' rows are appended and attended causally. 'cross': keys/values stay. */
  memory?: 'self' | 'cross';
  /** Examples side by side (self memory; default 1). */
  batch?: number;
  /** Cross memory: (B, n_k, d_k). */
  keys?: TensorInput;
  /** Cross memory: (B, n_k, d_v); left out: the keys. */
  values?: TensorInput;
  /** Cross memory: empty or B entries. */
  valid_lens?: ReadonlyArray<number>;
  scale?: number;
  version?: number;
  /** A dot_product self session's sliding window and logit soft-cap, for every step. */
  sliding_window?: number;
  softcap?: number;
  /** Deadline of the whole session (default: none). */
  timeoutMs?: number;
  /** Replay the session on a new stream when its stream breaks (default true). */
  replay?: boolean;
  /** Most bytes of opening and rows kept for a replay (default 64 MiB); past it a break is a SessionLost. */
  replayLimitBytes?: number;
}

export interface StepOptions {
  return_attention_weights?: boolean;
  /** A dot_product self session over grouped heads: the step's own keys (B, n_new, H_kv, d). */
  keys?: TensorInput;
  /** ... and values (B, n_new, H_kv, d_v); left out: the rows serve. */
  values?: TensorInput;
}

export interface StepResult {
  /** (B, n_new, d_v); (B, n_new, E) for multi_head */
  output: Tensor;
  /** Only when asked: (B, [H,] n_new, length) */
  attention_weights?: Tensor;
  /** Tokens the session holds after the step. */
  length: number;
}

/** A decoding session over one AttendSession stream (docs/api.md section 11). */
export interface Session {
  session_id: string;
  model: string;
  model_version: number;
  length: number;
  /** Times the stream broke and the session was replayed on a new one. */
  replays: number;
  /** The step's rows (B, n_new, d) or (B, n_new, H, d): new tokens (self memory) or queries (cross). Steps run in order. */
  step(rows: TensorInput, options?: StepOptions): Promise<StepResult>;
  /** Ends the session: the server frees its keys and values. */
  close(): void;
}

/** A session whose stream broke and could not be replayed; `details` says why. */
export class SessionLost extends Error {
  constructor(code: number, details: string);
  /** The break's gRPC status code (e.g. 14, UNAVAILABLE). */
  code: number;
  details: string;
}

export class AttentionClient {
  /** target: 'HOST:PORT', or several comma-separated (IPv4), balanced round-robin. */
  constructor(target?: string, options?: ClientOptions);
  listModels(options?: CallOptions): Promise<ModelInfo[]>;
  attend(request: AttendRequest, options?: CallOptions): Promise<AttendResponse>;
  /**
   * Sends every request over one AttendStream call; yields one item per
   * request, in order: its answer, or an AttendError for a refused one.
   */
  attendStream(
    requests: Iterable<AttendRequest> | AsyncIterable<AttendRequest>,
    options?: CallOptions,
  ): AsyncGenerator<AttendResponse | AttendError, void, undefined>;
  /** Opens a decoding session; rejects with an AttendError when the server refuses it. */
  session(model: string, options?: SessionOptions): Promise<Session>;
  close(): void;
}
