"""ports: free TCP ports on 127.0.0.1 for the Python tests' listeners.

The tests import it after putting tests/support on sys.path.
"""

import random
import socket


def free_port():
    """A port nothing listens on, below the kernel's ephemeral range when it
    can: a port the kernel picks (bind to 0) comes from that range, and may
    become the source port of one of the test's own connections before the
    listener it was picked for binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    candidates = range(10000, ephemeral_low)
    for port in random.sample(candidates, min(200, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
