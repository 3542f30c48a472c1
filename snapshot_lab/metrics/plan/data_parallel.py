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
from .messages import (
    RULE_DDP_BROADCAST,
    RULE_DDP_BUCKET_VIEW_GRADIENTS,
    RULE_DDP_FIRST_BUCKET,
    RULE_DDP_REBUILT_BUCKETS,
    RULE_FSDP1_FLAT_SHARD,
    RULE_FSDP1_FLATTEN,
    RULE_FSDP1_REDUCE_SCATTER_INPUT,
    RULE_FSDP1_UNSHARDED,
    RULE_FSDP_ACCUMULATED,
    RULE_FSDP_ALL_GATHER,
    RULE_FSDP_REDUCE_SCATTER_INPUT,
    RULE_FSDP_SHARDED_GRADIENTS,
    RULE_FSDP_UNSHARDED,
    RULE_FSDP_UNSHARDED_GRADIENTS,
    RULE_PARAMETER_SHARDS,
    RULE_SHARDED_OPTIMIZER_STATE,
    RULE_UNTRACKED_KEPT,
    RULE_UNTRACKED_SHARDED,
)
from .rewrite import Rewrite
from .structure import Pass, TrainingStructure

MiB = 1 << 20
BROADCAST_BUCKET = 250 * MiB  # DDP's _sync_module_states coalescing limit
FIRST_BUCKET = 1 * MiB  # dist._DEFAULT_FIRST_BUCKET_BYTES
AG_STREAM = 1_000_001  # FSDP2 all-gather stream / FSDP1 unshard stream
# FSDP2 reduce-scatter stream / FSDP1 post-backward stream
RS_STREAM = 1_000_002


def ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


# --------------------------------------------------------------------------- parameters


def untracked_sharded(
    categories: tuple[str, ...],
    world: int,
    label: str,
) -> Callable[[int, str], tuple[int, str]]:
    """How memory older than the trace is planned when the strategy shards ``categories``."""

    def scale(size: int, category: str) -> tuple[int, str]:
        if category in categories:
            return ceil_div(
                size,
                world,
            ), RULE_UNTRACKED_SHARDED.format(category=category.replace("_", " "), world=world, label=label)
        return size, RULE_UNTRACKED_KEPT.format(category=category.replace("_", " "))

    return scale


def param_rows(structure: TrainingStructure) -> np.ndarray:
    return structure.params["row"].to_numpy()


def shard_at_wrap(rewrite: Rewrite, local: np.ndarray, rule: str) -> None:
    """Where the model is wrapped: each parameter's local shard (``local[i]`` bytes, parameter
    order) is allocated and the recorded full parameter freed."""
    structure = rewrite.structure
    rows = param_rows(structure)
    for i, row in enumerate(rows.tolist()):
        if local[i] != rewrite.size[row]:
            if local[i] > 0:
                rewrite.alloc_at(
                    structure.wrap_pos,
                    int(local[i]),
                    int(rewrite.stream[row]),
                    "parameter",
                    rule,
                    source_row=int(row),
                )
            rewrite.add(structure.wrap_pos, ("f", int(row)))
            rewrite.free_after[row] = -1


def scale_rows(
    rewrite: Rewrite,
    rows: np.ndarray,
    factor: np.ndarray | float,
    category: str,
    rule: str,
) -> None:
    if rows.size == 0:
        return
    new = np.ceil(rewrite.size[rows] * factor).astype(np.int64)
    rewrite.set(rows, new, category, rule)


def optimizer_rows(structure: TrainingStructure) -> np.ndarray:
    return np.flatnonzero(structure.allocs["code"].to_numpy() == CODES["optimizer_state"])


def gradient_rows(structure: TrainingStructure) -> np.ndarray:
    return np.flatnonzero(structure.allocs["code"].to_numpy() == CODES["gradient"])


# --------------------------------------------------------------------------- DDP


def ddp_buckets(sizes: list[int], cap: int) -> list[int]:
    """Bucket sizes: tensors in the order their gradients become ready, a bucket closed once it
    reaches its limit (1 MiB for the first, ``cap`` after)."""
    out, cur, limit = [], 0, FIRST_BUCKET
    for size in sizes:
        cur += size
        if cur >= limit:
            out.append(cur)
            cur, limit = 0, cap
    if cur:
        out.append(cur)
    return out


