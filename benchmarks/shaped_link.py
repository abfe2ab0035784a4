"""A network of known bandwidth on one machine: a private network namespace with a shaped loopback.

Every collective of a local run crosses the machine's loopback, which is as fast as the CPU. This
harness gives a run a link of known bandwidth instead: it creates a network namespace of its own,
brings the namespace's loopback up, rate-limits it with ``tc`` (a ``tbf`` qdisc), runs the command
inside it with ``ip netns exec`` and removes the namespace afterwards, also on Ctrl-C, SIGTERM or
failure (processes still inside are killed first, by id). Traffic stays on the namespace's
loopback (127.0.0.1): nothing leaves the machine, and no other address is used.

A shaped loopback is **one shared medium**: every rank's traffic in the namespace shares the one
rate, as if all workers sat behind a single link, not a link per worker. The kernels here have no
``netem``: the link adds no latency (count round trips and model them instead).

Needs root, ``ip`` and ``tc`` (iproute2); without them it prints one line saying what is missing
and exits with status 2, having made nothing.

Usage::

    python benchmarks/shaped_link.py --rate 1gbit -- .venv/bin/subnetdp train resnet18_digits launch.nproc=4
    python benchmarks/shaped_link.py --rate 100mbit --measure      # the rate a TCP stream gets, then exit

or, from Python, ``with shaped_namespace("1gbit") as ns: run_in(ns, argv)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Iterator, Sequence

PREFIX = "subnetdp-link"  # every namespace this harness makes is named PREFIX-<pid>-<n>
UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# Environment for processes inside: gloo binds to the loopback, rendezvous on 127.0.0.1 only.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
_made: list[str] = []


class LinkError(RuntimeError):
    """The harness cannot make or use its namespace; the message is one line saying why and the fix."""


def missing_requirement() -> str | None:
    """Why this process cannot shape a link (not root, no ``ip`` or ``tc``), or None when it can."""
    if os.geteuid() != 0:
        return ("needs root: network namespaces and tc qdiscs can only be made by root "
                f"(running as uid {os.geteuid()}); run it as root, e.g. with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs '{tool}' (iproute2) on PATH, which has none; install iproute2"
    return None


def rate_bits(rate: str) -> float:
    """``"100mbit"`` -> 1e8: a tc rate in bits per second (tc's decimal units)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", rate.lower())
    if m is None or (m.group(2) or "bit") not in UNITS:
        raise LinkError(f"rate {rate!r}: not a tc rate; use e.g. 10gbit, 1gbit or 100mbit")
    return float(m.group(1)) * UNITS[m.group(2) or "bit"]


def burst_bytes(bits_per_s: float) -> int:
    """The token bucket's depth: 1 ms of traffic, at least 256 KiB (above lo's 64 KiB packets)."""
    return max(256 * 1024, int(bits_per_s / 8 / 1000))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise LinkError(f"'{' '.join(args)}' failed: {(proc.stderr or proc.stdout).strip()}")
    return proc


def namespace_pids(ns: str) -> list[int]:
    """Processes still running inside namespace ``ns``."""
    out = _ip("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


def remove_namespace(ns: str, grace_s: float = 5.0) -> None:
    """Stop what still runs inside ``ns`` (SIGTERM, then SIGKILL after ``grace_s``) and delete it."""
    pids = namespace_pids(ns)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = namespace_pids(ns)
        if not pids:
            break
    _ip("ip", "netns", "del", ns, check=False)
    if ns in _made:
        _made.remove(ns)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally that removes the namespace


@contextlib.contextmanager
def shaped_namespace(rate: str | None, name: str | None = None) -> Iterator[str]:
    """A fresh network namespace with its loopback up and (unless ``rate`` is None) shaped to ``rate``.

    Yields its name; removes it (and kills what still runs inside) on the way out, whatever happens.
    SIGINT and SIGTERM raise KeyboardInterrupt while inside, so a killed benchmark cleans up too (also
    when started in the background by a shell, which would have it ignore SIGINT).

    Raises:
        LinkError: not root, no ``ip``/``tc``, or a command of the set-up failed.
    """
    why = missing_requirement()
    if why:
        raise LinkError(why)
    bits = rate_bits(rate) if rate else None
    ns = name or f"{PREFIX}-{os.getpid()}-{len(_made)}"
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)} if _is_main_thread() else {}
    try:
        _ip("ip", "netns", "add", ns)
        _made.append(ns)
        _ip("ip", "-n", ns, "link", "set", "lo", "up")
        if bits:
            _ip("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{int(bits)}bit",
                "burst", str(burst_bytes(bits)), "latency", "100ms")
        yield ns
    finally:
        if ns in _made:
            remove_namespace(ns)
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_in(ns: str, argv: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None,
           stdout: int | None = None) -> int:
    """Run ``argv`` inside namespace ``ns`` (in a session of its own); its exit status.

    On Ctrl-C or a timeout the command's process group gets SIGINT, then SIGKILL, and the
    exception goes on (the namespace's own clean-up then kills anything left inside).
    """
    full_env = {**os.environ, **LOOPBACK_ENV, **(env or {})}
    proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=full_env, start_new_session=True,
                            stdout=stdout)
    try:
        return proc.wait(timeout=timeout)
    except BaseException:
        for sig, wait in ((signal.SIGINT, 10.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # the process group we started, by its id
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
        raise


def tx_bytes(ns: str | None = None) -> int:
    """Bytes sent on the loopback of ``ns`` so far (None: of the namespace this process is in).

    Inside the namespace this is a file read (``ip netns exec`` mounts the namespace's sysfs).
    """
    if ns is None:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return int(f.read())
    out = json.loads(_ip("ip", "-n", ns, "-s", "-j", "link", "show", "lo").stdout)
    return int(out[0]["stats64"]["tx"]["bytes"])


_STREAM = r"""
import socket, sys, threading, time
seconds, chunk = float(sys.argv[1]), b"\0" * (1 << 20)
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
got = [0]
def sink():
    c, _ = srv.accept()
    while True:
        n = len(c.recv(1 << 20))
        if not n: break
        got[0] += n
t = threading.Thread(target=sink); t.start()
cli = socket.create_connection(srv.getsockname())
t0 = time.perf_counter()
while time.perf_counter() - t0 < seconds: cli.sendall(chunk)
cli.close(); t.join(); print(got[0] * 8 / (time.perf_counter() - t0))
"""


def measure_rate(ns: str, seconds: float = 1.5) -> float:
    """Bits per second one TCP stream gets across the loopback of ``ns`` (a calibration)."""
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", _STREAM, str(seconds)],
                         capture_output=True, text=True, check=True, timeout=seconds + 60)
    return float(out.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --rate RATE [--measure] [-- COMMAND ...]")
    parser.add_argument("--rate", default=None, help="tc rate of the namespace's loopback, e.g. 1gbit; "
                        "omit for an unshaped namespace")
    parser.add_argument("--measure", action="store_true", help="print the rate a TCP stream gets, then run COMMAND")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run inside")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.measure:
        parser.error("give a command after --, or --measure")
    try:
        with shaped_namespace(args.rate) as ns:
            print(f"shaped_link: namespace {ns}, loopback " + (f"shaped to {args.rate}" if args.rate else "unshaped"),
                  file=sys.stderr, flush=True)
            if args.measure:
                print(f"shaped_link: one TCP stream gets {measure_rate(ns) / 1e6:.0f} Mbit/s", file=sys.stderr,
                      flush=True)
            return run_in(ns, command) if command else 0
    except LinkError as e:
        print(f"shaped_link: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shaped_link: interrupted; namespace removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
