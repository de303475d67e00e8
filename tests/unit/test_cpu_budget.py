"""The CPUs the daemon may use (config/devices.py): its affinity, narrowed by
the tightest cgroup CPU quota of its cgroup and its parents, v1 or v2; and
each CPU worker's share of them."""
from __future__ import annotations

import os
from pathlib import Path

from torchpool.config.devices import cgroup_cpu_quota, cpu_budget, threads_per_worker


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_cgroup_v2_takes_the_tightest_quota_up_the_tree(tmp_path: Path) -> None:
    root = tree(tmp_path / "fs", {"cgroup.controllers": "cpu", "cpu.max": "max 100000",
                                  "kubepods/cpu.max": "400000 100000",
                                  "kubepods/pod1/cpu.max": "150000 100000",
                                  "kubepods/pod1/ctr/cpu.max": "max 100000"})
    (tmp_path / "cgroup").write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(str(tmp_path / "cgroup"), root) == 1.5


def test_cgroup_v1_cpu_controller_and_no_quota(tmp_path: Path) -> None:
    root = tree(tmp_path / "fs", {"cpu,cpuacct/cpu.cfs_period_us": "100000",
                                  "cpu,cpuacct/cpu.cfs_quota_us": "-1",
                                  "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
                                  "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000"})
    (tmp_path / "cgroup").write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(str(tmp_path / "cgroup"), root) == 2.0
    (tmp_path / "none").write_text("4:cpu,cpuacct:/\n")
    assert cgroup_cpu_quota(str(tmp_path / "none"), root) is None
    assert cgroup_cpu_quota(str(tmp_path / "missing"), root) is None


def test_the_budget_is_the_affinity_at_most_and_one_at_least() -> None:
    assert 1 <= cpu_budget() <= len(os.sched_getaffinity(0))


def test_workers_share_the_budget_one_thread_each_at_least() -> None:
    assert threads_per_worker(8, 1) == 8
    assert threads_per_worker(8, 3) == 2
    assert threads_per_worker(2, 2) == 1
    assert threads_per_worker(2, 60) == 1
    assert threads_per_worker(4, 0) == 4
