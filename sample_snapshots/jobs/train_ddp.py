"""DDP over NCCL, one process per GPU (capture test under torchrun); rank 1 gets a 3x batch,
so its memory stands out in `snaplab ranks`."""

import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import snapshot_lab.capture as capture

rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, n_positions=1024)).cuda()
ddp = torch.nn.parallel.DistributedDataParallel(
    model, device_ids=[torch.cuda.current_device()], gradient_as_bucket_view=True
)
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
batch = 24 if rank == 1 else 8
for _step in range(4):
    ids = torch.randint(0, 8192, (batch, 512), device="cuda")
    ddp(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    capture.step()
dist.barrier()
dist.destroy_process_group()
