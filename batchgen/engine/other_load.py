"""How many of this process's CPUs other processes keep busy, read from Linux's /proc/stat.

The thread tuner's trials find a busy core only on steps small enough to trial, and only when
a trial is due; a prefill-heavy job on a busy machine may run for minutes before one is. The
OS counts every CPU's busy time, so the cores others take can be read directly: each CPU's busy
time (user, nice, system, irq, softirq and steal: a VM's vCPU taken by the host is as busy for
us) summed over the CPUs this process may run on, less this process's own CPU time.

Invariants:
- `OtherLoad.open()` is None where /proc/stat cannot be read (not Linux): callers then go on
  without it.
- `busy_cores()` answers only once `WINDOW_S` seconds have passed since its last answer or
  `restart()` (the counters tick every 10 ms), else None; an answer covers exactly that
  interval.
"""

from __future__ import annotations

import os
import time

STAT_PATH = "/proc/stat"
WINDOW_S = 0.5  # seconds a reading covers at least
BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user, nice, system, irq, softirq, steal (idle 3 and iowait 4 are not busy)


class OtherLoad:
    def __init__(self, cpus: set[int], first_sample: tuple[float, float]):
        self.num_cpus = len(cpus)
        self._names = {f"cpu{cpu}" for cpu in cpus}
        self._last = first_sample

    @classmethod
    def open(cls) -> OtherLoad | None:
        """A reader for the CPUs this process may run on, or None where /proc/stat is unreadable."""
        try:
            cpus = os.sched_getaffinity(0)
        except AttributeError:  # not Linux
            return None
        first_sample = _sample({f"cpu{cpu}" for cpu in cpus})
        return None if first_sample is None else cls(cpus, first_sample)

    def restart(self) -> None:
        """Leave out the time since the last answer: the next covers only what comes after."""
        self._last = _sample(self._names) or self._last

    def busy_cores(self) -> float | None:
        """The cores other processes kept busy since the last answer (0 on a quiet machine, 1.0
        for one process spinning a core), once `WINDOW_S` has passed; else None."""
        if time.monotonic() - self._last[0] < WINDOW_S:
            return None
        sample = _sample(self._names)
        if sample is None:
            return None
        (last_wall, last_others), self._last = self._last, sample
        return max(0.0, (sample[1] - last_others) / (sample[0] - last_wall))


def _sample(names: set[str]) -> tuple[float, float] | None:
    """(wall seconds, the busy seconds of the CPUs `names` less this process's CPU seconds), or
    None where /proc/stat cannot be read or parsed."""
    wall, own = time.monotonic(), time.process_time()
    busy_ticks = 0
    try:
        with open(STAT_PATH) as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in names:
                    values = [int(value) for value in fields[1:]]
                    busy_ticks += sum(values[i] for i in BUSY_FIELDS if i < len(values))
    except (OSError, ValueError):
        return None
    return wall, busy_ticks / os.sysconf("SC_CLK_TCK") - own
