"""What the machine was doing around a measurement: CPUs and load average (other users show up there)."""

from __future__ import annotations

import os
import platform


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
            "platform": platform.platform(), "python": platform.python_version()}
