"""One training job of the parallel-strategy and planner recordings (issues #14 and #15), run under
`snaplab run`, one process per GPU:

    python3 -m snapshot_lab run --out RAW --max-entries 1000000 train_parallel.py --strategy single ...
    torchrun --nproc_per_node 2 -m snapshot_lab run --out RAW --max-entries 1000000 \\
        train_parallel.py --strategy fsdp2 --reshard 1 --model transformer --name fsdp2_reshard_transformer \\
        --final-dir OUT

Two models, built from a config so that every strategy can cut them the same way:

- ``transformer``: a GPT-style decoder written here (``GPT`` below, not transformers' GPT-2):
  token + learned position embeddings, 8 pre-norm blocks (LayerNorm, attention with separate
  q/k/v/o Linear layers and scaled_dot_product_attention, causal; LayerNorm, Linear-GELU-Linear),
  a final LayerNorm and an untied Linear head; fp32; cross-entropy loss;
- ``mlp``: 8 x (Linear(2048, 2048) + GELU), loss ``out.pow(2).mean()``.

Strategies (world size 2 except ``single``): ``single`` (one GPU), ``ddp``
(``--bucket-view``), ``fsdp2`` (``fully_shard`` per block + root, ``--reshard``), ``fsdp1``
(``FullyShardedDataParallel`` wrapping each block, ``--sharding``), ``tp`` (DTensor:
``parallelize_module`` with Colwise/Rowwise pairs on attention and MLP; embeddings, norms and the
head replicated as DTensors) and ``pp`` (``torch.distributed.pipelining``, 2 stages, ``--schedule
gpipe|1f1b`` over ``--microbatches``). AdamW, 3 steps; the snapshot is dumped (through the
active ``snaplab run`` recording) after the last ``opt.step()``, before ``zero_grad()``, then
xz-compressed into ``--final-dir`` as ``<name>[_rank<R>].pickle.xz`` with its sidecar
``.meta.json`` and a ``.truth.json`` (the sidecar's ``memory_stats`` and the workload's facts).

``SNAPLAB_DRY=1``: CPU + gloo, small sizes, no recording; prints the facts and the parallel
layout that the sidecar would record.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import snapshot_lab.capture as capture
except ImportError:  # snaplab's analysis dependencies missing: capture itself needs none of them
    import types

    _pkg = types.ModuleType("snapshot_lab")
    _pkg.__path__ = [str(Path(__file__).resolve().parents[2] / "snapshot_lab")]
    sys.modules["snapshot_lab"] = _pkg
    import snapshot_lab.capture as capture

DRY = bool(os.environ.get("SNAPLAB_DRY"))
DEV = "cpu" if DRY else "cuda"
ONE_GPU = bool(os.environ.get("SNAPLAB_ONE_GPU"))
STEPS = 3


@dataclass
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    d_model: int = 768
    n_layer: int = 8
    n_head: int = 12
    d_ff: int = 3072


@dataclass
class MLPConfig:
    width: int = 2048
    depth: int = 8


GPT_CFG = GPTConfig(vocab_size=512, seq_len=32, d_model=64, n_layer=8, n_head=4, d_ff=256) if DRY else GPTConfig()
MLP_CFG = MLPConfig(width=128) if DRY else MLPConfig()
# the batch of each rank (data-parallel ranks each take this many; TP and PP ranks share one)
BATCH = {"transformer": 16, "mlp": 256 if DRY else 4096}


# --------------------------------------------------------------------------- models


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_head
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # -1 heads: under tensor parallelism each rank holds n_head / tp of them
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder from a config. Pipeline stages delete what they do not run (the
    embeddings, other stages' blocks, the final norm and head): forward skips what is None."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb: nn.Module | None = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.d_model)
        self.head: nn.Module | None = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.tp_mesh: Any = None  # set under tensor parallelism: inputs become replicated DTensors

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None and self.pos_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            if self.tp_mesh is not None:
                from torch.distributed.tensor import DTensor, Replicate

                x, pos = (DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False) for t in (x, pos))
            x = self.tok_emb(x) + self.pos_emb(pos)
        for blk in self.layers.values():
            x = blk(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.head is not None:
            x = self.head(x)
        return x.to_local() if hasattr(x, "to_local") else x


class MLPBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLPStack(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): MLPBlock(cfg.width) for i in range(cfg.depth)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.layers.values():
            x = blk(x)
        return x.to_local() if hasattr(x, "to_local") else x


def build(model: str) -> nn.Module:
    torch.manual_seed(0)  # every rank builds the same weights
    return GPT(GPT_CFG) if model == "transformer" else MLPStack(MLP_CFG)


def block_class(model: str) -> type[nn.Module]:
    return Block if model == "transformer" else MLPBlock


def make_batch(model: str, step: int, seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + seed)
    if model == "transformer":
        ids = torch.randint(0, GPT_CFG.vocab_size, (batch, GPT_CFG.seq_len), generator=g)
        tgt = torch.randint(0, GPT_CFG.vocab_size, (batch, GPT_CFG.seq_len), generator=g)
        return ids.to(DEV), tgt.to(DEV)
    return torch.randn(batch, MLP_CFG.width, generator=g).to(DEV), torch.zeros(batch, 1).to(DEV)


def loss_fn(model: str):
    if model == "transformer":
        return lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten())
    return lambda out, tgt: out.pow(2).mean()


# --------------------------------------------------------------------------- facts


def _local(t: torch.Tensor) -> torch.Tensor:
    inner = getattr(t, "_local_tensor", None)  # DTensor
    if inner is not None:
        return inner
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(ts) -> int:
    """Bytes of the distinct storages behind these tensors (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in ts:
        if t is None:
            continue
        st = _local(t).untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


def numel_bytes(ts) -> int:
    return sum(_local(t).numel() * t.element_size() for t in ts if t is not None)


def full_param_facts(model: nn.Module) -> dict[str, Any]:
    params = list(model.parameters())
    return {
        "param_bytes_total": sum(p.numel() * p.element_size() for p in params),
        "param_count_total": sum(p.numel() for p in params),
        "param_tensors_total": len(params),
    }


def local_facts(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    params = list(model.parameters())
    state = [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t) and _local(t).device.type == DEV]
    return {
        "param_bytes_local": numel_bytes(params),  # this rank's parameters as stored, no padding
        "param_storage_bytes_local": storage_bytes(params),  # with FSDP's padding
        "param_tensors_local": len(params),
        "grad_bytes_local": numel_bytes([p.grad for p in params]),
        "grad_storage_bytes_local": storage_bytes([p.grad for p in params]),
        "optimizer_state_bytes": storage_bytes(state),  # exp_avg + exp_avg_sq on the GPU (step is on the CPU)
        "optimizer": type(opt).__name__,
    }


def fsdp2_units(model: nn.Module, world: int) -> list[dict[str, Any]]:
    units = []
    for name, mod in model.named_modules():
        if not hasattr(mod, "_get_fsdp_state"):
            continue
        group = getattr(mod._get_fsdp_state(), "_fsdp_param_group", None)
        fparams = list(getattr(group, "fsdp_params", []) or [])
        full = sharded = padded = 0
        names = []
        for fp in fparams:
            elem = fp.sharded_param.element_size()
            full += math.prod(fp._orig_size) * elem
            sharded += math.prod(fp.sharded_size) * elem
            padded += math.prod(fp.padded_sharded_param_size) * elem
            names.append(getattr(fp, "_param_fqn", None))
        units.append(
            {
                "module": name or "<root>",
                "params": len(fparams),
                "param_names": names,
                "full_bytes": full,
                "unsharded_bytes": full,  # the unit's parameters once all-gathered
                "sharded_bytes": sharded,  # this rank's shard, as the DTensor sees it
                "sharded_padded_bytes": padded,  # the shard as stored (padded to divide by the world)
                "allgather_output_bytes": padded * world,  # the flat buffer one all-gather produces
                "reshard_after_forward": getattr(group, "post_forward_mesh_info", None) is not None,
            }
        )
    return units


def fsdp1_units(model: nn.Module) -> list[dict[str, Any]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, mod in model.named_modules():
        if not isinstance(mod, FSDP):
            continue
        fp = mod._flat_param
        if fp is None:
            units.append({"module": name, "params": 0})
            continue
        elem = fp.element_size()
        clean = name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
        units.append(
            {
                "module": clean or "<root>",
                "params": len(fp._fqns),
                "param_names": list(fp._fqns),
                "full_bytes": sum(fp._numels) * elem,  # the original parameters
                "unsharded_bytes": math.prod(fp._unpadded_unsharded_size) * elem,  # the flat parameter, gathered
                "allgather_output_bytes": math.prod(fp._padded_unsharded_size) * elem,  # padded to divide by the world
                "sharded_bytes": math.prod(fp._sharded_size) * elem,  # this rank's flat shard (padded)
            }
        )
    return units


def tp_param_facts(model: nn.Module) -> dict[str, Any]:
    sharded, replicated = [], []
    for name, p in model.named_parameters():
        placements = list(getattr(p, "placements", []))
        row = {
            "name": name,
            "full_bytes": p.numel() * p.element_size(),
            "local_bytes": _local(p).numel() * p.element_size(),
            "placements": [repr(pl) for pl in placements],
        }
        (sharded if any(pl.is_shard() for pl in placements) else replicated).append(row)
    return {
        "tp_sharded_params": sharded,
        "tp_replicated_params": replicated,
        "tp_sharded_full_bytes": sum(r["full_bytes"] for r in sharded),
        "tp_sharded_local_bytes": sum(r["local_bytes"] for r in sharded),
        "tp_replicated_bytes": sum(r["local_bytes"] for r in replicated),
    }


def safely(fn, *args):
    """A fact that cannot be computed (a private attribute renamed in another torch) is recorded
    as an error: the snapshot itself matters more."""
    try:
        return fn(*args)
    except Exception as exc:
        print(f"fact {fn.__name__} failed: {exc!r}", file=sys.stderr, flush=True)
        return {f"{fn.__name__}_error": repr(exc)}


# --------------------------------------------------------------------------- strategies


def wrap_ddp(model: nn.Module, bucket_view: bool) -> nn.Module:
    model.to(DEV)
    ids = [torch.cuda.current_device()] if DEV == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=bucket_view)


def wrap_fsdp2(model: nn.Module, reshard: bool, world: int, prefetch: int = 0) -> nn.Module:
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # before 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    model.to(DEV)
    mesh = init_device_mesh(DEV, (world,))  # what fully_shard makes by itself; unnamed
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if prefetch:  # explicit prefetch: each unit gathers the next `prefetch` units ahead, both ways
        blocks = list(model.layers.values())
        for i, blk in enumerate(blocks):
            blk.set_modules_to_forward_prefetch(blocks[i + 1 : i + 1 + prefetch])
            blk.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch) : i][::-1])
    return model


