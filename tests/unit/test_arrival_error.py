"""The one line of a world that did not assemble, whichever way torch reports it."""

from __future__ import annotations

from types import SimpleNamespace

from subnetdp.plugins.comm.peers import arrival_error


def _comm(rank: int) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world_size=4, cfg=SimpleNamespace(name="gloo"),
                           env=SimpleNamespace(launcher="torchrun"))


def test_a_closed_store_reads_as_a_rank_that_could_not_meet_the_others(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    # Rank 0 (the store's host) timed out first and left: rank 1's read of the store fails, not times out.
    closed = RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?")
    line = arrival_error(_comm(1), "env://", 3.0, closed)
    assert line.startswith("comm.name=gloo: rank 1 of 4 could not meet the others"), line
    assert "raise comm.timeout_s" in line and "127.0.0.1:1234" in line
    assert arrival_error(_comm(1), "env://", 3.0, RuntimeError("timed out after 3 s")).startswith(
        "comm.name=gloo: rank 1 of 4 could not meet the others")
    joined = arrival_error(_comm(0), "env://", 3.0, RuntimeError("Timed out after 3 s, 2/4 clients joined"))
    assert joined.startswith("comm.name=gloo: only 2 of 4 processes arrived at 127.0.0.1:1234 within comm.timeout_s=3 s")
    # Rank 0's own closed connection is not this case: the raw error is named.
    other = arrival_error(_comm(0), "env://", 3.0, closed)
    assert other.startswith("comm.name=gloo: creating the 4-process group at 127.0.0.1:1234 failed: Failed to recv")
