"""The shaped-link harness (``benchmarks/shaped_link.py``): it refuses clearly without root or ``tc``,
runs the command inside a namespace of its own whose loopback is shaped, and always removes the
namespace: after success, after the command fails, and after Ctrl-C or SIGTERM to the harness.

Real namespaces, real ``tc``, real signals sent by PID. The tests that make namespaces need root and
iproute2 and are skipped otherwise, with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = [sys.executable, str(ROOT / "benchmarks" / "shaped_link.py")]
IS_ROOT = os.geteuid() == 0
HAS_IPROUTE = shutil.which("ip") is not None and shutil.which("tc") is not None
needs_netns = pytest.mark.skipif(not (IS_ROOT and HAS_IPROUTE),
                                 reason="needs root and iproute2 (ip, tc) to make network namespaces")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _made(stderr: str) -> str:
    m = re.search(r"namespace (\S+),", stderr)
    assert m, f"the harness did not name its namespace: {stderr!r}"
    return m.group(1)


def _readable_by_anyone_harness() -> tuple[list[str], str]:
    """The harness copied where uid 65534 can read it, run by the base interpreter: the checkout (and
    its .venv) may sit in a folder only its owner can open. The harness needs only the standard library."""
    folder = tempfile.mkdtemp(prefix="shaped-link-")
    os.chmod(folder, 0o755)
    script = Path(folder) / "shaped_link.py"
    shutil.copyfile(ROOT / "benchmarks" / "shaped_link.py", script)
    os.chmod(script, 0o644)
    return [os.path.realpath(sys.executable), "-I", str(script)], folder


def test_refuses_without_root():
    folder = None
    if IS_ROOT:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root and no setpriv to drop to another user")
        harness, folder = _readable_by_anyone_harness()
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *harness]
    else:
        cmd = list(HARNESS)
    before = _namespaces() if HAS_IPROUTE else set()
    try:
        proc = subprocess.run([*cmd, "--rate", "1gbit", "--", "true"], capture_output=True, text=True, timeout=60,
                              cwd="/")
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line, no traceback
    assert proc.stderr.startswith("shaped_link: needs root")
    if IS_ROOT:
        assert "uid 65534" in proc.stderr
    if HAS_IPROUTE:
        assert _namespaces() == before


@pytest.mark.skipif(not IS_ROOT, reason="as another user the harness refuses for want of root before it looks for tc")
def test_refuses_without_tc(tmp_path):
    (tmp_path / "ip").symlink_to(shutil.which("ip") or "/sbin/ip")  # ip is there, tc is not
    before = _namespaces() if HAS_IPROUTE else set()
    proc = subprocess.run([*HARNESS, "--rate", "1gbit", "--", "true"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": str(tmp_path)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shaped_link: needs 'tc' (iproute2) on PATH, which has none; install iproute2"
    if HAS_IPROUTE:
        assert _namespaces() == before


@needs_netns
def test_runs_inside_a_shaped_namespace_and_removes_it():
    probe = ("import subprocess; print(subprocess.run(['ip', '-o', 'link'], capture_output=True, text=True).stdout);"
             "print(subprocess.run(['tc', 'qdisc', 'show', 'dev', 'lo'], capture_output=True, text=True).stdout)")
    proc = subprocess.run([*HARNESS, "--rate", "100mbit", "--", sys.executable, "-c", probe], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    links = [line for line in proc.stdout.splitlines() if re.match(r"\d+: ", line)]
    assert len(links) == 1 and links[0].split(":")[1].strip() == "lo"  # the namespace has a loopback only
    assert "state UNKNOWN" in links[0] or "UP" in links[0]
    assert re.search(r"qdisc tbf \S+ root .*rate 100Mbit", proc.stdout)
    assert _made(proc.stderr) not in _namespaces()


@needs_netns
def test_a_failing_command_keeps_its_status_and_the_namespace_goes():
    proc = subprocess.run([*HARNESS, "--rate", "1gbit", "--", sys.executable, "-c", "raise SystemExit(3)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert _made(proc.stderr) not in _namespaces()


@needs_netns
def test_a_bad_rate_is_refused_before_anything_is_made():
    before = _namespaces()
    proc = subprocess.run([*HARNESS, "--rate", "fast", "--", "true"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "shaped_link: rate 'fast': not a tc rate; use e.g. 10gbit, 1gbit or 100mbit"
    assert _namespaces() == before


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell does for a job it starts in the background


@needs_netns
@pytest.mark.parametrize("sig, background", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                             (signal.SIGINT, True)])
def test_a_signal_to_the_harness_removes_the_namespace_and_what_runs_in_it(tmp_path, sig, background):
    pidfile = tmp_path / "pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(300)"
    harness = subprocess.Popen([*HARNESS, "--rate", "1gbit", "--", sys.executable, "-c", child],
                               stderr=subprocess.PIPE, text=True, preexec_fn=_ignore_sigint if background else None)
    try:
        deadline = time.monotonic() + 60
        while not pidfile.exists() or not pidfile.read_text():
            assert time.monotonic() < deadline and harness.poll() is None, "the command never started"
            time.sleep(0.1)
        inner = int(pidfile.read_text())
        harness.send_signal(sig)
        _, err = harness.communicate(timeout=60)
    finally:
        if harness.poll() is None:  # the test failed: leave nothing behind
            harness.send_signal(signal.SIGTERM)
            harness.communicate(timeout=60)
    assert harness.returncode == 130
    assert _made(err) not in _namespaces()
    assert "namespace removed" in err
    with pytest.raises(ProcessLookupError):
        os.kill(inner, 0)  # the command inside was stopped too