def wrap_fsdp1(model: nn.Module, kind: str, sharding: str) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model.to(DEV)
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block_class(kind)}),
        sharding_strategy=ShardingStrategy[sharding],
        device_id=torch.cuda.current_device() if DEV == "cuda" else torch.device("cpu"),
        use_orig_params=False,
    )


def wrap_tp(model: nn.Module, kind: str, world: int, mesh: Any = None) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = mesh if mesh is not None else init_device_mesh(DEV, (world,), mesh_dim_names=("tp",))
    model.to(DEV)
    plan: dict[str, Any] = {}
    if kind == "transformer":
        for i in model.layers:
            # column-parallel outputs stay local for the attention and GELU; row-parallel outputs
            # come back replicated DTensors for the residual stream
            for p in ("q", "k", "v"):
                plan[f"layers.{i}.attn.{p}"] = ColwiseParallel()
            plan[f"layers.{i}.attn.o"] = RowwiseParallel(use_local_output=False)
            plan[f"layers.{i}.mlp.fc1"] = ColwiseParallel()
            plan[f"layers.{i}.mlp.fc2"] = RowwiseParallel(use_local_output=False)
    else:
        for i in model.layers:
            plan[f"layers.{i}.fc"] = ColwiseParallel() if int(i) % 2 == 0 else RowwiseParallel()
    parallelize_module(model, mesh, plan)
    # embeddings, norms and the head: replicated DTensors (one optimizer over DTensors only)
    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and not hasattr(p, "placements"):
                mod.register_parameter(key, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))
    if kind == "transformer":
        model.tp_mesh = mesh
    return model


