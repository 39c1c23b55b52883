"""scenarios: the measurements run_sh_test.py and netns_test.py make on a
replica set (replica_set.py) under load (workload.py), each checked against
its target (RELIABILITY.md section 11) and printed as a "figure" line for the record.

Checks marked `after` depend on parts of the project outside the edge: the
server's drain that keeps serving while it reports NOT_SERVING, its error
text naming the header, and the Python client's session replay. They are
reported (and fail) like the others; their names say what they wait for.
"""

import os
import signal
import threading
import time

import numpy as np

from workload import (Load, SequenceLoad, edge_servers, failures_report, metric_sum,  # noqa: F401
                      metrics, paced_sequences, served_calls, session_decodes, triton_sequences,
                      wait_until)

SERVER_DRAIN = "needs the server's drain that serves while NOT_SERVING"
SERVER_TEXT = "needs the server's error text naming the header"
CLIENT_REPLAY = "needs the Python client's session replay"


class Checks:
    def __init__(self):
        self.failed = []
        self.passed = 0

    def expect(self, ok, what, after=None):
        label = f"{what} [{after}]" if after else what
        if ok:
            self.passed += 1
            print(f"ok   {label}", flush=True)
        else:
            self.failed.append(label)
            print(f"FAIL {label}", flush=True)

    def summary(self):
        print(f"{self.passed} passed, {len(self.failed)} failed")
        for what in self.failed:
            print(f"  failed: {what}")
        return 0 if not self.failed else 1


def figure(name, value):
    print(f"figure {name}: {value}", flush=True)


def shares(replica_set, seconds=5.0, threads=8):
    """Each replica's share of the Attend calls of `threads` threads over
    one connection, from the replicas' own counters."""
    replicas = replica_set.replicas()
    with Load(replica_set.address, threads=threads) as load:
        time.sleep(1.0)  # the connection and the first calls
        before = {s: served_calls(r.metrics_address) for s, r in replicas.items()}
        time.sleep(seconds)
        after = {s: served_calls(r.metrics_address) for s, r in replicas.items()}
    served = {s: after[s] - before[s] for s in replicas}
    total = sum(served.values())
    return {s: served[s] / total for s in sorted(served)}, total, load


def check_balance(checks, replica_set):
    share, total, load = shares(replica_set)
    n = len(share)
    worst = max(abs(v - 1 / n) for v in share.values())
    figure("balance shares", " ".join(f"r{s} {v:.3f}" for s, v in share.items()) +
           f" ({total:.0f} calls in 5 s from 8 threads on one connection)")
    checks.expect(worst <= 0.08, f"balance: every replica within 0.08 of 1/{n} (worst {worst:.3f})")
    failed = failures_report(load.calls, 0)["failed"]
    checks.expect(failed == 0, f"balance: no call failed ({failed})")


def check_kill9(checks, replica_set, slot=2):
    """kill -9 of one replica under load: nothing fails, and the supervisor
    has a new one serving in the edge's rotation within 5 s."""
    with Load(replica_set.address) as load:
        time.sleep(2.0)
        victim = replica_set.replicas()[slot]
        fault = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        replica_set.replacement(slot, victim.pid)
        replaced = time.monotonic() - fault
        time.sleep(2.0)
    report = failures_report(load.calls, fault)
    figure("kill -9", f"{report['failed']} of {report['calls']} calls failed {report['codes']} {report['details']}; "
           f"replaced and UP at the edge in {replaced:.2f} s")
    checks.expect(report["failed"] == 0, f"kill -9: no call failed ({report['failed']})")
    checks.expect(replaced <= 5.0, f"kill -9: replaced within 5 s ({replaced:.2f} s)")


def roll(replica_set):
    """SIGTERM to each replica in turn, the next once the last is replaced;
    the seconds each replacement took."""
    times = []
    for slot in sorted(replica_set.replicas()):
        victim = replica_set.replicas()[slot]
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGTERM)
        replica_set.replacement(slot, victim.pid, seconds=60)
        times.append(time.monotonic() - t0)
    return times


def check_rolling(checks, replica_set):
    """SIGTERM to each replica in turn, the next once the last is replaced."""
    with Load(replica_set.address) as load:
        time.sleep(2.0)
        start = time.monotonic()
        times = roll(replica_set)
        time.sleep(2.0)
    report = failures_report(load.calls, start)
    figure("rolling SIGTERM", f"{report['failed']} of {report['calls']} calls failed "
           f"{report['codes']} {report['details']}; each replica replaced in " +
           ", ".join(f"{t:.1f} s" for t in times))
    checks.expect(report["failed"] == 0, f"rolling SIGTERM: no call failed ({report['failed']})",
                  after=SERVER_DRAIN)


