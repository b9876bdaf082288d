"""How pytest-xdist shares the suite between its processes: a module at a time, and the modules marked
``shared_worker`` as one unit.

A module's tests stay in one process, so its module-scoped workers and stacks start once. The marked modules
all run in the process that takes them first, where the session's shared workers then start once (a second
process would start its own: another 40 s of two cores). Units go out in collection order (tests/conftest.py puts
the marked unit first, then the modules marked ``slow``), so each process runs a subsequence of the collected items:
the early release of session fixtures after their last module (tests/conftest.py) stays right in every process.

xdist's controller collects nothing: it sees node ids only, so it reads the mark from the module's source
(``pytestmark = pytest.mark.shared_worker``, or a list holding it), and the collection in each process checks that
this reading agrees with pytest's (:func:`declared_shared`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

SHARED_UNIT = "shared_worker modules"
_MARK = re.compile(r"^pytestmark = .*\bpytest\.mark\.shared_worker\b", re.MULTILINE)


@functools.cache
def declared_shared(module: Path) -> bool:
    """Whether the module's source marks it ``shared_worker`` at module level."""
    return _MARK.search(module.read_text()) is not None


class ModuleScheduling(LoadScopeScheduling):
    """LoadScopeScheduling by module, the marked modules as one unit, in collection order."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self.root: Path = config.rootpath
        # xdist otherwise sends the modules with the most tests first, out of the order the release relies on.
        config.option.loadscopereorder = False

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return SHARED_UNIT if declared_shared(self.root / module) else module
