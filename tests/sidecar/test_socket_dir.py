"""The sidecar's socket directory: created 0700, refused when another user owns it (kvferry.sidecar.app)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kvferry.sidecar.app import prepare_socket_dir

NOBODY = 65534


def test_a_new_directory_is_private(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "kvferry"
    prepare_socket_dir(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    prepare_socket_dir(directory)  # again: it is this user's, fine


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "kvferry"
    directory.mkdir(mode=0o777)
    if os.geteuid() == 0:
        os.chown(directory, NOBODY, NOBODY)
        owner = NOBODY
        with pytest.raises(ValueError, match=f"belongs to uid {owner}, not to this user"):
            prepare_socket_dir(directory)
    # Seen from another (non-root) user, a directory this one owns is someone else's.
    with pytest.raises(ValueError, match="another user could replace the socket"):
        prepare_socket_dir(directory, uid=os.geteuid() + 12345)


def test_a_root_owned_directory_is_accepted() -> None:
    """A Kubernetes emptyDir is root's, shared only by the pod's containers; /tmp stands for one here."""
    assert os.stat("/tmp").st_uid == 0
    prepare_socket_dir(Path("/tmp"), uid=NOBODY)


def test_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "kvferry").symlink_to(target)
    with pytest.raises(ValueError, match="not a directory"):
        prepare_socket_dir(tmp_path / "kvferry")
