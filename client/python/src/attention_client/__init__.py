"""attention_client: call attention-server from Python, numpy arrays in and out.

    from attention_client import AttentionClient

    with AttentionClient("127.0.0.1:50051") as client:
        result = client.attend(queries, keys, values, model="dot_product",
                               valid_lens=[2, 6], return_attention_weights=True)
        result.output             # numpy float32, (B, n_q, d_v)
        result.attention_weights  # numpy float32, (B, n_q, n_k), or None

        # Many requests over one AttendStream call: one item per request, in order.
        for item in client.attend_stream([dict(queries=q1, model="dot_product"),
                                          dict(queries=q2, keys=k2, model="additive_toy")]):
            if isinstance(item, AttendError):   # this request failed; the others go on
                print(item.code(), item.details())
            else:
                print(item.output.shape)

        # A decoding session: the server keeps the keys and values, each step
        # sends only its new rows (docs/api.md section 11).
        with client.session("mh_torch_e256_h8") as session:
            first = session.step(prompt)          # (1, n, E): a prefill
            nxt = session.step(token)             # (1, 1, E)
            nxt.output, nxt.length
            session.replays   # times its server was lost and the session replayed on another

The gRPC stubs (pb2, pb2_grpc) were generated from attention.proto when the
package was built. A failed call raises grpc.RpcError; its .code() is the
server's status code. `python -m attention_client --help`: a small CLI.
"""

from importlib import metadata

from .client import (AttendResult, AttentionClient, attend, attend_request, from_tensor, pb2,
                     pb2_grpc, to_tensor)
from .errors import AttendError, SessionLost
from .session import Session, StepResult

__version__ = metadata.version("attention-client")
__all__ = ["AttendError", "AttendResult", "AttentionClient", "Session", "SessionLost", "StepResult",
           "attend",
           "attend_request", "from_tensor", "pb2", "pb2_grpc", "to_tensor"]