class EdgeWatch:
    """Polls the edge's view of its replicas every 0.1 s, in a thread, and
    keeps the changes: [(seconds since `origin`, server, state)]."""

    def __init__(self, edge_metrics, origin):
        self.edge_metrics = edge_metrics
        self.origin = origin
        self.changes = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        last = {}
        while not self._stop.is_set():
            try:
                states = edge_servers(self.edge_metrics)
            except OSError:
                states = last
            for server, state in states.items():
                if last.get(server, "UP") != state:
                    self.changes.append((time.monotonic() - self.origin, server, state))
            last = states
            self._stop.wait(0.1)

    def text(self):
        return ", ".join(f"{server} {state} at {t:.1f} s" for t, server, state in self.changes) or "none"


def check_outage(checks, replica_set, name, begin, end, seconds, during=None):
    """A replica unreachable for `seconds` (begin() .. end()) under 8
    threads with 2 s deadlines: at most 2 failed calls per thread, none
    begun later than 3.5 s into the fault. during() is called every 0.5 s
    of the fault (to watch the alerts)."""
    with Load(replica_set.address, timeout=2.0) as load:
        time.sleep(2.0)
        fault = time.monotonic()
        with EdgeWatch(replica_set.edge_metrics, fault) as watch:
            begin()
            try:
                while time.monotonic() < fault + seconds:
                    if during:
                        during()
                    time.sleep(min(0.5, max(0.0, fault + seconds - time.monotonic())))
            finally:
                end()
            time.sleep(4.0)
    report = failures_report(load.between(fault - 2.0, float("inf")), fault)
    worst = max(report["per_thread"].values(), default=0)
    latest = report["latest_start_s"]
    starts = sorted(round(c.start - fault, 1) for c in load.between(fault - 2.0, float("inf"))
                    if c.code != "OK")
    figure(name, f"{report['failed']} of {report['calls']} calls failed {report['codes']} {report['details']}; "
           f"per thread {dict(sorted(report['per_thread'].items()))}; failed calls began at "
           f"{starts} s into the fault; the edge saw: {watch.text()}")
    checks.expect(worst <= 2, f"{name}: at most 2 failed calls per thread ({worst})")
    checks.expect(latest is None or latest <= 3.5,
                  f"{name}: no failed call begun later than 3.5 s into the fault ({latest})")


def check_sessions(checks, replica_set, kill_at=48):
    """6 session decodes of 96 steps; at step 48 the replica holding the most
    sessions is killed (-9): every session finishes, within 1e-4 of the
    same decodes uninterrupted."""
    reference, errors, _ = session_decodes(replica_set.address)
    checks.expect(not errors, f"sessions: the uninterrupted decodes finish ({errors})")
    killed = {}

    def fault(step):
        if step != kill_at:
            return
        held = {s: metric_sum(metrics(r.metrics_address), "attention_sessions_open")
                for s, r in replica_set.replicas().items()}
        slot = max(held, key=held.get)
        killed.update(slot=slot, held=held)
        os.kill(replica_set.replicas()[slot].pid, signal.SIGKILL)

    outputs, errors, replays = session_decodes(replica_set.address, at_step=fault)
    done = [s for s in range(len(outputs)) if s not in errors]
    diff = float(np.nanmax(np.abs(outputs[done] - reference[done]))) if done else float("nan")
    figure("sessions across kill -9", f"replica r{killed.get('slot')} killed at step {kill_at} "
           f"holding {killed.get('held', {}).get(killed.get('slot'))} of the sessions open "
           f"{killed.get('held')}; {len(done)} of {len(outputs)} finished; max |diff| "
           f"{diff:.2e}; replays {replays}; errors {errors}")
    checks.expect(len(done) == len(outputs), f"sessions: {len(done)} of {len(outputs)} finish",
                  after=CLIENT_REPLAY)
    checks.expect(done and diff <= 1e-4, f"sessions: outputs within 1e-4 of the uninterrupted run "
                  f"({diff:.2e})")
    replica_set.replacement(killed["slot"], -1)


