"""A launched worker's C++ side writes to the run's logs/, its Python lines to the console (real descriptors)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from subnetdp.train.failures import route_native_stderr
    route_native_stderr(Path(sys.argv[1]), 3)
    os.write(2, b"[W TCPStore.cpp:106] sendBytes failed: Broken pipe\\nframe #0: c10::Error\\n")  # as C++ does
    print("subnetdp: error: rank 3 stopped", file=sys.stderr)
""")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SUBNETDP_NATIVE_STDERR")}
    return subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**full, **env})


def test_fd_2_goes_to_the_log_and_python_lines_to_the_console(tmp_path: Path) -> None:
    worker = _run(tmp_path, TORCHELASTIC_RUN_ID="job")
    assert worker.returncode == 0, worker.stderr
    assert worker.stderr == "subnetdp: error: rank 3 stopped\n"
    assert (tmp_path / "logs" / "rank_3.stderr").read_text().startswith("[W TCPStore.cpp:106] sendBytes failed")
    # Not launched by torch's elastic agent (a test, a notebook), or asked not to: the streams stay.
    for env in ({}, {"TORCHELASTIC_RUN_ID": "job", "SUBNETDP_NATIVE_STDERR": "console"}):
        plain = _run(tmp_path / str(len(env)), **env)
        assert "sendBytes failed" in plain.stderr and "rank 3 stopped" in plain.stderr
        assert not (tmp_path / str(len(env)) / "logs").exists()


def test_the_agent_finds_the_run_directory_its_logs_go_to() -> None:
    from subnetdp.launchers.torchrun import run_dir_of_args

    job = ["--nnodes", "2", "--max-restarts", "1", "-m", "subnetdp", "train", "resnet18_digits"]
    assert run_dir_of_args([*job, "run.dir=/x", "run.name=exp"]) == Path("/x/exp")
    assert run_dir_of_args([*job, "run.name=exp"]) == Path("runs/exp")  # the default folder, composed
    assert run_dir_of_args(job) is None  # the workers make the name up: the records stay on the console


AGENT = textwrap.dedent("""
    import datetime, gc, os, sys
    from subnetdp.launchers.torchrun import quiet_native_warnings
    quiet_native_warnings()
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("a", "1")
    del server  # the store's host is gone, as node 0's agent at the end of a job
    gc.collect()
    try:
        client.compare_set("a", "1", "2")
    except Exception as e:
        print(f"raised {type(e).__name__}", file=sys.stderr)
    print(os.environ.get("TORCH_CPP_LOG_LEVEL", "unset"))
""")


def test_the_agents_cpp_side_logs_errors_only_and_its_workers_keep_their_level() -> None:
    # Node 1's agent closing its rendezvous after node 0's agent (the store's host) exited printed torch's
    # TCPStore warning and a C++ backtrace on the console: an occasional failure of the quiet-console test.
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_CPP_LOG_LEVEL", "SUBNETDP_NATIVE_STDERR")}
    agent = subprocess.run([sys.executable, "-c", AGENT], capture_output=True, text=True, timeout=120, env=env)
    assert "raised DistNetworkError" in agent.stderr, agent.stderr
    assert "TCPStore.cpp" not in agent.stderr, agent.stderr  # torch's error is raised, its C++ warning not printed
    assert agent.stdout.strip() == "unset"  # what the agent's workers inherit
