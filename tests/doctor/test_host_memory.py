"""The node's memory as the host-RAM leaf reads it: MemTotal, or the container's cgroup limit when lower (v2
`memory.max`, v1 `memory.limit_in_bytes`, "no limit" in either spelling), on fake /proc and /sys files;
this process's resident set and its resettable peak on the real ones."""

from __future__ import annotations

import pytest

from scalerl.doctor import host_memory


@pytest.fixture
def fake_node(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16777216 kB\nMemFree:         1024 kB\n")  # 16 GiB
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(host_memory, "MEMINFO", meminfo)
    monkeypatch.setattr(host_memory, "CGROUP_LIMITS", (v2, v1))
    return meminfo, v2, v1


def test_memtotal_without_a_container_limit(fake_node):
    assert host_memory.node_memory_gb() == {"total_gb": 16.0, "source": "MemTotal"}


@pytest.mark.parametrize("v2, v1, expected", [
    ("max", None, (16.0, "MemTotal")),                                  # v2: no limit
    (None, str(9223372036854771712), (16.0, "MemTotal")),               # v1: no limit (the largest page-aligned)
    (str(4 * 2**30), None, (4.0, "cgroup limit")),                     # v2: a 4 GiB container
    (None, str(2 * 2**30), (2.0, "cgroup limit")),                     # v1
    (str(32 * 2**30), None, (16.0, "MemTotal")),                       # a limit above the node's memory
])
def test_a_cgroup_limit_counts_when_lower(fake_node, v2, v1, expected):
    _, v2_path, v1_path = fake_node
    if v2 is not None:
        v2_path.write_text(v2 + "\n")
    if v1 is not None:
        v1_path.write_text(v1 + "\n")
    got = host_memory.node_memory_gb()
    assert (got["total_gb"], got["source"]) == expected


def test_no_memtotal_is_said_by_name(fake_node):
    meminfo, _, _ = fake_node
    meminfo.write_text("MemFree: 1 kB\n")
    with pytest.raises(OSError, match="no MemTotal in .*meminfo"):
        host_memory.node_memory_gb()


def test_the_peak_resets_to_the_resident_set_and_grows_with_touched_pages():
    if not host_memory.reset_host_peak():
        pytest.skip("this kernel refuses /proc/self/clear_refs")
    before = host_memory.host_peak_gb()
    assert before == pytest.approx(host_memory.host_rss_gb(), abs=0.02)
    block = bytearray(256 * 2**20)  # zero-filled: every page touched
    assert host_memory.host_peak_gb() >= before + 0.2
    del block
