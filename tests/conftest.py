import os
import sys

import pytest
import torch

# Every distributed test (spawned ranks and train.py subprocesses alike) runs under amsp/routing_check.py.
os.environ.setdefault("AMSP_CHECK_ROUTING", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
