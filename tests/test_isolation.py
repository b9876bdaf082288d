"""nnqueue.isolation's checks of what the engine user can read (the processes themselves: tests/workers/test_isolation.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from nnqueue.isolation import EngineUser, unreadable_by

STRANGER = EngineUser("stranger", 54321, 54321)  # owns nothing here, in no group of these files


@pytest.fixture
def base() -> Iterator[Path]:
    """A folder that anyone can reach (pytest's own temporary folders are private to their user)."""
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_a_folder_is_unreadable_when_a_folder_above_it_cannot_be_searched(base: Path) -> None:
    private, public = base / "home", base / "opt"
    (private / "lib").mkdir(parents=True)
    (public / "lib").mkdir(parents=True)
    for folder in (base, private / "lib", public, public / "lib"):
        folder.chmod(0o755)
    private.chmod(0o700)  # root's home

    assert unreadable_by(STRANGER, [private / "lib", public / "lib"]) == [private / "lib"]


def test_a_folder_its_owner_or_group_may_read_is_readable(base: Path) -> None:
    folder = base / "lib"
    folder.mkdir()
    info = folder.stat()
    folder.chmod(0o750)
    assert unreadable_by(STRANGER, [folder]) == [folder]
    assert unreadable_by(EngineUser("group", 54321, info.st_gid), [folder]) == []
    folder.chmod(0o700)
    assert unreadable_by(EngineUser("owner", info.st_uid, 54321), [folder]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_a_kernel_compiled_after_the_drop_has_writable_caches() -> None:
    """Triton fixes its default cache folder (root's ``~/.triton``) when imported, and torch's inductor writes
    its cache folders into the environment when first used (``/tmp/torchinductor_root``, and
    ``TRITON_CACHE_DIR`` under it per device), both maybe before the drop: the engine user must still be
    able to create what a new kernel writes, or it kills the engine (seen on the H100 and on 2x H200)."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import os, triton.knobs
        from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
        from nnqueue.isolation import drop_privileges, engine_user
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(1)  # what inductor's autotuner does, as root
        assert drop_privileges(engine_user("nobody"))
        for folder in (os.path.join(triton.knobs.cache.dir, "kernel"), os.path.join(cache_dir(), "kernel")):
            os.makedirs(folder)
            print(folder)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for folder in done.stdout.split():
        assert not folder.startswith((os.path.expanduser("~"), "/tmp/torchinductor_root")), folder
