"""The Prometheus file-SD targets file: format, atomic replacement, role labels."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.observability.file_sd import FileSD, Target, cluster_targets


def test_cluster_targets_label_roles() -> None:
    targets = cluster_targets("tiny", ("0.0.0.0", 8000),
                              {"decode-0": ("127.0.0.1", 9102), "prefill-0": ("10.0.0.5", 9101)})
    assert targets == [
        Target("127.0.0.1:8000", "router", "router", "tiny"),  # 0.0.0.0 is not dialable
        Target("127.0.0.1:9102", "decode", "decode-0", "tiny"),
        Target("10.0.0.5:9101", "prefill", "prefill-0", "tiny"),
    ]
    with pytest.raises(ValueError, match="worker id"):
        cluster_targets("tiny", None, {"mystery": ("h", 1)})
    with pytest.raises(ValueError, match="host:port"):
        Target("nohostport", "router", "router", "tiny")


def test_update_writes_prometheus_format_atomically(tmp_path: Path) -> None:
    path = tmp_path / "sd" / "pdserve.json"
    sd = FileSD(path)
    assert sd.read() == []
    first = cluster_targets("tiny", ("127.0.0.1", 8000), {"prefill-0": ("127.0.0.1", 9101),
                                                          "decode-0": ("127.0.0.1", 9102)})
    sd.update(first)
    groups = json.loads(path.read_text())
    assert groups[0] == {"targets": ["127.0.0.1:8000"],
                         "labels": {"role": "router", "worker": "router", "model": "tiny"}}
    assert [g["labels"]["role"] for g in groups] == ["router", "prefill", "decode"]
    assert sd.read() == sorted(first, key=lambda t: ("rpd".index(t.role[0]), t.worker))
    inode = path.stat().st_ino
    sd.update(first[:1])  # a worker left: the file is replaced, never edited in place
    assert path.stat().st_ino != inode and len(sd.read()) == 1
    assert [p.name for p in path.parent.iterdir()] == ["pdserve.json"]  # no temp files left
    assert path.stat().st_mode & 0o044 == 0o044  # readable by a Prometheus user
    sd.remove()
    assert not path.exists()
    sd.remove()  # idempotent
