"""Peak resident-memory growth of a block of code, for the bench scripts (imported by them; prints nothing)."""

from __future__ import annotations

import os
import threading
import time


def rss_mb() -> float:
    """This process's resident set size in MiB: pages in /proc/self/statm x the page size / 2^20."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakRSS:
    """Context manager: `growth` = max RSS sampled every 2 ms over the block (and at its end) - RSS at its start."""

    def __enter__(self):
        self.base = self.peak = rss_mb()
        self._stop = threading.Event()

        def watch():
            while not self._stop.is_set():
                self.peak = max(self.peak, rss_mb())
                time.sleep(0.002)
        self._t = threading.Thread(target=watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_mb())
        self.growth = self.peak - self.base