def _broadcast_groups(sizes: list[int]) -> list[int]:
    """The flat temporaries of ``_sync_module_states``: parameters packed, in order, until one
    reaches the broadcast bucket; what is left goes last."""
    groups: list[int] = []
    group = 0
    for size in sizes:
        group += int(size)
        if group >= BROADCAST_BUCKET:
            groups.append(group)
            group = 0
    if group:
        groups.append(group)
    return groups


def apply_ddp(
    rewrite: Rewrite,
    bucket_view: bool,
    bucket_cap_mb: float,
    local: np.ndarray,
    label: str = "DDP",
) -> None:
    structure = rewrite.structure
    total = int(local.sum())
    if total == 0 or not structure.passes:
        return
    wrap = structure.wrap_pos
    stream = (
        int(np.bincount(rewrite.stream[param_rows(structure)].clip(min=0)).argmax()) if len(structure.params) else 0
    )
    # _sync_module_states: rank 0's parameters broadcast through flat temporaries
    for group in _broadcast_groups(local.tolist()):
        key = rewrite.alloc_at(wrap, group, stream, "other", RULE_DDP_BROADCAST.format(label=label))
        rewrite.free_at(wrap, key)
    first = rewrite.alloc_at(
        wrap,
        total,
        stream,
        "ddp_bucket",
        RULE_DDP_FIRST_BUCKET.format(label=label),
    )
    rebuilt = ddp_buckets(
        [int(n_bytes) for n_bytes in local[::-1].tolist()],
        int(bucket_cap_mb * MiB),
    )
    if len(structure.passes) >= 2:
        at = structure.passes[1].forward_start
        rewrite.free_at(at, first)
        for bucket in rebuilt:
            rewrite.alloc_at(
                at,
                bucket,
                stream,
                "ddp_bucket",
                RULE_DDP_REBUILT_BUCKETS.format(label=label),
            )
    if bucket_view:
        grads = gradient_rows(structure)
        pos = structure.allocs["pos"].to_numpy()
        rewrite.free_after[grads] = pos[grads]
        rewrite.rule[grads] = RULE_DDP_BUCKET_VIEW_GRADIENTS


def apply_zero1(rewrite: Rewrite, world: int) -> None:
    rows = optimizer_rows(rewrite.structure)
    scale_rows(
        rewrite,
        rows,
        1.0 / world,
        "optimizer_state",
        RULE_SHARDED_OPTIMIZER_STATE.format(world=world, label="ZeRO-1"),
    )


# --------------------------------------------------------------------------- FSDP


@dataclass(frozen=True)
class Unit:
    name: str  # "root" or "block 3"
    block: int  # -1: the root
    params: np.ndarray  # parameter indexes
    # bytes of its parameters on this rank before sharding (after tensor parallelism)
    local: int
    shard: int  # this rank's shard of them
    gathered: int  # the all-gather output (shards x world)


def fsdp_units(
    structure: TrainingStructure,
    local: np.ndarray,
    world: int,
    flat: bool,
) -> list[Unit]:
    block = structure.params["block"].to_numpy()
    units = []
    root = np.flatnonzero(block < 0)
    ids = [("root", -1, root)] + [
        (
            f"block {j}",
            j,
            np.flatnonzero(block == j),
        )
        for j in range(structure.n_blocks)
    ]
    for name, block_index, idx in ids:
        if idx.size == 0:
            continue
        total = int(local[idx].sum())
        shard = (
            ceil_div(
                total,
                world,
            )
            if flat
            else sum(ceil_div(int(size), world) for size in local[idx].tolist())
        )
        units.append(Unit(name, block_index, idx, total, shard, shard * world))
    return units


