import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/zoo.py
torch.set_num_threads(int(os.environ.get("DIAG_TEST_THREADS", "1")))
