"""``torchrun --nproc_per_node 2`` with gloo trains examples/torch_ddp.py: the loss falls, both
ranks end with identical parameters and identical plans, and each rank measured a disjoint
share (about half) of the tuning tasks. Each rank has its own cache file, as on two nodes
without a shared filesystem."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_two_ranks_deal_out_tuning_and_train_identically(tmp_path):
    report = tmp_path / "report"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(29500 + os.getpid() % 1000),
        str(REPO / "examples" / "torch_ddp.py"),
        "--steps", "16", "--report", str(report), "--cache", str(tmp_path / "cache{rank}.sqlite"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    ranks = [json.loads((report / f"rank{r}.json").read_text()) for r in range(2)]
    first, second = ranks
    assert first["world_size"] == second["world_size"] == 2
    # Training: parameters identical on both ranks, loss falls.
    assert first["checksum"] == second["checksum"]
    losses = first["losses"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4, losses
    # Tuning: every task measured once, dealt out evenly, and the same plans everywhere.
    tasks = first["tasks_dealt"]
    assert tasks == second["tasks_dealt"] > 0
    mine, theirs = set(first["tasks_here"]), set(second["tasks_here"])
    assert not mine & theirs
    assert len(mine) + len(theirs) == tasks
    assert abs(len(mine) - len(theirs)) <= 2
    # The summary's counts: each rank measured its share and stored the other's; fresh caches
    # held nothing before.
    for me, other in ((first, second), (second, first)):
        assert me["measured"] == len(me["tasks_here"]), me
        assert me["shared"] == len(other["tasks_here"]), me
        assert me["cached"] == 0, me
    assert first["plans"] == second["plans"]
    assert "step" in done.stdout and "tuning:" in done.stdout
