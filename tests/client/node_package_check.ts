// node_package_check.ts: compiled (never run) by node_package_test.sh with
// `tsc --noEmit --strict` against the installed package's index.d.ts. It uses
// every part of the API as documented, and the @ts-expect-error lines must
// be errors, so types that were too loose (any) fail the check too.
import {
  AttendError, AttendRequest, AttendResponse, AttentionClient, ModelInfo, Session, SessionLost, StepResult,
} from 'attention-client';

async function use(): Promise<number> {
  const client = new AttentionClient('127.0.0.1:50051', { timeoutMs: 5000, token: 's3cret', maxAttempts: 2 });
  const models: ModelInfo[] = await client.listModels();
  const request: AttendRequest = {
    model: 'dot_product',
    queries: { shape: [1, 1, 2], data: new Float32Array([1, 0]) },
    keys: { shape: [1, 2, 2], data: [1, 0, 0, 1] },
    valid_lens: [2],
    scale: 0.5,
    version: 1,
    return_attention_weights: true,
  };
  const response: AttendResponse = await client.attend(request);
  const again: AttendResponse = await client.attend(request,
    { timeoutMs: 1000, signal: new AbortController().signal });
  const output: Float32Array = response.output.data;
  const weights: Float32Array | undefined = response.attention_weights?.data;
  let refused = 0;
  for await (const item of client.attendStream([request, request], { timeoutMs: 10000 })) {
    if (item instanceof AttendError) refused += item.code + item.details.length + item.request_id.length;
    else refused += item.output.shape[0];
  }
  const session: Session = await client.session('mh_torch_small',
    { batch: 1, timeoutMs: 60000, replay: true, replayLimitBytes: 1 << 20 });
  let replayed = 0;
  try {
    const step: StepResult = await session.step({ shape: [1, 1, 16], data: new Float32Array(16) },
      { return_attention_weights: true });
    replayed += step.output.data.length + step.length + session.replays + session.length;
  } catch (error) {
    if (error instanceof SessionLost) replayed += error.code + error.details.length;
  }
  session.close();
  const cross: Session = await client.session('additive_toy',
    { memory: 'cross', keys: request.keys, values: request.keys, valid_lens: [2], replay: false });
  cross.close();
  client.close();
  // @ts-expect-error: memory is 'self' or 'cross'
  client.session('dot_product', { memory: 'both' });
  // @ts-expect-error: queries are required
  const noQueries: AttendRequest = { model: 'dot_product' };
  // @ts-expect-error: an answer's data is a Float32Array, not an Array
  const asArray: number[] = response.output.data;
  // @ts-expect-error: no such option
  new AttentionClient('127.0.0.1:50051', { timeout: 5 });
  // @ts-expect-error: a signal is an AbortSignal
  client.attend(request, { signal: true });
  return again.output.data.length + models.length + output.length + (weights ? weights.length : 0) + refused
    + (noQueries ? 0 : 1) + asArray.length + replayed;
}

export default use;
