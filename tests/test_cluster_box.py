"""The cluster in a box, in the suite: a Ray head and two worker nodes, each in its own network,
mount and PID namespace, sharing only an S3 server, a tracking server on PostgreSQL and the Ray
head (deploy/box/box.py). Two of deploy/box/scenarios.py's scenarios run here, as a user would
submit them from the client namespace: `hlm train --num-workers 2` across the two worker nodes
with its run storage in S3, and a sweep trial whose node is cut off mid-run. All eleven
(`python deploy/box/scenarios.py`) take too long for the suite on 2 cores; docs/clusters.md has
their figures.

Skipped, with the reason, where the box cannot be made (not Linux, not root, no iproute2 or
PostgreSQL, no moto)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

BOX = Path(__file__).resolve().parents[1] / "deploy" / "box"
sys.path.insert(0, str(BOX))
import box as box_mod  # noqa: E402
import client  # noqa: E402
import cuts  # noqa: E402
import jobs  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
PREFIX = "hlmtest"  # not the default box's: a user's box on this machine is left alone


@pytest.fixture(scope="module")
def box():
    reason = box_mod.missing()
    if reason:
        pytest.skip(reason)
    box_mod.teardown(PREFIX)  # what a killed test run may have left
    # Not under pytest's folder: PostgreSQL runs as an unprivileged user that root's 0700
    # temporary folders shut out.
    root = Path(tempfile.mkdtemp(prefix="hlm-box-", dir="/var/tmp"))
    try:
        up = box_mod.Box(root, prefix=PREFIX).up()
        yield up
        up.down()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_two_train_workers_land_on_two_nodes_with_the_run_in_s3(box):
    figures = jobs.train(box, "s3")
    assert sorted(figures["worker_nodes"].split(",")) == sorted(client.worker_ips(box))
    assert figures["corpus"].startswith(f"{client.S3_RUNS}/_prepared/")


def test_a_sweep_trial_whose_node_is_cut_off_finishes_on_the_other(box):
    figures = cuts.partition(box)
    assert figures["continued_on"] != figures["cut_node"]
    assert len(box.alive_nodes()) == 3  # the node rejoined


def test_the_box_leaves_no_namespace_link_or_process_behind(box):
    pods = [box.nodes[name].pod for name in ("head", *box_mod.WORKERS)]
    box.down()
    assert box_mod.leftovers(PREFIX) == [] and box_mod.links(PREFIX) == []
    assert not [pid for pid in pods if box_mod.running(pid)]