def check_triton(checks, replica_set):
    """8 Triton-style sequences of 48 unary ModelInfer steps: with the
    header none is refused; without it, or with an invalid one, steps meet
    replicas without their sequence and are refused as today."""
    refused = triton_sequences(replica_set.address, header=str)
    figure("Triton sequences with the header", f"{len(refused)} of 384 steps refused {refused[:2]}")
    checks.expect(not refused, f"Triton sequences with the header: no step refused ({len(refused)})")
    refused = triton_sequences(replica_set.address, header=None)
    figure("Triton sequences without the header", f"{len(refused)} of 384 steps refused")
    checks.expect(len(refused) > 0, "Triton sequences without the header: steps are refused "
                  "(the control: without affinity the test would fail)")
    refused = triton_sequences(replica_set.address, header=lambda i: f"{i},{i}")
    codes = {code for _, _, code, _ in refused}
    figure("Triton sequences with an invalid header (a comma)",
           f"{len(refused)} of 384 steps refused {codes}; e.g. {refused[0][3] if refused else '-'}")
    checks.expect(len(refused) > 0 and codes == {"INVALID_ARGUMENT"} and
                  all("names no open sequence" in m for *_, m in refused),
                  "Triton sequences with an invalid header: balanced as without one, the server "
                  "answers as today (INVALID_ARGUMENT, names no open sequence)")
    checks.expect(refused and all("attention-sequence-id" in m for *_, m in refused),
                  "the refusal names the attention-sequence-id header", after=SERVER_TEXT)


# --- sequences while replicas come and go -----------------------------------

_reference = {}


def sequence_reference(replica_set, seed=5):
    """The outputs of 8 sequences of 48 steps on a set that does not change,
    which the runs with faults must match (same seed, same rows)."""
    if seed not in _reference:
        run = paced_sequences(replica_set.address, seed=seed)
        if run.refused:
            raise RuntimeError(f"the reference sequences were refused: {run.refused[:2]}")
        _reference[seed] = run.outputs
    return _reference[seed]


def _sequence_figures(run, reference):
    finite = np.isfinite(run.outputs).all(axis=2)
    diff = float(np.max(np.abs(run.outputs[finite] - reference[finite]))) if finite.any() else float("nan")
    broken = sorted({sequence_id for sequence_id, *_ in run.refused})
    return diff, broken


def _frozen_replacement(replica_set, slot, old_pid, seconds=30):
    """The process run.sh starts in `slot` after `old_pid`, stopped
    (SIGSTOP) as soon as it is seen, so that it joins the edge's rotation
    only when the test lets it (SIGCONT)."""
    server = os.path.realpath(os.environ["ATTENTION_SERVER_BIN"])
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == old_pid:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if parent == replica_set.process.pid and \
                    any(arg.endswith(f"/ports.{slot}".encode()) for arg in command):
                try:
                    # The server itself, not run.sh's fork of it before its exec.
                    if os.path.realpath(f"/proc/{entry}/exe") != server:
                        continue
                    os.kill(int(entry), signal.SIGSTOP)
                except OSError:
                    continue
                return int(entry)
        time.sleep(0.002)
    raise TimeoutError(f"no new process in slot {slot} within {seconds} s")


def check_sequences_rejoin(checks, replica_set, slot=2, step_seconds=0.1, rejoin_step=6):
    """8 sequences x 48 unary steps begin while replica `slot` has just been
    replaced (kill -9; its new process held stopped, so out of the edge's
    rotation), which is let go at step `rejoin_step` and joins the rotation
    mid-way: no step refused, outputs within 1e-4 of the same sequences on a
    steady set."""
    reference = sequence_reference(replica_set)
    victim = replica_set.replicas()[slot]
    fault = time.monotonic()
    released = {}

    def release(i, step):
        if i == 0 and step == rejoin_step and "at" not in released:
            os.kill(released["pid"], signal.SIGCONT)
            released["at"] = time.monotonic() - fault

    with EdgeWatch(replica_set.edge_metrics, fault) as watch:
        os.kill(victim.pid, signal.SIGKILL)
        try:
            released["pid"] = _frozen_replacement(replica_set, slot, victim.pid)
            wait_until(lambda: edge_servers(replica_set.edge_metrics).get(f"r{slot}") == "DOWN", 30,
                       f"replica {slot} out of the edge's rotation")
            run = paced_sequences(replica_set.address, seed=5, step_seconds=step_seconds,
                                  before_step=release)
        finally:
            if "pid" in released:
                os.kill(released["pid"], signal.SIGCONT)
        back = [t for t, server, state in watch.changes if server == f"r{slot}" and state == "UP"]
    diff, broken = _sequence_figures(run, reference)
    first, last = run.first_step - fault, run.last_step - fault
    rejoined = back[-1] if back else None
    figure("sequences across a replica's return",
           f"r{slot} killed, its replacement held stopped until step {rejoin_step} "
           f"({released.get('at', float('nan')):.2f} s); 8 sequences x 48 steps ran {first:.2f} "
           f"to {last:.2f} s after the kill; r{slot} back in the rotation at "
           f"{'%.2f s' % rejoined if rejoined is not None else 'never'}; {len(run.refused)} of 384 "
           f"steps refused (sequences {broken}) {sorted({m for *_, m, _ in run.refused})[:1]}; "
           f"max |diff| {diff:.2e}; the edge saw: {watch.text()}")
    checks.expect(rejoined is not None and first < rejoined < last,
                  "rejoin: the replaced replica joined the rotation while the sequences ran")
    checks.expect(not run.refused, f"rejoin: no step refused ({len(run.refused)} of 384)")
    checks.expect(diff <= 1e-4, f"rejoin: outputs within 1e-4 of a steady set ({diff:.2e})")
    replica_set.replacement(slot, victim.pid)


