"""torch.distributed plumbing: process groups, the device mesh and one module per parallelism."""
