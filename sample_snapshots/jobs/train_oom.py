"""A job that runs out of memory (capture test): keeps activations until a 2 GiB cap is hit."""

import torch

total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(2 * 2**30 / total)
model = torch.nn.Linear(4096, 4096).cuda()
kept = []
for _i in range(1000):
    x = torch.randn(2048, 4096, device="cuda")
    kept.append(model(x))  # never freed: grows until the cap
