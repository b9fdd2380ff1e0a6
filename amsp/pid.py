"""Whether a process id is alive on this host (torch-free: the preprocessing CLI uses it too)."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True when a process `pid` exists here, whoever owns it (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
