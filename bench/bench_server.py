"""bench_server: start attention-server (or bench/bare-attention-server) for a
benchmark on 127.0.0.1, on ports the kernel picks, and stop it.

The server listens on port 0 and writes the addresses it bound to its
--port-file, one "name HOST:PORT" line each ("grpc", and "metrics" and "http"
when those listen); start() waits for that file and returns them. Benchmark
scripts import it as a sibling (bench/ is a script's own directory).
"""
import os
import subprocess
import tempfile
import time


def _addresses(path):
    """The port file's addresses by name, or None while it is absent or half
    written (bare-attention-server writes it in place)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return None
    if not text.endswith("\n"):
        return None
    return dict(line.split() for line in text.splitlines() if line.strip())


def start(binary, repository=None, flags=(), env=None, stdout=subprocess.DEVNULL,
          stderr=subprocess.DEVNULL, timeout=None):
    """`binary` listening on 127.0.0.1:0, serving --model-repository
    `repository` if given, with `flags`; `env` its environment (None: this
    process's), `stdout` and `stderr` as subprocess.Popen takes them.
    Returns once it serves: the process and its addresses by name ("grpc",
    "metrics", "http"). Exits the script if the server ends before it
    serves, or, stopping it, if `timeout` seconds pass first (None: no
    limit)."""
    with tempfile.TemporaryDirectory(prefix="bench_server.") as scratch:
        ports = os.path.join(scratch, "ports")
        command = [binary, "--address", "127.0.0.1:0", "--port-file", ports]
        if repository is not None:
            command += ["--model-repository", repository]
        process = subprocess.Popen([*command, *flags], stdout=stdout, stderr=stderr, env=env)
        deadline = None if timeout is None else time.monotonic() + timeout
        while (addresses := _addresses(ports)) is None:
            if process.poll() is not None:
                raise SystemExit(f"{binary} exited with {process.returncode} before serving")
            if deadline is not None and time.monotonic() > deadline:
                stop(process)
                raise SystemExit(f"{binary} did not serve within {timeout} s")
            time.sleep(0.05)
    return process, addresses


def stop(process, timeout=None):
    """SIGTERM, then wait for `process` to end; SIGKILL if it has not after
    `timeout` seconds (None: wait as long as it takes)."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