def check_sequences_scale_up(checks, replica_set, step_seconds=0.1):
    """8 sequences x 48 unary steps while one more replica is added (run.sh's
    SIGUSR1) and joins the rotation mid-way: no step refused, outputs within
    1e-4; then the new replica takes its share of balanced calls."""
    reference = sequence_reference(replica_set)
    before = len(replica_set.replicas())
    added = {}
    origin = time.monotonic()

    def add(i, step):
        if i == 0 and step == 3:  # every sequence has begun
            def run_add():
                try:
                    replica = replica_set.add_replica()
                    added.update(slot=replica.slot, up=time.monotonic() - origin)
                except Exception as error:  # noqa: BLE001 - reported below
                    added.update(error=repr(error))
            added["thread"] = threading.Thread(target=run_add)
            added["thread"].start()

    run = paced_sequences(replica_set.address, seed=5, step_seconds=step_seconds, before_step=add)
    if "thread" in added:
        added.pop("thread").join()
    diff, broken = _sequence_figures(run, reference)
    first, last = run.first_step - origin, run.last_step - origin
    figure("sequences while a replica is added",
           f"{before} replicas + 1 (SIGUSR1 to run.sh at step 3): r{added.get('slot')} UP at "
           f"{added.get('up', float('nan')):.2f} s, the sequences ran {first:.2f} to {last:.2f} s; "
           f"{len(run.refused)} of 384 steps refused (sequences {broken}); max |diff| {diff:.2e}"
           f"{'; ' + added['error'] if 'error' in added else ''}")
    checks.expect("up" in added and first < added["up"] < last,
                  "scale-up: the added replica joined the rotation while the sequences ran")
    checks.expect(not run.refused, f"scale-up: no step refused ({len(run.refused)} of 384)")
    checks.expect(diff <= 1e-4, f"scale-up: outputs within 1e-4 of a steady set ({diff:.2e})")
    check_balance(checks, replica_set)


def check_sequences_rolling(checks, replica_set, threads=6, steps=20, step_seconds=0.1):
    """A rolling SIGTERM of every replica while `threads` clients run
    sequences of steps x step_seconds (2 s) back to back: no step refused for
    the sequences begun before the roll (nor for those begun during it)."""
    with SequenceLoad(replica_set.address, threads=threads, steps=steps,
                      step_seconds=step_seconds) as load:
        time.sleep(3.0)
        start = time.monotonic()
        times = roll(replica_set)
        end = time.monotonic()
        time.sleep(1.0)
    began_before = [s for s in load.sequences if s.start < start]
    open_at_roll = [s for s in began_before if s.end > start]
    during = [s for s in load.sequences if start <= s.start <= end]
    refused_before = sum(len(s.refused) for s in began_before)
    refused_during = sum(len(s.refused) for s in during)
    examples = sorted({f"{code}: {message}" for s in load.sequences for _, code, message in s.refused})[:2]
    figure(f"sequences of {steps * step_seconds:g} s across a rolling SIGTERM",
           f"{len(load.sequences)} sequences of {steps} steps x {step_seconds} s; "
           f"{len(open_at_roll)} open when the roll began: {refused_before} steps refused; "
           f"{len(during)} begun during the roll ({end - start:.1f} s; each replica replaced in "
           + ", ".join(f"{t:.1f} s" for t in times) + f"): {refused_during} refused {examples}")
    name = f"rolling with sequences of {steps * step_seconds:g} s"
    checks.expect(len(open_at_roll) >= threads // 2,
                  f"{name}: sequences open when the roll began ({len(open_at_roll)})")
    checks.expect(refused_before == 0, f"{name}: no step refused of the sequences begun before "
                  f"the roll ({refused_before})")
    checks.expect(refused_during == 0, f"{name}: no step refused of the sequences begun during "
                  f"it ({refused_during})")
