"""The subreaper reads only its main thread's children: the kernel gives every orphan to it,
whichever thread started the orphan's parent."""

from __future__ import annotations

import os
import signal
import subprocess
import threading

from ray_sandbox.runtime import _subreaper


def test_an_orphan_made_from_another_thread_is_among_the_children():
    _subreaper.ensure()
    out: list[str] = []

    def spawn() -> None:  # sh starts a sleep and exits at once: the sleep is orphaned
        out.append(subprocess.run(["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"],
                                  capture_output=True, text=True, check=True).stdout)

    t = threading.Thread(target=spawn)
    t.start()
    t.join()
    orphan = int(out[0])
    try:
        assert orphan in _subreaper._children()
    finally:
        os.kill(orphan, signal.SIGKILL)
        os.waitpid(orphan, 0)  # ours now; a zombie left would keep the subreaper scanning
