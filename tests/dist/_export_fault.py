"""``python tests/dist/_export_fault.py ARGS``: ``python -m qckpt ARGS`` in which the rank named
by ``FAULT_RANK`` dies (``os._exit(9)``, as a SIGKILL would leave it: no cleanup) right after
its first shard tensor write, having noted the time in ``FAULT_MARK``. The product has no such
hook; this wrapper patches the shard writer of its own process only."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if os.environ.get("RANK") == os.environ.get("FAULT_RANK"):
    from qckpt.storage import shards as safetensors_io

    _real = safetensors_io.ShardFile.write
    # several writer threads may finish a tensor at once: the first one notes the time and
    # dies holding the lock (a second writer truncating the mark could leave it empty)
    _dying = threading.Lock()

    def _write_then_die(self, name, t):  # noqa: ANN001, ANN202
        n = _real(self, name, t)
        with _dying:
            Path(os.environ["FAULT_MARK"]).write_text(repr(time.time()))
            os._exit(9)
        return n

    safetensors_io.ShardFile.write = _write_then_die

sys.argv = ["qckpt", *sys.argv[1:]]
runpy.run_module("qckpt", run_name="__main__", alter_sys=True)
