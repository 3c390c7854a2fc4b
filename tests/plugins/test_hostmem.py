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


def _v1_group(limit: int) -> Path:
    """A fresh cgroup v1 memory group limited to ``limit`` bytes (the test skips when none can be made)."""
    group = V1 / f"moe-offload-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as e:
        pytest.skip(f"cannot create a memory cgroup here: {e}")
    return group


@pytest.mark.skipif(not (V1 / "cgroup.procs").is_file() or not os.access(V1, os.W_OK),
                    reason="needs a writable cgroup v1 memory hierarchy (root on a cgroup v1 host)")
def test_a_real_cgroup_limit_reaches_the_host_tier():
    # A child process moved into a fresh group with a 3 GiB limit reports 3 GiB as its host tier.
    group = _v1_group(3 * GiB)
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
    assert fits.host_cache is None and fits.kv_bytes == GiB and "every expert fits" in fits.reason
    # 15 GiB of experts under 8 GiB: dense 1, KV max(1/16 of the limit, MIN_KV_DISK), runtime 1 -> the rest caches
    big = plan_host(15 * GiB, GiB, kv_default=4 * GiB, limit=limit, reserve=GiB)
    assert big.kv_bytes == max(MIN_KV_DISK, limit.bytes // 16)
    assert big.host_cache == 8 * GiB - GiB - big.kv_bytes - GiB
    assert "cgroup v1" in big.reason and "experts on disk" in big.reason
    assert big.split()["experts_tier"] == "disk" and big.split()["experts_bytes"] == big.host_cache
    asked = plan_host(15 * GiB, GiB, kv_asked=2 * GiB, limit=limit, reserve=GiB)
    assert asked.kv_bytes == 2 * GiB and asked.host_cache == 4 * GiB  # the KV budget asked for is what it counts
    # --host-memory is the experts' share itself: disk only when they exceed it; a dense GPU model counts no dense
    assert plan_host(3 * GiB, GiB, host_memory=2 * GiB, limit=limit).host_cache == 2 * GiB
    assert plan_host(3 * GiB, GiB, host_memory=4 * GiB, limit=limit).host_cache is None
    gpu = plan_host(7 * GiB, 6 * GiB, kv_default=0, limit=limit, dense_on_host=False, reserve=GiB)
    assert gpu.host_cache is None and gpu.kv_bytes is None  # the KV cache is on the device: not the host's
    gpu_disk = plan_host(9 * GiB, 6 * GiB, kv_default=0, limit=limit, dense_on_host=False, reserve=GiB)
    assert gpu_disk.host_cache == 7 * GiB and gpu_disk.kv_bytes is None  # no host KV taken from the experts' cache


def test_plan_host_is_weights_first_at_the_boundary():
    # Experts 5 + dense 1 + runtime 1 = 7 GiB of an 8 GiB limit: with the 4 GiB default KV budget they would not fit,
    # but weights come first: every expert stays in memory and the KV budget is the 1 GiB they leave.
    from moe_offload.errors import ConfigError
    from moe_offload.hostmem import HostMemory, plan_host

    GiB = 2**30
    limit = HostMemory(8 * GiB, "cgroup v1 memory.limit_in_bytes of /pod")
    p = plan_host(5 * GiB, GiB, kv_default=4 * GiB, kv_floor=GiB // 2, limit=limit, reserve=GiB)
    assert p.host_cache is None and p.kv_bytes == GiB and "what the weights leave" in p.reason
    assert p.split() == {"limit_bytes": 8 * GiB, "limit_source": limit.source, "reserve_bytes": GiB, "dense_bytes": GiB,
                         "experts_bytes": 5 * GiB, "kv_bytes": GiB, "experts_tier": "host", "reason": p.reason}
    # exactly at the floor: still in memory; one byte more of experts and the floor no longer fits beside them
    edge = plan_host(6 * GiB - GiB // 2, GiB, kv_floor=GiB // 2, limit=limit, reserve=GiB)
    assert edge.host_cache is None and edge.kv_bytes == GiB // 2
    over = plan_host(6 * GiB - GiB // 2 + 1, GiB, kv_floor=GiB // 2, limit=limit, reserve=GiB)
    assert over.host_cache is not None and over.kv_bytes >= GiB // 2
    assert over.host_cache + over.kv_bytes == 8 * GiB - 2 * GiB  # the disk tier's cache is the rest
    # a limit that cannot hold the dense weights, the runtime and one sequence's KV is refused, naming the shortfall
    with pytest.raises(ConfigError, match=r"2\.00 GiB short"):
        plan_host(GiB, 6 * GiB, kv_floor=2 * GiB, limit=limit, reserve=2 * GiB)


def test_runtime_reserve_is_measured():
    from moe_offload.hostmem import HEADROOM, resident_bytes, runtime_reserve

    rss = resident_bytes()
    assert rss > 10 * 2**20  # a Python process with pytest loaded holds well over 10 MiB
    assert runtime_reserve() >= rss + HEADROOM - 64 * 2**20  # measured again: within what a call can allocate


@pytest.mark.skipif(not (V1 / "cgroup.procs").is_file() or not os.access(V1, os.W_OK),
                    reason="needs a writable cgroup v1 memory hierarchy (root on a cgroup v1 host)")
def test_under_a_limit_below_weights_plus_default_kv_the_experts_stay_in_memory(demo_model_dir):
    # A 3 GiB limit holds the runtime (~1 GiB), the demo model's weights and some KV, not the 4 GiB default KV
    # budget: weights first keeps every expert in host memory (no disk tier, no expert store) and gives KV the rest.
    import json

    group = _v1_group(3 * GiB)
    argv = [sys.executable, "-m", "moe_offload.cli", "generate", "--model", str(demo_model_dir), "--prompt",
            "The river runs", "--max-tokens", "4", "--ignore-eos", "--json"]
    try:
        r = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", *argv],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        mem = json.loads(r.stdout)["memory"]
    finally:
        group.rmdir()
    assert mem["limit_bytes"] == 3 * GiB and "cgroup v1" in mem["limit_source"]
    assert mem["experts_tier"] == "host" and "what the weights leave" in mem["reason"]
    assert mem["reserve_bytes"] + mem["dense_bytes"] + mem["experts_bytes"] + mem["kv_bytes"] == 3 * GiB
    assert 0 < mem["kv_bytes"] < 4 * GiB
    # the plan without weights first (the default KV budget counted before the experts) would not have fit
    assert mem["reserve_bytes"] + mem["dense_bytes"] + mem["experts_bytes"] + 4 * GiB > 3 * GiB