def wrap_fsdp_tp(model: nn.Module, kind: str, world: int, reshard: bool) -> nn.Module:
    """FSDP2 over tensor parallelism on a 2-D mesh: TP of degree 2 within each pair of ranks
    (the blocks as in ``wrap_tp``), then ``fully_shard`` of each block and the root across the
    pairs (issue #24's FSDP+TP 2x2 on four GPUs)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # before 2.6
        from torch.distributed._composable.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEV, (world // 2, 2), mesh_dim_names=("dp", "tp"))
    model = wrap_tp(model, kind, 2, mesh=mesh["tp"])
    for blk in model.layers.values():
        fully_shard(blk, mesh=mesh["dp"], reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard)
    return model


def split_stage(model: nn.Module, stage: int, num_stages: int) -> list[str]:
    """Keep this stage's blocks (and the embeddings on the first, norm + head on the last)."""
    n = len(model.layers)
    per = n // num_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per if stage < num_stages - 1 else n)}
    for key in list(model.layers.keys()):
        if key not in keep:
            del model.layers[key]
    if isinstance(model, GPT):
        if stage != 0:
            model.tok_emb = model.pos_emb = None
        if stage != num_stages - 1:
            model.ln_f = model.head = None
    return [name for name, mod in model.named_children() if mod is not None and name != "layers"] + [
        f"layers.{k}" for k in model.layers
    ]


