"""Peak resident-memory growth of a block of code, for the bench scripts (imported by them; prints nothing)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import threading
import time


def rss_mb() -> float:
    """This process's resident set size in MiB: pages in /proc/self/statm x the page size / 2^20."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def hwm_mb() -> float:
    """This process's peak resident set size in MiB since it started or since `reset_hwm()` (the kernel's VmHWM
    of /proc/self/status: exact, however short the peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def reset_hwm() -> bool:
    """Set this process's VmHWM to its current RSS (writing "5" to /proc/self/clear_refs, Linux 4.0+); False where
    that is not allowed (then only the sampled peak is known)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def trim() -> bool:
    """Collect Python's garbage and hand the C heap's free pages back to the kernel (glibc `malloc_trim(0)`), so
    that RSS counts live memory only; False where there is no glibc."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


class PeakRSS:
    """Context manager: `growth` = peak RSS over the block - RSS at its start, taken after `trim()` (else pages
    freed before the block but still resident would absorb its allocations unseen, a different amount each run).
    The peak is the kernel's high-water mark (VmHWM, reset on entry: every page resident at any instant counts,
    however briefly) where the kernel lets it be reset, else the max of samples every 2 ms (and at the block's
    end), which misses peaks shorter than a sampling interval or unsampled while the machine is busy; `sampled` =
    that sampled growth in either case, `exact` = whether the high-water mark was used."""

    def __enter__(self):
        trim()
        self.exact = reset_hwm()
        self.base = self.peak = self._sampled = rss_mb()
        self._stop = threading.Event()

        def watch():
            while not self._stop.is_set():
                self._sampled = max(self._sampled, rss_mb())
                time.sleep(0.002)
        self._t = threading.Thread(target=watch, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self._sampled = max(self._sampled, rss_mb())
        self.peak = max(self._sampled, hwm_mb()) if self.exact else self._sampled
        self.growth = self.peak - self.base
        self.sampled = self._sampled - self.base