def apply_fsdp(
    rewrite: Rewrite,
    world: int,
    reshard_after_forward: bool,
    version: int,
    local: np.ndarray,
    label: str | None = None,
) -> list[Unit]:
    """Shard parameters, gradients and optimizer state over ``world`` ranks and add the
    all-gathers and reduce-scatters around every unit. ``local``: parameter bytes on this rank
    before sharding (tensor parallelism may have divided them already)."""
    structure = rewrite.structure
    label = label or ("FSDP2" if version == 2 else "FSDP1")
    units = fsdp_units(structure, local, world, flat=version == 1)
    if not units:
        return units
    if version == 1:
        _flatten_at_wrap(rewrite, units, world, label)
    else:
        shards = np.array([ceil_div(int(size), world) for size in local.tolist()], dtype=np.int64)
        shard_at_wrap(rewrite, shards, RULE_PARAMETER_SHARDS.format(world=world, label=label))
    rows = optimizer_rows(structure)
    ratio = param_ratio(structure, local, structure.allocs["param"].to_numpy()[rows]) / world
    rewrite.set(
        rows,
        np.ceil(structure.allocs["size"].to_numpy()[rows] * ratio).astype(np.int64),
        "optimizer_state",
        RULE_SHARDED_OPTIMIZER_STATE.format(world=world, label=label),
    )
    # unit -> where its sharded gradient is freed (-1: never)
    sharded_grads: dict[int, int] = {}
    for training_pass in structure.passes:
        _FsdpPass(
            rewrite,
            training_pass,
            units,
            local,
            world,
            reshard_after_forward,
            version == 1,
            label,
            sharded_grads,
        ).run()
    return units


def _flatten_at_wrap(rewrite: Rewrite, units: list[Unit], world: int, label: str) -> None:
    """FSDP1 wraps a unit by flattening its parameters into one flat tensor, copying this rank's
    shard out of it and freeing both the flat tensor and the original parameters."""
    structure = rewrite.structure
    rows = param_rows(structure)
    stream = int(rewrite.stream[rows[0]]) if rows.size else 0
    at = structure.wrap_pos
    for unit in units:
        flat = rewrite.alloc_at(
            at,
            unit.local,
            stream,
            "parameter",
            RULE_FSDP1_FLATTEN.format(label=label),
        )
        first = int(rows[unit.params[0]])
        rewrite.alloc_at(
            at,
            unit.shard,
            stream,
            "parameter",
            RULE_FSDP1_FLAT_SHARD.format(world=world, label=label),
            source_row=first,
        )
        rewrite.free_at(at, flat)
        for i in unit.params.tolist():
            rewrite.add(at, ("f", int(rows[i])))
            rewrite.free_after[rows[i]] = -1


def param_ratio(structure: TrainingStructure, local: np.ndarray, param: np.ndarray) -> np.ndarray:
    """Per row mirroring parameter ``param``: that parameter's local share (after tensor
    parallelism), the average share for rows mirroring none."""
    p_size = structure.params["size"].to_numpy()
    avg = float(local.sum()) / max(int(p_size.sum()), 1)
    out = np.full(param.size, avg)
    mirrors = param >= 0
    out[mirrors] = local[param[mirrors]] / np.maximum(p_size[param[mirrors]], 1)
    return out


