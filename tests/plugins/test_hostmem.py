"""The host tier's capacity is the process's real memory limit: cgroup v1 / v2, else physical memory."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from moe_offload.backends import host_tier
from moe_offload.hostmem import host_memory, physical_bytes

GiB = 1 << 30
PHYSICAL = 64 * GiB


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_v1_limit_of_the_group(tmp_path):
    root = _tree(tmp_path, {
        "proc/self/cgroup": "9:pids:/\n4:memory:/kubepods/pod1/c1\n0::/\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
        "sys/fs/cgroup/memory/kubepods/pod1/c1/memory.limit_in_bytes": str(8 * GiB),
    })
    mem = host_memory(root, PHYSICAL)
    assert mem.bytes == 8 * GiB and "cgroup v1" in mem.source and "/kubepods/pod1/c1" in mem.source


def test_a_parents_smaller_limit_binds(tmp_path):
    root = _tree(tmp_path, {
        "proc/self/cgroup": "4:cpu,memory:/slice/app\n",
        "sys/fs/cgroup/memory/slice/memory.limit_in_bytes": str(6 * GiB),
        "sys/fs/cgroup/memory/slice/app/memory.limit_in_bytes": str(12 * GiB),
    })
    assert host_memory(root, PHYSICAL).bytes == 6 * GiB


def test_v2_memory_max(tmp_path):
    root = _tree(tmp_path, {
        "proc/self/cgroup": "0::/user.slice/job.scope\n",
        "sys/fs/cgroup/cgroup.controllers": "cpu memory\n",
        "sys/fs/cgroup/user.slice/memory.max": "max\n",
        "sys/fs/cgroup/user.slice/job.scope/memory.max": str(3 * GiB),
    })
    mem = host_memory(root, PHYSICAL)
    assert mem.bytes == 3 * GiB and "cgroup v2" in mem.source


def test_a_container_sees_its_group_as_the_mount_root(tmp_path):
    # Inside a container /proc/self/cgroup names the host's path, but the mount shows the group itself at the root.
    root = _tree(tmp_path, {
        "proc/self/cgroup": "0::/kubepods.slice/pod7/cri-abc\n",
        "sys/fs/cgroup/cgroup.controllers": "memory\n",
        "sys/fs/cgroup/memory.max": str(2 * GiB),
    })
    assert host_memory(root, PHYSICAL).bytes == 2 * GiB


@pytest.mark.parametrize("files", [
    {},  # no /proc (not Linux)
    {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cgroup.controllers": "memory\n", "sys/fs/cgroup/memory.max": "max\n"},
    {"proc/self/cgroup": "4:memory:/\n", "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"},
    {"proc/self/cgroup": "4:memory:/big\n", "sys/fs/cgroup/memory/big/memory.limit_in_bytes": str(PHYSICAL * 2)},
])
def test_no_limit_or_a_larger_one_is_physical_memory(tmp_path, files):
    mem = host_memory(_tree(tmp_path, files), PHYSICAL)
    assert mem.bytes == PHYSICAL and mem.source == "physical memory"


def test_the_host_tier_reports_it():
    tier = host_tier()
    mem = host_memory()
    assert tier.capacity_bytes == mem.bytes <= physical_bytes() and tier.labels["limit"] == mem.source


V1 = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(not (V1 / "cgroup.procs").is_file() or not os.access(V1, os.W_OK),
                    reason="needs a writable cgroup v1 memory hierarchy (root on a cgroup v1 host)")
def test_a_real_cgroup_limit_reaches_the_host_tier():
    # A child process moved into a fresh group with a 3 GiB limit reports 3 GiB as its host tier.
    group = V1 / f"moe-offload-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(3 * GiB))
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")
    try:
        code = ("import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()));"
                "from moe_offload.backends import host_tier; print(host_tier().capacity_bytes)")
        r = subprocess.run([sys.executable, "-c", code, str(group)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-1000:]
        assert int(r.stdout.strip()) == 3 * GiB
    finally:
        group.rmdir()


def test_plan_host_puts_experts_on_disk_only_when_they_do_not_fit():
    from moe_offload.hostmem import MIN_KV_DISK, HostMemory, plan_host

    GiB = 2**30
    limit = HostMemory(8 * GiB, "cgroup v1 memory.limit_in_bytes of /pod")
    fits = plan_host(4 * GiB, GiB, kv_default=GiB, limit=limit, reserve=GiB)
    assert fits.host_cache is None and fits.kv_bytes is None and "every expert fits" in fits.reason
    # 15 GiB of experts under 8 GiB: dense 1, KV max(1/16 of the limit, MIN_KV_DISK), runtime 1 -> the rest caches
    big = plan_host(15 * GiB, GiB, kv_default=4 * GiB, limit=limit, reserve=GiB)
    assert big.kv_bytes == max(MIN_KV_DISK, limit.bytes // 16)
    assert big.host_cache == 8 * GiB - GiB - big.kv_bytes - GiB
    assert "cgroup v1" in big.reason and "experts on disk" in big.reason
    asked = plan_host(15 * GiB, GiB, kv_asked=2 * GiB, limit=limit, reserve=GiB)
    assert asked.kv_bytes == 2 * GiB and asked.host_cache == 4 * GiB  # the KV budget asked for is what it counts
    # --host-memory is the experts' share itself: disk only when they exceed it; a dense GPU model counts no dense
    assert plan_host(3 * GiB, GiB, host_memory=2 * GiB, limit=limit).host_cache == 2 * GiB
    assert plan_host(3 * GiB, GiB, host_memory=4 * GiB, limit=limit).host_cache is None
    gpu = plan_host(7 * GiB, 6 * GiB, kv_default=0, limit=limit, dense_on_host=False, reserve=GiB)
    assert gpu.host_cache is None
    assert plan_host(20 * GiB, 10 * GiB, limit=limit, reserve=GiB).host_cache == 0  # the tiering check names the minimum


def test_runtime_reserve_is_measured():
    from moe_offload.hostmem import HEADROOM, resident_bytes, runtime_reserve

    rss = resident_bytes()
    assert rss > 10 * 2**20  # a Python process with pytest loaded holds well over 10 MiB
    assert runtime_reserve() >= rss + HEADROOM - 64 * 2**20  # measured again: within what a call can allocate
