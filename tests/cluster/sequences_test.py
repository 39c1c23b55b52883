"""sequences_test: Triton sequences (unary ModelInfer steps with the
attention-sequence-id header) through deploy/edge/run.sh --replicas 3
--max-replicas 4 on loopback while replicas come and go, with the real
attention-server and HAProxy (docs/api.md section 6.11):

  - rejoin: a replica killed (-9) and replaced just before 8 sequences of
    48 steps begin (its new process listed in the pid file, not yet in the
    edge's rotation), taken into the rotation mid-way: no step refused,
    outputs within 1e-4 of the same sequences on a steady set;
  - scale-up: the same while a 4th replica is added (SIGUSR1 to run.sh) and
    joins mid-way: no step refused; then balance over the 4 within 0.08;
  - rolling: a rolling SIGTERM of the replicas while 6 clients run sequences
    of 2 s (20 steps 0.1 s apart) back to back: no step refused, for the
    sequences open when the roll began and for those begun during it (the
    drain's grace, 20 s, is longer than a sequence); rolling-long: the same
    with sequences of 4 s, longer than the drain delay (2 s), so that steps
    reach a replica that refuses new calls and must still be served.

Each figure is printed ("figure ...: ...") for the record.
ATTENTION_CLUSTER_STEPS (e.g. "rejoin,rolling") runs only the steps named:
rejoin, rolling, rolling-long, scaleup. ATTENTION_CLUSTER_EDGE_DIR runs another
deploy/edge/ (replica_set.py), e.g. an older one to see these checks fail;
scale-up needs a run.sh with --max-replicas and is left out without it.

    ATTENTION_SERVER_BIN=build/server/attention-server \\
        build/tests/python-client-venv/bin/python tests/cluster/sequences_test.py
"""

import os
import signal
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scenarios  # noqa: E402
from replica_set import RUN_SH, RunShSet  # noqa: E402


def main():
    checks = scenarios.Checks()
    subprocess.run(["uptime"])
    steps = {"rejoin": scenarios.check_sequences_rejoin,
             "scaleup": scenarios.check_sequences_scale_up,
             "rolling": scenarios.check_sequences_rolling,
             # Longer than the drain delay (2 s): steps come while the replica
             # refuses new calls (docs/api.md section 6.5).
             "rolling-long": lambda checks, replica_set: scenarios.check_sequences_rolling(
                 checks, replica_set, steps=40)}
    wanted = os.environ.get("ATTENTION_CLUSTER_STEPS",
                            "rejoin,rolling,rolling-long,scaleup").split(",")
    unknown = [w for w in wanted if w not in steps]
    if unknown:
        print(f"ATTENTION_CLUSTER_STEPS: unknown {unknown}; the steps are {', '.join(steps)}")
        return 2
    run_flags = []
    if "scaleup" in wanted:
        usage = subprocess.run(["bash", RUN_SH, "--help"], capture_output=True, text=True).stdout
        if "--max-replicas" in usage:
            run_flags = ["--max-replicas", "4"]
        else:
            print(f"SKIP scale-up: {RUN_SH} has no --max-replicas")
            wanted.remove("scaleup")
    replica_set = RunShSet(3, run_flags=run_flags)
    try:
        for name in wanted:
            steps[name](checks, replica_set)
    except Exception as error:  # noqa: BLE001 - reported as a failure with run.sh's log
        checks.expect(False, f"the scenario ran to its end: {error!r}")
        traceback.print_exc()
        print(replica_set.log()[-4000:])
        # SIGTERM to run.sh: exit 0, nothing left running.
        replica_set.process.send_signal(signal.SIGTERM)
        code = replica_set.process.wait(timeout=90)
        time.sleep(0.5)
        left = replica_set.leftovers()
        checks.expect(code == 0 and not left,
                      f"SIGTERM to run.sh: exit 0 ({code}), nothing left running ({left})")
    finally:
        replica_set.stop()
    subprocess.run(["uptime"])
    return checks.summary()


if __name__ == "__main__":
    sys.exit(main())
