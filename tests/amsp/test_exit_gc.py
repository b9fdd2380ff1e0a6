"""amsp/exit_gc.py: at exit, cyclic garbage is still finalized, then what is left is frozen, so shutdown's
collections have nothing to walk."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import atexit, gc
# Registered before the hook, so it runs after it (exit handlers run last-registered first).
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
from amsp.exit_gc import skip_shutdown_gc_passes
skip_shutdown_gc_passes()

class Cycle:
    def __del__(self):
        print("cycle finalized")

c = Cycle()
c.me = c
del c
gc.disable()  # no automatic collection reaches the cycle before exit: only the hook's
print("main done")
"""


def test_cyclic_garbage_is_finalized_before_the_heap_is_frozen():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    # Freezing first would have put the cycle where shutdown never collects it: no "cycle finalized" line.
    assert out.splitlines() == ["main done", "cycle finalized", "frozen at exit: True"], out
