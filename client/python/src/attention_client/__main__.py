"""python -m attention_client: a small CLI over the package, for a quick look
at a server from a machine that has only Python: health, models, and attend
on .npy files. Flags and exit codes follow the C++ attention-client (0
success, 1 the server refused or is not serving, 2 bad input).

    python -m attention_client --target 127.0.0.1:50051 health
    python -m attention_client models
    python -m attention_client attend q.npy --keys k.npy --valid-lens 2,6 --output out.npz
"""

import argparse
import os
import sys

import grpc
import numpy as np

from . import __version__
from .client import AttentionClient

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m attention_client",
        description="Calls an attention-server (gRPC attention.v1).")
    parser.add_argument("--version", action="version", version=f"attention-client {__version__}")
    parser.add_argument("--target", default=os.environ.get("ATTENTION_TARGET", "127.0.0.1:50051"),
                        help="HOST:PORT; several, comma-separated, are balanced round-robin "
                             "(default: $ATTENTION_TARGET or %(default)s)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="deadline of each call in seconds (default %(default)s)")
    parser.add_argument("--tls", action="store_true", help="TLS with the system's roots")
    parser.add_argument("--tls-ca", help="TLS, trusting this CA (PEM file)")
    parser.add_argument("--tls-cert", help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--tls-key", help="private key of --tls-cert (PEM)")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token", default=os.environ.get("ATTENTION_TOKEN"),
                       help="bearer token (default: $ATTENTION_TOKEN)")
    token.add_argument("--token-file", help="file holding the bearer token")
    commands = parser.add_subparsers(dest="command", required=True)

    health = commands.add_parser("health", help="print the serving status; exit 0 only if SERVING")
    health.add_argument("--service", default="", help="service to ask about; empty: the server")

    commands.add_parser("models", help="list the models the server can run")

    attend = commands.add_parser("attend", help="run a model on arrays from .npy files")
    attend.add_argument("queries", help=".npy file, (B, n_q, d_q) or (B, n_q, H, d)")
    attend.add_argument("--keys", help=".npy file, (B, n_k, d_k); omitted: the queries")
    attend.add_argument("--values", help=".npy file, (B, n_k, d_v); omitted: the keys")
    attend.add_argument("--model", default="dot_product", help="model name (default %(default)s)")
    attend.add_argument("--valid-lens", help="comma-separated lengths: B, or B*n_q of them")
    attend.add_argument("--position-ids",
                        help="comma-separated positions of the queries: n_q, or B*n_q of them")
    attend.add_argument("--sliding-window", type=int, help="dot_product: the sliding window")
    attend.add_argument("--softcap", type=float, help="dot_product: the logit soft-cap")
    attend.add_argument("--causal", action="store_true", help="causal mask")
    attend.add_argument("--scale", type=float, help="replaces the model's default scale")
    attend.add_argument("--weights", action="store_true", help="also return the attention weights")
    attend.add_argument("--output", help=".npz file for `output` (and `attention_weights`); "
                                         "without it the arrays are printed")
    return parser.parse_args(argv)


def read_file(path, mode="rb"):
    with open(path, mode) as f:
        return f.read()


def make_client(args):
    token = read_file(args.token_file, "r").strip() if args.token_file else args.token
    return AttentionClient(
        args.target, timeout=args.timeout, token=token, tls=args.tls,
        root_certificates=read_file(args.tls_ca) if args.tls_ca else None,
        certificate_chain=read_file(args.tls_cert) if args.tls_cert else None,
        private_key=read_file(args.tls_key) if args.tls_key else None)


def run_health(client, args):
    status = client.health(args.service)
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_FAILED


def run_models(client, args):
    print(f"{'name':<24} {'kind':<12} {'heads':>5} {'d_q':>6} {'d_k':>6} {'d_v':>6} "
          f"{'out':>6} {'version':>7}")
    for m in client.list_models():
        print(f"{m.name:<24} {m.kind:<12} {m.num_heads:>5} {m.query_size:>6} {m.key_size:>6} "
              f"{m.value_size:>6} {m.output_size:>6} {m.version:>7}")
    return EXIT_OK


def run_attend(client, args):
    arrays = {name: np.load(path) for name, path in
              (("queries", args.queries), ("keys", args.keys), ("values", args.values)) if path}
    valid_lens = [int(v) for v in args.valid_lens.split(",")] if args.valid_lens else None
    positions = [int(v) for v in args.position_ids.split(",")] if args.position_ids else None
    result = client.attend(**arrays, model=args.model, valid_lens=valid_lens, causal=args.causal,
                           scale=args.scale, return_attention_weights=args.weights,
                           position_ids=positions, sliding_window=args.sliding_window,
                           softcap=args.softcap)
    named = {"output": result.output}
    if result.attention_weights is not None:
        named["attention_weights"] = result.attention_weights
    if args.output:
        np.savez(args.output, **named)
    for name, array in named.items():
        print(f"{name} {array.shape}" + ("" if args.output else f"\n{array}"))
    return EXIT_OK


COMMANDS = {"health": run_health, "models": run_models, "attend": run_attend}


def main(argv=None):
    args = parse_args(argv)
    try:
        with make_client(args) as client:
            return COMMANDS[args.command](client, args)
    except grpc.RpcError as error:
        print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