# --------------------------------------------------------------------------- dump


def dump(name: str, facts: dict[str, Any], final_dir: Path) -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()
    rec = capture.active()
    if rec is None:
        if not DRY:
            raise RuntimeError("run me under `snaplab run` (python -m snapshot_lab run ...)")
        layout = capture.parallel_layout()
        print(f"[{name}] dry run: facts {json.dumps(facts, default=str)[:1500]}", flush=True)
        print(f"[{name}] dry run: parallel {json.dumps(layout, default=str)}", flush=True)
        final_dir.mkdir(parents=True, exist_ok=True)
        (final_dir / f"{name}.dry.json").write_text(
            json.dumps({"workload": facts, "parallel": layout}, indent=1, default=str)
        )
        return
    raw = rec.dump("final")
    rec.dump_on_exit = False  # this is the snapshot wanted: no second one when the script ends
    if raw is None:
        raise RuntimeError("snaplab could not dump the snapshot (see the log above)")
    meta_path = raw.with_name(raw.name[: -len(".pickle")] + capture.SIDECAR_SUFFIX)
    meta = json.loads(meta_path.read_text())
    final_dir.mkdir(parents=True, exist_ok=True)
    with raw.open("rb") as src, lzma.open(final_dir / f"{name}.pickle.xz", "wb", preset=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    shutil.copyfile(meta_path, final_dir / f"{name}.meta.json")
    dev = str(torch.cuda.current_device())
    stats = meta.get("memory_stats", {})
    facts["peak_allocated_bytes"] = stats.get(dev, {}).get("allocated_bytes.all.peak")
    facts["peak_reserved_bytes"] = stats.get(dev, {}).get("reserved_bytes.all.peak")
    truth = {
        "name": name,
        "torch_version": torch.__version__,
        "device_names": {d: torch.cuda.get_device_name(int(d)) for d in stats},
        "device_total_bytes": meta.get("device_total_bytes", {}),
        "alloc_conf": meta.get("alloc_conf", ""),
        "hostname": socket.gethostname(),
        "dumped_at_unix_s": meta.get("time_unix_s"),
        "memory_stats": stats,  # the sidecar's, taken right before the snapshot
        "capture": {
            "sidecar": f"{name}.meta.json",
            "raw_name": raw.name,
            "reason": meta.get("reason"),
            "parallel": meta.get("parallel"),
        },
        "workload": facts,
    }
    (final_dir / f"{name}.truth.json").write_text(json.dumps(truth, indent=1, sort_keys=True, default=str))
    raw.unlink()  # the compressed copy is what we keep
    print(f"[{name}] dumped {final_dir / name}.pickle.xz", flush=True)


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["transformer", "mlp"], default="transformer")
    ap.add_argument(
        "--strategy", choices=["single", "ddp", "zero1", "fsdp2", "fsdp1", "tp", "fsdp_tp", "pp"], required=True
    )
    ap.add_argument("--bucket-view", type=int, default=0)
    ap.add_argument("--reshard", type=int, default=1)
    ap.add_argument("--sharding", choices=["FULL_SHARD", "SHARD_GRAD_OP"], default="FULL_SHARD")
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--prefetch", type=int, default=0, help="fsdp2: units prefetched ahead (explicit)")
    ap.add_argument("--batch", type=int, default=0, help="per-rank batch (default: the model's)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--final-dir", default="parallel_out")
    a = ap.parse_args()
    t0 = time.time()

    rank, world = 0, 1
    if a.strategy != "single":
        if DEV == "cuda":
            # SNAPLAB_ONE_GPU=1: every rank on GPU 0 over gloo (world sizes above the GPUs lent)
            torch.cuda.set_device(0 if ONE_GPU else int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if DEV == "cuda" and not ONE_GPU else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    elif DEV == "cuda":
        torch.cuda.set_device(0)
    name = a.name if a.strategy == "single" else f"{a.name}_rank{rank}"
    batch = a.batch or BATCH[a.model]
    model = build(a.model)
    facts: dict[str, Any] = {
        "kind": f"parallel-{a.strategy}",
        "strategy": a.strategy,
        "model": a.model,
        "model_class": type(model).__name__,
        "model_source": "own config-driven classes in sample_snapshots/jobs/train_parallel.py (not transformers)",
        "model_config": asdict(GPT_CFG if a.model == "transformer" else MLP_CFG),
        "dtype": "float32",
        "world_size": world,
        "rank": rank,
        "ranks_share_one_gpu_over_gloo": ONE_GPU,
        "per_rank_batch": batch,
        "seq_len": GPT_CFG.seq_len if a.model == "transformer" else None,
        "steps_done": a.steps,
        "stacks": "python",
        "recorded_through": "snaplab run (snapshot_lab.capture), recording started before the model was built",
        "dumped": "after the last opt.step(), before zero_grad()",
        "dry_run": DRY,
        **full_param_facts(model),
    }
    seed = rank  # data-parallel ranks see different data; TP and PP ranks the same
    stage_info: dict[str, Any] = {}
    schedule = None
    if a.strategy == "single":
        run = model.to(DEV)
        facts["global_batch"] = batch
    elif a.strategy in ("ddp", "zero1"):
        run = wrap_ddp(model, bool(a.bucket_view))
        facts.update(
            gradient_as_bucket_view=bool(a.bucket_view),
            bucket_cap_mb=25,
            global_batch=batch * world,
            expect={"ddp_duplicate_grads": not a.bucket_view},
        )
    elif a.strategy == "fsdp2":
        run = wrap_fsdp2(model, bool(a.reshard), world, a.prefetch)
        facts.update(
            explicit_prefetch_units=a.prefetch,
            reshard_after_forward=bool(a.reshard),
            fsdp_version=2,
            global_batch=batch * world,
            fsdp_wrapping="fully_shard on each block, then on the root (embeddings, final norm, head)",
        )
    elif a.strategy == "fsdp1":
        run = wrap_fsdp1(model, a.model, a.sharding)
        facts.update(
            sharding_strategy=a.sharding,
            fsdp_version=1,
            use_orig_params=False,
            global_batch=batch * world,
            fsdp_wrapping=f"ModuleWrapPolicy({{{block_class(a.model).__name__}}}) + the root",
        )
    elif a.strategy == "tp":
        run = wrap_tp(model, a.model, world)
        seed = 0
        facts.update(tp_degree=world, global_batch=batch, mesh_dim_names=["tp"])
    elif a.strategy == "fsdp_tp":
        run = wrap_fsdp_tp(model, a.model, world, bool(a.reshard))
        seed = rank // 2  # the two ranks of a TP pair see the same data
        capture.describe_parallel(fsdp=world // 2, tp=2, coordinates={"fsdp": rank // 2, "tp": rank % 2})
        facts.update(
            tp_degree=2,
            fsdp_degree=world // 2,
            reshard_after_forward=bool(a.reshard),
            fsdp_version=2,
            global_batch=batch * (world // 2),
            mesh_dim_names=["dp", "tp"],
        )
    else:  # pp
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        seed = 0
        layers = split_stage(model, rank, world)
        model.to(DEV)
        stage = PipelineStage(
            model, rank, world, torch.device(DEV, torch.cuda.current_device()) if DEV == "cuda" else torch.device("cpu")
        )
        cls = ScheduleGPipe if a.schedule == "gpipe" else Schedule1F1B
        schedule = cls(stage, n_microbatches=a.microbatches, loss_fn=loss_fn(a.model))
        capture.describe_parallel(
            pp_stage=rank,
            pp_degree=world,
            schedule="GPipe" if a.schedule == "gpipe" else "1F1B",
            microbatches=a.microbatches,
        )
        run = model
        inflight = a.microbatches if a.schedule == "gpipe" else world - rank
        stage_info = {
            "pp_stage": rank,
            "pp_num_stages": world,
            "pp_stage_modules": layers,
            "pp_stage_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "schedule": "GPipe" if a.schedule == "gpipe" else "1F1B",
            "schedule_class": cls.__name__,
            "microbatches": a.microbatches,
            "microbatch_size": batch // a.microbatches,
            "global_batch": batch,
            "expect": {"max_microbatches_in_flight": inflight},
        }
        facts.update(stage_info)
    if a.strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(run.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        facts.update(optimizer_sharding="ZeroRedundancyOptimizer(AdamW)")
    else:
        opt = torch.optim.AdamW(run.parameters(), lr=1e-4)
    lf = loss_fn(a.model)
    for step in range(1, a.steps + 1):
        x, tgt = make_batch(a.model, step, seed, batch)
        if schedule is not None:
            if rank == 0:
                schedule.step(x)
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=tgt, losses=losses)
        else:
            lf(run(x), tgt).backward()
        del x, tgt
        opt.step()
        capture.step()
        if step == a.steps:
            facts.update(safely(local_facts, run, opt))
            if a.strategy == "fsdp2":
                facts["fsdp_units"] = safely(fsdp2_units, run, world)
            elif a.strategy == "fsdp1":
                facts["fsdp_units"] = safely(fsdp1_units, run)
            elif a.strategy == "tp":
                facts.update(safely(tp_param_facts, run))
            facts["train_seconds"] = round(time.time() - t0, 2)
            dump(name, facts, Path(a.final_dir))
        else:
            opt.zero_grad(set_to_none=True)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print(f"[{name}] done in {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
