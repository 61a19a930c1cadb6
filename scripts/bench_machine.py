"""What a benchmark table says about the machine it ran on, shared by the bench scripts.

Import it by path (the scripts keep their own folder off sys.path, because scripts/profile.py
would shadow the standard library's `profile`):

    spec = importlib.util.spec_from_file_location("bench_machine", HERE / "bench_machine.py")
"""

import os
import platform
import subprocess


def cpu_name():
    """The CPU's model name: lscpu first (it names AMD parts that /proc/cpuinfo leaves generic
    inside some VMs), then /proc/cpuinfo, then what Python knows."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.strip().lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg():
    """The 1, 5 and 15 minute load averages (NaN where the system does not say)."""
    try:
        return list(os.getloadavg())
    except OSError:
        return [float("nan")] * 3
