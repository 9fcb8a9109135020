"""API keys: flags and key files, Bearer parsing, every key accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.router.api.keys import ApiKeys


def test_keys_from_flag_and_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated 2025-01\nold-key\n\n  new-key  \n")
    path.chmod(0o600)
    keys = ApiKeys.load("flag-key", path)
    assert keys is not None and len(keys) == 3
    for key in ("flag-key", "old-key", "new-key"):
        assert keys.accepts(key) and keys.accepts_header(f"Bearer {key}")
    assert keys.accepts_header("bearer  new-key ")
    for bad in (None, "", "new-key", "Basic new-key", "Bearer", "Bearer new", "Bearer new-key2",
                "Bearer # rotated 2025-01", "Bearer \ud800"):
        assert not keys.accepts_header(bad), bad
    assert ApiKeys.load(None, None) is None


def test_bad_key_files_and_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        ApiKeys.load(None, empty)
    with pytest.raises(FileNotFoundError):
        ApiKeys.load(None, tmp_path / "missing")
    for bad in ([], [""], ["two words"], ["tab\tkey"]):
        with pytest.raises(ValueError):
            ApiKeys(bad)
    shared = tmp_path / "shared"
    shared.write_text("k\n")
    shared.chmod(0o644)
    ApiKeys.load(None, shared)
    assert "can be read by other users" in caplog.text
