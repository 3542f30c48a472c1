"""A user's script that runs out of memory (issue #12, section 4): four Linear(4096, 4096)
layers with Adam, the batch doubled every step, under a 3 GiB per-process cap. Run under
`snaplab run`, it leaves an `_oom` snapshot (from the observer, at the failing request) and an
`_exception` one (after the stack unwound) of the same incident."""

import torch

total = torch.cuda.get_device_properties(0).total_memory
torch.cuda.set_per_process_memory_fraction(3 * 2**30 / total)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
batch = 256
for step in range(1, 30):
    x = torch.randn(batch, 4096, device="cuda")
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}: batch {batch} ok", flush=True)
    batch *= 2
