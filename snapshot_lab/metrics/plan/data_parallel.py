"""Data parallelism, replicated or sharded: DDP, ZeRO-1, FSDP2 (``fully_shard``) and FSDP1
(``FullyShardedDataParallel``). Every rank runs the recorded per-rank batch, so activations
stay as recorded; what changes is the model state and the communication buffers.

- DDP (``torch.nn.parallel.DistributedDataParallel``): when it wraps the model it broadcasts
  the parameters from rank 0 through flat temporaries of up to 250 MiB and allocates one bucket
  holding every parameter's gradient (the first iteration uses a single bucket); at the second
  iteration's forward it frees it and allocates the rebuilt buckets, filled in the order
  gradients became ready (the parameters reversed), the first closed at 1 MiB, the others at
  ``bucket_cap_mb``. Without ``gradient_as_bucket_view`` the gradients stay as recorded beside
  the buckets; with it they are views into the buckets, so the tensor the backward made is
  freed as soon as it is copied in.
- ZeRO-1 (``ZeroRedundancyOptimizer`` over DDP): DDP, with the optimizer state divided by the
  number of ranks.
- FSDP2: each block is a unit, the root (embeddings, final norm, head) one more. Parameters are
  sharded where the model is wrapped (each rank keeps 1/N of every parameter), optimizer state
  is 1/N. Before a unit's forward its shards are all-gathered into one flat buffer (on the
  all-gather stream) and copied out into unsharded parameters; the buffer lives until the next
  unit's all-gather is copied out. After the forward the unsharded parameters are freed
  (``reshard_after_forward``; the root never reshards after forward). In backward a unit is
  gathered again if needed and the next one in backward order is prefetched; after a unit's
  backward its unsharded parameters are freed, its gradients are copied into a flat
  reduce-scatter input (freed after the next unit's reduce-scatter) and freed, and its sharded
  gradient (1/N, on the reduce-scatter stream) lives as long as the recorded gradients did.
- FSDP1 (``use_orig_params=False``): one flat parameter per unit, all-gathered directly into a
  padded flat buffer (no separate all-gather buffer), on the unshard stream; backward prefetches
  the next unit (``BACKWARD_PRE``); after a unit's backward its gradients are flattened into a
  padded buffer, reduce-scattered into the sharded gradient (post-backward stream), and freed.
  ``FULL_SHARD`` frees the flat parameter after forward (not the root's), ``SHARD_GRAD_OP``
  keeps it until after backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..categories import CODES
from .rewrite import Rewrite
from .structure import Pass, TrainingStructure

MiB = 1 << 20
BROADCAST_BUCKET = 250 * MiB  # DDP's _sync_module_states coalescing limit
FIRST_BUCKET = 1 * MiB  # dist._DEFAULT_FIRST_BUCKET_BYTES
AG_STREAM = 1_000_001  # FSDP2 all-gather stream / FSDP1 unshard stream
RS_STREAM = 1_000_002  # FSDP2 reduce-scatter stream / FSDP1 post-backward stream


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- parameters


def untracked_sharded(categories: tuple[str, ...], world: int, label: str) -> Callable[[int, str], tuple[int, str]]:
    """How memory older than the trace is planned when the strategy shards ``categories``."""

    def scale(size: int, category: str) -> tuple[int, str]:
        if category in categories:
            return ceil_div(size, world), f"{category.replace('_', ' ')}, 1/{world} per rank ({label})"
        return size, f"{category.replace('_', ' ')}, as recorded"

    return scale


def param_rows(s: TrainingStructure) -> np.ndarray:
    return s.params["row"].to_numpy()


def shard_at_wrap(rw: Rewrite, local: np.ndarray, rule: str) -> None:
    """Where the model is wrapped: each parameter's local shard (``local[i]`` bytes, parameter
    order) is allocated and the recorded full parameter freed."""
    s = rw.structure
    rows = param_rows(s)
    for i, r in enumerate(rows.tolist()):
        if local[i] != rw.size[r]:
            if local[i] > 0:
                rw.alloc_at(
                    s.wrap_pos,
                    int(local[i]),
                    int(rw.stream[r]),
                    "parameter",
                    rule,
                    source_row=int(r),
                )
            rw.add(s.wrap_pos, ("f", int(r)))
            rw.free_after[r] = -1


def scale_rows(rw: Rewrite, rows: np.ndarray, factor: np.ndarray | float, category: str, rule: str) -> None:
    if rows.size == 0:
        return
    new = np.ceil(rw.size[rows] * factor).astype(np.int64)
    rw.set(rows, new, category, rule)


def optimizer_rows(s: TrainingStructure) -> np.ndarray:
    return np.flatnonzero(s.allocs["code"].to_numpy() == CODES["optimizer_state"])


def gradient_rows(s: TrainingStructure) -> np.ndarray:
    return np.flatnonzero(s.allocs["code"].to_numpy() == CODES["gradient"])


# --------------------------------------------------------------------------- DDP


def ddp_buckets(sizes: list[int], cap: int) -> list[int]:
    """Bucket sizes: tensors in the order their gradients become ready, a bucket closed once it
    reaches its limit (1 MiB for the first, ``cap`` after)."""
    out, cur, limit = [], 0, FIRST_BUCKET
    for n in sizes:
        cur += n
        if cur >= limit:
            out.append(cur)
            cur, limit = 0, cap
    if cur:
        out.append(cur)
    return out


def apply_ddp(rw: Rewrite, bucket_view: bool, bucket_cap_mb: float, local: np.ndarray, label: str = "DDP") -> None:
    s = rw.structure
    total = int(local.sum())
    if total == 0 or not s.passes:
        return
    wrap = s.wrap_pos
    stream = int(np.bincount(rw.stream[param_rows(s)].clip(min=0)).argmax()) if len(s.params) else 0
    # _sync_module_states: rank 0's parameters broadcast through flat temporaries
    group = 0
    for n in local.tolist():
        group += int(n)
        if group >= BROADCAST_BUCKET:
            k = rw.alloc_at(
                wrap,
                group,
                stream,
                "other",
                f"{label} wrapping: parameter broadcast (flat, temporary)",
            )
            rw.free_at(wrap, k)
            group = 0
    if group:
        k = rw.alloc_at(wrap, group, stream, "other", f"{label} wrapping: parameter broadcast (flat, temporary)")
        rw.free_at(wrap, k)
    first = rw.alloc_at(
        wrap,
        total,
        stream,
        "ddp_bucket",
        f"{label} bucket of the first iteration (every parameter's gradient)",
    )
    rebuilt = ddp_buckets([int(x) for x in local[::-1].tolist()], int(bucket_cap_mb * MiB))
    if len(s.passes) >= 2:
        at = s.passes[1].forward_start
        rw.free_at(at, first)
        for b in rebuilt:
            rw.alloc_at(at, b, stream, "ddp_bucket", f"{label} buckets, rebuilt at the second iteration")
    if bucket_view:
        grads = gradient_rows(s)
        pos = s.allocs["pos"].to_numpy()
        rw.free_after[grads] = pos[grads]
        rw.rule[grads] = "gradients: copied into the DDP buckets (gradient_as_bucket_view) and freed"


def apply_zero1(rw: Rewrite, world: int) -> None:
    rows = optimizer_rows(rw.structure)
    scale_rows(rw, rows, 1.0 / world, "optimizer_state", f"optimizer state, 1/{world} per rank (ZeRO-1)")


# --------------------------------------------------------------------------- FSDP


@dataclass(frozen=True)
class Unit:
    name: str  # "root" or "block 3"
    block: int  # -1: the root
    params: np.ndarray  # parameter indexes
    local: int  # bytes of its parameters on this rank before sharding (after tensor parallelism)
    shard: int  # this rank's shard of them
    gathered: int  # the all-gather output (shards x world)


def fsdp_units(s: TrainingStructure, local: np.ndarray, world: int, flat: bool) -> list[Unit]:
    block = s.params["block"].to_numpy()
    units = []
    root = np.flatnonzero(block < 0)
    ids = [("root", -1, root)] + [(f"block {j}", j, np.flatnonzero(block == j)) for j in range(s.n_blocks)]
    for name, b, idx in ids:
        if idx.size == 0:
            continue
        total = int(local[idx].sum())
        shard = ceil_div(total, world) if flat else sum(ceil_div(int(x), world) for x in local[idx].tolist())
        units.append(Unit(name, b, idx, total, shard, shard * world))
    return units


def apply_fsdp(
    rw: Rewrite,
    world: int,
    reshard_after_forward: bool,
    version: int,
    local: np.ndarray,
    label: str | None = None,
) -> list[Unit]:
    """Shard parameters, gradients and optimizer state over ``world`` ranks and add the
    all-gathers and reduce-scatters around every unit. ``local``: parameter bytes on this rank
    before sharding (tensor parallelism may have divided them already)."""
    s = rw.structure
    label = label or ("FSDP2" if version == 2 else "FSDP1")
    units = fsdp_units(s, local, world, flat=version == 1)
    if not units:
        return units
    if version == 1:
        _flatten_at_wrap(rw, units, world, label)
    else:
        shards = np.array([ceil_div(int(x), world) for x in local.tolist()], dtype=np.int64)
        shard_at_wrap(rw, shards, f"parameters, 1/{world} shard per rank ({label})")
    rows = optimizer_rows(s)
    ratio = param_ratio(s, local, s.allocs["param"].to_numpy()[rows]) / world
    rw.set(
        rows,
        np.ceil(s.allocs["size"].to_numpy()[rows] * ratio).astype(np.int64),
        "optimizer_state",
        f"optimizer state, 1/{world} per rank ({label})",
    )
    sharded_grads: dict[int, int] = {}  # unit -> where its sharded gradient is freed (-1: never)
    for p in s.passes:
        _FsdpPass(rw, p, units, local, world, reshard_after_forward, version == 1, label, sharded_grads).run()
    return units


def _flatten_at_wrap(rw: Rewrite, units: list[Unit], world: int, label: str) -> None:
    """FSDP1 wraps a unit by flattening its parameters into one flat tensor, copying this rank's
    shard out of it and freeing both the flat tensor and the original parameters."""
    s = rw.structure
    rows = param_rows(s)
    stream = int(rw.stream[rows[0]]) if rows.size else 0
    at = s.wrap_pos
    for u in units:
        flat = rw.alloc_at(
            at,
            u.local,
            stream,
            "parameter",
            f"{label} wrapping: a unit's parameters flattened (temporary)",
        )
        first = int(rows[u.params[0]])
        rw.alloc_at(
            at,
            u.shard,
            stream,
            "parameter",
            f"parameters, one flat 1/{world} shard per unit ({label})",
            source_row=first,
        )
        rw.free_at(at, flat)
        for i in u.params.tolist():
            rw.add(at, ("f", int(rows[i])))
            rw.free_after[rows[i]] = -1


def param_ratio(s: TrainingStructure, local: np.ndarray, param: np.ndarray) -> np.ndarray:
    """Per row mirroring parameter ``param``: that parameter's local share (after tensor
    parallelism), the average share for rows mirroring none."""
    p_size = s.params["size"].to_numpy()
    avg = float(local.sum()) / max(int(p_size.sum()), 1)
    out = np.full(param.size, avg)
    ok = param >= 0
    out[ok] = local[param[ok]] / np.maximum(p_size[param[ok]], 1)
    return out


class _FsdpPass:
    """The all-gathers and reduce-scatters of one pass, placed at the recorded moments of each
    unit's forward and backward."""

    def __init__(
        self,
        rw: Rewrite,
        p: Pass,
        units: list[Unit],
        local: np.ndarray,
        world: int,
        reshard: bool,
        flat: bool,
        label: str,
        sharded_grads: dict[int, int],
    ) -> None:
        self.rw, self.p, self.local, self.world = rw, p, local, world
        self.sharded_grads = sharded_grads
        self.reshard, self.flat, self.label = reshard, flat, label
        self.by_block = {u.block: u for u in units}
        self.unsharded: dict[int, list[int]] = {}  # unit -> keys of its unsharded parameters
        # unit -> all-gather buffer copied out, kept until the next one
        self.consumed: dict[int, int] = {}
        self.prefetched: dict[int, int] = {}  # unit -> all-gather buffer issued ahead
        self.rs_input: int | None = None
        self.grad_pending: list[int] = []
        self.rs_pending: list[int] = []
        self.flat_pending: list[int] = []
        a = rw.structure.allocs
        code, pass_id, param = a["code"].to_numpy(), a["pass_id"].to_numpy(), a["param"].to_numpy()
        self.grads = np.flatnonzero((code == CODES["gradient"]) & (pass_id == p.index))
        self.pos = a["pos"].to_numpy()
        p_block = rw.structure.params["block"].to_numpy()
        unit = np.where(param[self.grads] >= 0, p_block[np.maximum(param[self.grads], 0)], -1)
        fallback = -1 if -1 in self.by_block else units[0].block
        self.grad_unit = np.where(np.isin(unit, list(self.by_block)), unit, fallback)

    def _ag(self, u: Unit, at: int, before: bool, why: str = "") -> int:
        if self.flat:
            what = f"{self.label} unsharded flat parameter of a unit (all-gathered, padded)"
            k = self.rw.alloc_at(at, u.gathered, AG_STREAM, "fsdp_unsharded_params", what, before)
            # freed before: their blocks are back once the next is issued
            for old in self.flat_pending:
                self.rw.free_at(at, old, before)
            self.flat_pending = []
            return k
        what = f"{self.label} all-gather output (flat, one unit{why})"
        return self.rw.alloc_at(at, u.gathered, AG_STREAM, "comm_buffer", what, before)

    def _copy_out(self, u: Unit, at: int, before: bool) -> list[int]:
        what = f"{self.label} unsharded parameters of a unit (copied out of the all-gather)"
        rows = self.rw.structure.params["row"].to_numpy()
        return [
            self.rw.alloc_at(
                at,
                int(self.local[i]),
                0,
                "fsdp_unsharded_params",
                what,
                before,
                source_row=int(rows[i]),
            )
            for i in u.params.tolist()
        ]

    def gather_forward(self, u: Unit, at: int) -> None:
        if u.block in self.unsharded:
            return
        if self.flat:
            self.unsharded[u.block] = [self._ag(u, at, True)]
            return
        ag = self._ag(u, at, True)
        self.unsharded[u.block] = self._copy_out(u, at, True)
        for b, k in list(self.consumed.items()):  # the previous all-gather is released now
            self.rw.free_at(at, k)
            del self.consumed[b]
        self.consumed[u.block] = ag

    def gather_backward(self, u: Unit, at: int) -> None:
        if u.block in self.unsharded:
            self.prefetched.pop(u.block, None)
            return
        ag = self.prefetched.pop(u.block, None)
        if self.flat:
            self.unsharded[u.block] = [ag if ag is not None else self._ag(u, at, True)]
            return
        if ag is None:
            ag = self._ag(u, at, True)
        self.unsharded[u.block] = self._copy_out(u, at, True)
        self.rw.free_at(at, ag)

    def prefetch(self, u: Unit, at: int) -> None:
        if u.block in self.unsharded or u.block in self.prefetched:
            return
        self.prefetched[u.block] = self._ag(u, at, True, ", prefetched")

    def release(self, u: Unit, at: int, before: bool) -> None:
        for k in self.unsharded.pop(u.block, []):
            if self.flat:  # the compute stream used it (record_stream): the block comes back later
                self.rw.add(at, ("r", k), before)
                self.flat_pending.append(k)
            else:
                self.rw.free_at(at, k, before)

    def free_consumed(self, at: int) -> None:
        for b, k in list(self.consumed.items()):
            self.rw.free_at(at, k, False)
            del self.consumed[b]

    def reduce(self, u: Unit, at: int) -> None:
        """After u's backward: unsharded parameters freed, gradients reduce-scattered."""
        rw, label = self.rw, self.label
        mine = self.grads[self.grad_unit == u.block]
        if self.flat:
            # FSDP1 flattens the gradients into the padded buffer before it frees the parameter
            what = f"{label} reduce-scatter input (a unit's gradients, flat, padded)"
            rs_in = rw.alloc_at(at, u.gathered, AG_STREAM, "comm_buffer", what, False)
            self.release(u, at, False)
        else:
            self.release(u, at, False)
            if self.rs_input is not None:
                rw.free_at(at, self.rs_input, False)
            what = f"{label} reduce-scatter input (a unit's gradients, flat)"
            rs_in = self.rs_input = rw.alloc_at(at, u.gathered, 0, "comm_buffer", what, False)
        if self.flat:
            # FSDP1 reduce-scatters the gradients on its post-backward stream and record_stream()s
            # them: their blocks come back once that stream is done, at the next unit's
            # reduce-scatter (as the recorded FSDP1 runs show)
            for r in mine.tolist():
                rw.add(at, ("r", int(r)), False)
            for r in self.grad_pending:
                rw.add(at, ("f", int(r)), False)
            for k in self.rs_pending:
                rw.free_at(at, k, False)
            self.rs_pending = []
            self.grad_pending = mine.tolist()
        else:
            for r in mine.tolist():
                rw.add(at, ("f", int(r)), False)
        ends = rw.free_after[mine]
        rw.free_after[mine] = -1
        rw.rule[mine] = f"gradients, unsharded, until their unit's reduce-scatter ({label})"
        if mine.size == 0 and (self.sharded_grads.get(u.block, -2) < 0 or self.sharded_grads[u.block] > at):
            # no new gradient this pass (accumulation): the reduce-scatter's output is added to the
            # sharded gradient that is already there
            what = f"reduce-scatter output, accumulated into the sharded gradient ({label})"
            out = rw.alloc_at(at, u.shard, RS_STREAM, "comm_buffer", what, False)
            rw.free_at(at, out, False)
        else:
            lives = -1 if mine.size == 0 or (ends < 0).any() else int(ends.max())
            lives = at if 0 <= lives < at else lives  # the recorded gradients were gone already
            what = f"gradients, 1/{self.world} shard per rank ({label})"
            out = rw.alloc_at(at, u.shard, RS_STREAM, "gradient", what, False)
            if lives >= 0:
                rw.free_at(lives, out, False)
            self.sharded_grads[u.block] = lives
        if self.flat:  # like the gradients: its block comes back at the next unit's reduce-scatter
            rw.add(at, ("r", rs_in), False)
            self.rs_pending.append(rs_in)

    def run(self) -> None:
        p, by_block = self.p, self.by_block
        root = by_block.get(-1)
        if root is not None:
            self.gather_forward(root, p.forward_start)
            out = int(self.rw.structure.allocs["pos"].to_numpy()[p.output_row]) if p.output_row >= 0 else -1
            if self.reshard and not self.flat and out >= 0:
                # FSDP2 reshards the root after its forward too (the model's output is made), and
                # gathers it again once the loss's backward is done (FSDP1 keeps the root)
                again = min(p.loss_backward_end + 1, p.backward_end - 1)
                self.release(root, out, False)
                self.gather_backward(root, again)
                if self.p.block_backward and len(self.p.block_backward) - 1 in by_block:
                    self.prefetch(by_block[len(self.p.block_backward) - 1], again)
        nb = len(p.block_forward)
        for j, (first, last) in enumerate(p.block_forward):
            u = by_block.get(j)
            if u is not None:
                self.gather_forward(u, first)
                if self.reshard:
                    if j + 1 < nb:
                        self.release(u, p.block_forward[j + 1][0], True)
                    else:
                        self.release(u, last, False)
        # the last all-gather's buffer goes once the forward is done
        self.free_consumed(p.block_forward[-1][1] if p.block_forward else p.backward_start)
        for j in range(len(p.block_backward) - 1, -1, -1):
            u = by_block.get(j)
            if u is None:
                continue
            start, end = p.block_backward[j]
            self.gather_backward(u, start)
            if j - 1 in by_block:
                self.prefetch(by_block[j - 1], start)
            # after the unit's backward, and after its last gradient was made
            mine = self.grads[self.grad_unit == u.block]
            made = int(self.pos[mine].max()) if mine.size else -1
            self.reduce(u, max(end, start, made))
        last = p.backward_end - 1
        if root is not None:
            mine = self.grads[self.grad_unit == -1]
            last = max(last, int(self.pos[mine].max()) if mine.size else -1)
            self.reduce(root, last)
        if self.rs_input is not None:
            self.rw.free_at(last, self.rs_input, False)
            self.rs_input = None
        for r in self.grad_pending:
            self.rw.add(last, ("f", int(r)), False)
        self.grad_pending = []
        for k in [*self.rs_pending, *self.flat_pending]:
            self.rw.free_at(last, k, False)
        self.rs_pending = []
        self.flat_pending = []
        for u in list(by_block.values()):
            self.release(u, last, False)
        for k in self.prefetched.values():
            self.rw.free_at(last, k, False)
        self.prefetched.clear()
