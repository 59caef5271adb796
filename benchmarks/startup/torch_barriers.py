"""The anchor: torchrun + Gloo init + 10 barriers, the same job as paratrain.examples.barriers."""

import torch.distributed as dist

dist.init_process_group("gloo")
for _ in range(10):
    dist.barrier()
dist.destroy_process_group()
