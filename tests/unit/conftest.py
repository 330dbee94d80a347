"""Unit tests use tiny models: one thread avoids OpenMP oversubscription on small matmuls."""

import torch

torch.set_num_threads(1)