class _FsdpPass:
    """The all-gathers and reduce-scatters of one pass, placed at the recorded moments of each
    unit's forward and backward."""

    def __init__(
        self,
        rewrite: Rewrite,
        training_pass: Pass,
        units: list[Unit],
        local: np.ndarray,
        world: int,
        reshard: bool,
        flat: bool,
        label: str,
        sharded_grads: dict[int, int],
    ) -> None:
        self.rewrite, self.training_pass, self.local, self.world = (
            rewrite,
            training_pass,
            local,
            world,
        )
        self.sharded_grads = sharded_grads
        self.reshard, self.flat, self.label = reshard, flat, label
        self.by_block = {each.block: each for each in units}
        # unit -> keys of its unsharded parameters
        self.unsharded: dict[int, list[int]] = {}
        # unit -> all-gather buffer copied out, kept until the next one
        self.consumed: dict[int, int] = {}
        # unit -> all-gather buffer issued ahead
        self.prefetched: dict[int, int] = {}
        self.rs_input: int | None = None
        self.grad_pending: list[int] = []
        self.rs_pending: list[int] = []
        self.flat_pending: list[int] = []
        allocs = rewrite.structure.allocs
        code, pass_id, param = (
            allocs["code"].to_numpy(),
            allocs["pass_id"].to_numpy(),
            allocs["param"].to_numpy(),
        )
        self.grads = np.flatnonzero((code == CODES["gradient"]) & (pass_id == training_pass.index))
        self.pos = allocs["pos"].to_numpy()
        p_block = rewrite.structure.params["block"].to_numpy()
        grad_block = np.where(param[self.grads] >= 0, p_block[np.maximum(param[self.grads], 0)], -1)
        fallback = -1 if -1 in self.by_block else units[0].block
        self.grad_unit = np.where(np.isin(grad_block, list(self.by_block)), grad_block, fallback)

    def _ag(self, unit: Unit, at: int, before: bool, why: str = "") -> int:
        if self.flat:
            what = RULE_FSDP1_UNSHARDED.format(label=self.label)
            key = self.rewrite.alloc_at(
                at,
                unit.gathered,
                AG_STREAM,
                "fsdp_unsharded_params",
                what,
                before,
            )
            # freed before: their blocks are back once the next is issued
            for old in self.flat_pending:
                self.rewrite.free_at(at, old, before)
            self.flat_pending = []
            return key
        what = RULE_FSDP_ALL_GATHER.format(label=self.label, why=why)
        return self.rewrite.alloc_at(at, unit.gathered, AG_STREAM, "comm_buffer", what, before)

    def _copy_out(self, unit: Unit, at: int, before: bool) -> list[int]:
        what = RULE_FSDP_UNSHARDED.format(label=self.label)
        rows = self.rewrite.structure.params["row"].to_numpy()
        return [
            self.rewrite.alloc_at(
                at,
                int(self.local[i]),
                0,
                "fsdp_unsharded_params",
                what,
                before,
                source_row=int(rows[i]),
            )
            for i in unit.params.tolist()
        ]

    def gather_forward(self, unit: Unit, at: int) -> None:
        if unit.block in self.unsharded:
            return
        if self.flat:
            self.unsharded[unit.block] = [self._ag(unit, at, True)]
            return
        gathered = self._ag(unit, at, True)
        self.unsharded[unit.block] = self._copy_out(unit, at, True)
        for block, key in list(self.consumed.items()):
            # the previous all-gather is released now
            self.rewrite.free_at(at, key)
            del self.consumed[block]
        self.consumed[unit.block] = gathered

    def gather_backward(self, unit: Unit, at: int) -> None:
        if unit.block in self.unsharded:
            self.prefetched.pop(unit.block, None)
            return
        gathered = self.prefetched.pop(unit.block, None)
        if self.flat:
            self.unsharded[unit.block] = [
                gathered
                if gathered is not None
                else self._ag(
                    unit,
                    at,
                    True,
                )
            ]
            return
        if gathered is None:
            gathered = self._ag(unit, at, True)
        self.unsharded[unit.block] = self._copy_out(unit, at, True)
        self.rewrite.free_at(at, gathered)

    def prefetch(self, unit: Unit, at: int) -> None:
        if unit.block in self.unsharded or unit.block in self.prefetched:
            return
        self.prefetched[unit.block] = self._ag(unit, at, True, ", prefetched")

    def release(self, unit: Unit, at: int, before: bool) -> None:
        for key in self.unsharded.pop(unit.block, []):
            if self.flat:
                # the compute stream used it (record_stream): the block comes back later
                self.rewrite.add(at, ("r", key), before)
                self.flat_pending.append(key)
            else:
                self.rewrite.free_at(at, key, before)

    def free_consumed(self, at: int) -> None:
        for block, key in list(self.consumed.items()):
            self.rewrite.free_at(at, key, False)
            del self.consumed[block]

    def reduce(self, unit: Unit, at: int) -> None:
        """After u's backward: unsharded parameters freed, gradients reduce-scattered."""
        rewrite, label = self.rewrite, self.label
        mine = self.grads[self.grad_unit == unit.block]
        if self.flat:
            # FSDP1 flattens the gradients into the padded buffer before it frees the parameter
            what = RULE_FSDP1_REDUCE_SCATTER_INPUT.format(label=label)
            rs_in = rewrite.alloc_at(at, unit.gathered, AG_STREAM, "comm_buffer", what, False)
            self.release(unit, at, False)
        else:
            self.release(unit, at, False)
            if self.rs_input is not None:
                rewrite.free_at(at, self.rs_input, False)
            what = RULE_FSDP_REDUCE_SCATTER_INPUT.format(label=label)
            rs_in = self.rs_input = rewrite.alloc_at(
                at,
                unit.gathered,
                0,
                "comm_buffer",
                what,
                False,
            )
        if self.flat:
            # FSDP1 reduce-scatters the gradients on its post-backward stream and record_stream()s
            # them: their blocks come back once that stream is done, at the next unit's
            # reduce-scatter (as the recorded FSDP1 runs show)
            for row in mine.tolist():
                rewrite.add(at, ("r", int(row)), False)
            for row in self.grad_pending:
                rewrite.add(at, ("f", int(row)), False)
            for key in self.rs_pending:
                rewrite.free_at(at, key, False)
            self.rs_pending = []
            self.grad_pending = mine.tolist()
        else:
            for row in mine.tolist():
                rewrite.add(at, ("f", int(row)), False)
        ends = rewrite.free_after[mine]
        rewrite.free_after[mine] = -1
        rewrite.rule[mine] = RULE_FSDP_UNSHARDED_GRADIENTS.format(label=label)
        if mine.size == 0 and (
            self.sharded_grads.get(
                unit.block,
                -2,
            )
            < 0
            or self.sharded_grads[unit.block] > at
        ):
            # no new gradient this pass (accumulation): the reduce-scatter's output is added to the
            # sharded gradient that is already there
            what = RULE_FSDP_ACCUMULATED.format(label=label)
            out = rewrite.alloc_at(at, unit.shard, RS_STREAM, "comm_buffer", what, False)
            rewrite.free_at(at, out, False)
        else:
            lives = -1 if mine.size == 0 or (ends < 0).any() else int(ends.max())
            # the recorded gradients were gone already
            lives = at if 0 <= lives < at else lives
            what = RULE_FSDP_SHARDED_GRADIENTS.format(world=self.world, label=label)
            out = rewrite.alloc_at(at, unit.shard, RS_STREAM, "gradient", what, False)
            if lives >= 0:
                rewrite.free_at(lives, out, False)
            self.sharded_grads[unit.block] = lives
        if self.flat:
            # like the gradients: its block comes back at the next unit's reduce-scatter
            rewrite.add(at, ("r", rs_in), False)
            self.rs_pending.append(rs_in)

    def run(self) -> None:
        training_pass, by_block = self.training_pass, self.by_block
        root = by_block.get(-1)
        if root is not None:
            self.gather_forward(root, training_pass.forward_start)
            out = (
                int(self.rewrite.structure.allocs["pos"].to_numpy()[training_pass.output_row])
                if training_pass.output_row >= 0
                else -1
            )
            if self.reshard and not self.flat and out >= 0:
                # FSDP2 reshards the root after its forward too (the model's output is made), and
                # gathers it again once the loss's backward is done (FSDP1 keeps the root)
                again = min(training_pass.loss_backward_end + 1, training_pass.backward_end - 1)
                self.release(root, out, False)
                self.gather_backward(root, again)
                if self.training_pass.block_backward and len(self.training_pass.block_backward) - 1 in by_block:
                    self.prefetch(by_block[len(self.training_pass.block_backward) - 1], again)
        n_blocks = len(training_pass.block_forward)
        for j, (first, last) in enumerate(training_pass.block_forward):
            unit = by_block.get(j)
            if unit is not None:
                self.gather_forward(unit, first)
                if self.reshard:
                    if j + 1 < n_blocks:
                        self.release(unit, training_pass.block_forward[j + 1][0], True)
                    else:
                        self.release(unit, last, False)
        # the last all-gather's buffer goes once the forward is done
        self.free_consumed(
            training_pass.block_forward[-1][1] if training_pass.block_forward else training_pass.backward_start
        )
        for j in range(len(training_pass.block_backward) - 1, -1, -1):
            unit = by_block.get(j)
            if unit is None:
                continue
            start, end = training_pass.block_backward[j]
            self.gather_backward(unit, start)
            if j - 1 in by_block:
                self.prefetch(by_block[j - 1], start)
            # after the unit's backward, and after its last gradient was made
            mine = self.grads[self.grad_unit == unit.block]
            made = int(self.pos[mine].max()) if mine.size else -1
            self.reduce(unit, max(end, start, made))
        last = training_pass.backward_end - 1
        if root is not None:
            mine = self.grads[self.grad_unit == -1]
            last = max(last, int(self.pos[mine].max()) if mine.size else -1)
            self.reduce(root, last)
        if self.rs_input is not None:
            self.rewrite.free_at(last, self.rs_input, False)
            self.rs_input = None
        for row in self.grad_pending:
            self.rewrite.add(last, ("f", int(row)), False)
        self.grad_pending = []
        for key in [*self.rs_pending, *self.flat_pending]:
            self.rewrite.free_at(last, key, False)
        self.rs_pending = []
        self.flat_pending = []
        for unit in list(by_block.values()):
            self.release(unit, last, False)
        for key in self.prefetched.values():
            self.rewrite.free_at(last, key, False)
        self.prefetched.clear()
