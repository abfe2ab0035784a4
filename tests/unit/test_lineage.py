"""Which files descend from a run's current lineage (:func:`subnetdp.train.checkpoints.lineage.descends`)."""

from __future__ import annotations

import pytest

from subnetdp.core.errors import CheckpointError
from subnetdp.train.checkpoints import lineage

A, B = lineage.new_entry(0), lineage.new_entry(20)  # the run's start, and a resume from its step 20
CURRENT = {"run_id": "r" * 32, "lineage": [A, B]}


@pytest.mark.parametrize("header, why", [
    ({"run_id": "r" * 32, "step": 23, "lineage": [A, B]}, None),  # the branch itself
    ({"run_id": "r" * 32, "step": 20, "lineage": [A]}, None),  # its past, up to the step resumed from
    ({"run_id": "r" * 32, "step": 24, "lineage": [A]}, "on a branch this run left when it resumed from step 20"),
    ({"run_id": "s" * 32, "step": 23, "lineage": [A, B]}, "written by run ssssssss"),
    ({"run_id": "r" * 32, "step": 23, "lineage": [lineage.new_entry(0)]}, "continues lineage"),
    ({"run_id": "r" * 32, "step": 23, "lineage": "x"}, "its lineage is damaged"),
    ({"run_id": "r" * 32, "step": 23}, None),  # written before lineages: its run id decides
])
def test_a_file_descends_from_the_current_lineage_only(header, why):
    got = lineage.descends(CURRENT, header)
    assert (got is None) if why is None else (why in got), got
    assert lineage.descends(None, header) is None  # a run directory without a record: nothing to tell apart


def test_the_record_is_written_and_read_back_and_a_damaged_one_is_named(tmp_path):
    lineage.write(tmp_path, "r" * 32, [A, B])
    assert lineage.read(tmp_path) == CURRENT
    lineage.record_path(tmp_path).write_text('{"run_id": "r", "lineage": [{"id": "../x", "from_step": 0}]}')
    with pytest.raises(CheckpointError, match="LINEAGE.json: .*lineage.*expected a lineage id"):
        lineage.read(tmp_path)
    lineage.record_path(tmp_path).write_text("[" * 100000)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        lineage.read(tmp_path)
