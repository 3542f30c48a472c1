"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``,
``DeviceCachingAllocator``, torch 2.x) for replaying a recorded trace under other settings.

What it follows: 512-byte rounding and ``roundup_power2_divisions``; small (<= 1 MiB) and large
pools per stream; segment sizes (2 MiB small, 20 MiB for requests under 10 MiB, else rounded to
2 MiB); best fit by (stream, size, address); the split rules (small pool and expandable
segments split off >= 512 B, the large pool only remainders > 1 MiB and only below
``max_split_size``); coalescing with free neighbours; ``max_split_size`` (oversize blocks are
not split and serve a request only within ``max_non_split_rounding`` of its size);
``release_available_cached_blocks`` and ``release_cached_blocks`` before an OOM;
``garbage_collection_threshold`` (free unsplit blocks older than the average, when a memory
limit is set); expandable segments (one reserved range per stream and pool, mapped in pages of
2 MiB / 20 MiB at the lowest address that fits, unmapped page-wise on release); frees delayed
until ``free_completed``.

Deliberate simplifications, each noted where it is made:
- CUDA graph private pools are not modelled: their allocations are replayed in the default pool.
- The device is a budget of bytes (``memory_limit``): cudaMalloc fails only when it would take
  reserved memory over the limit (memory used outside the allocator, such as the CUDA context,
  is not known from the snapshot).
- Addresses of new segments are synthetic (increasing), unless a recorded segment of the same
  size is waiting to be reused, which keeps self-replays aligned with the recording.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field, replace
from typing import Any

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: requests up to this go to the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small pool segment size
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
LARGE_BUFFER = 20 << 20  # kLargeBuffer: large segments for requests under kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
UNLIMITED = (1 << 64) - 1  # SIZE_MAX, max_split_size's default


@dataclass(frozen=True)
class AllocatorSettings:
    """The settings that shape allocation, as PYTORCH_CUDA_ALLOC_CONF spells them."""

    max_split_size: int = UNLIMITED  # bytes
    max_non_split_rounding: int = LARGE_BUFFER  # bytes
    roundup_power2_divisions: tuple[int, ...] = (0,) * 16  # per power-of-two interval from 1 MiB
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False

    def describe(self) -> dict[str, object]:
        d: dict[str, object] = {
            "expandable_segments": self.expandable_segments,
            "max_split_size_mb": None if self.max_split_size == UNLIMITED else self.max_split_size >> 20,
            "garbage_collection_threshold": self.garbage_collection_threshold,
        }
        if any(self.roundup_power2_divisions):
            divs = set(self.roundup_power2_divisions)
            d["roundup_power2_divisions"] = divs.pop() if len(divs) == 1 else list(self.roundup_power2_divisions)
        if self.max_non_split_rounding != LARGE_BUFFER:
            d["max_non_split_rounding_mb"] = self.max_non_split_rounding >> 20
        return d


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def recorded_settings(info_settings: dict[str, Any] | None) -> AllocatorSettings:
    """The settings a snapshot was recorded with (``allocator_settings``, torch >= 2.3); a value
    of the wrong type counts as the default."""
    s = info_settings if isinstance(info_settings, dict) else {}
    ms = _int(s.get("max_split_size", -1), -1)
    divisions = s.get("roundup_power2_divisions")
    ordered = [0] * 16
    if isinstance(divisions, dict):
        keyed = sorted((k, v) for k, v in divisions.items() if str(k).isdigit())
        ordered = [max(0, _int(v, 0)) for _, v in sorted(keyed, key=lambda kv: int(kv[0]))]
    ordered = (ordered + [0] * 16)[:16]
    gc = s.get("garbage_collection_threshold", 0.0)
    gc = float(gc) if isinstance(gc, (int, float)) and not isinstance(gc, bool) and 0.0 <= gc < 1.0 else 0.0
    return AllocatorSettings(
        max_split_size=UNLIMITED if ms < 0 else ms,
        roundup_power2_divisions=tuple(ordered),
        garbage_collection_threshold=gc,
        expandable_segments=s.get("expandable_segments") is True,
    )


def apply_conf(base: AllocatorSettings, conf: list[str]) -> AllocatorSettings:
    """Apply ``KEY:VALUE`` items spelled as in PYTORCH_CUDA_ALLOC_CONF."""
    s = base
    for item in conf:
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"expected KEY:VALUE, got {part!r}")
            if key == "expandable_segments":
                if value not in ("True", "False", "true", "false", "1", "0"):
                    raise ValueError(f"expandable_segments takes True or False, not {value!r}")
                s = replace(s, expandable_segments=value in ("True", "true", "1"))
            elif key == "max_split_size_mb":
                mb = int(value)
                if mb <= LARGE_BUFFER >> 20:
                    raise ValueError("max_split_size_mb must be larger than 20")
                s = replace(s, max_split_size=mb << 20)
            elif key == "max_non_split_rounding_mb":
                s = replace(s, max_non_split_rounding=int(value) << 20)
            elif key == "garbage_collection_threshold":
                t = float(value)
                if not 0.0 < t < 1.0:
                    raise ValueError("garbage_collection_threshold must be between 0 and 1")
                s = replace(s, garbage_collection_threshold=t)
            elif key == "roundup_power2_divisions":
                if value.startswith("["):
                    raise ValueError("per-interval roundup_power2_divisions lists are not supported here")
                d = int(value)
                if d & (d - 1):
                    raise ValueError("roundup_power2_divisions must be a power of 2")
                s = replace(s, roundup_power2_divisions=(d,) * 16)
            else:
                raise ValueError(f"unknown or unsupported setting {key!r}")
    return s


def _log2_floor(x: int) -> int:
    return x.bit_length() - 1


def round_size(size: int, s: AllocatorSettings) -> int:
    """``DeviceCachingAllocator::round_size``."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    log_size = _log2_floor(size)
    index = max(0, log_size - 20)  # intervals start at 1 MiB
    index = min(index, len(s.roundup_power2_divisions) - 1)
    divisions = s.roundup_power2_divisions[index]
    if divisions > 1 and size > MIN_BLOCK * divisions:
        if size & (size - 1) == 0:
            return size
        floor = 1 << log_size
        step = floor >> _log2_floor(divisions)
        if step == 0:
            return floor << 1
        r = size & ~(step - 1)
        return size if r == size else r + step
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """``get_allocation_size``: bytes cudaMalloc'd for a new segment serving ``size``."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


_UNPOOLED = (-1, -1, -1)


class Block:
    __slots__ = (
        "addr",
        "allocated",
        "gc_base",
        "mapped",
        "next",
        "pool_key",
        "prev",
        "segment",
        "size",
        "small",
        "stream",
    )

    def __init__(self, addr: int, size: int, stream: int, small: bool, segment: int) -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = True
        self.segment = segment  # id of the cudaMalloc'd segment or expandable range
        self.gc_base = 0
        self.pool_key: tuple[int, int, int] = _UNPOOLED  # set when the block enters a pool

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks ordered like ``BlockComparatorSize`` (stream, size, address)."""

    def __init__(self, small: bool, index_addresses: bool = False) -> None:
        self.small = small
        self.index_addresses = index_addresses
        self.keys: list[tuple[int, int, int]] = []
        self.blocks: dict[tuple[int, int, int], Block] = {}
        self.unmapped: list[tuple[int, int]] = []  # (stream, addr) of unmapped expandable blocks
        self.unmapped_blocks: dict[tuple[int, int], Block] = {}
        # free mapped blocks by address, when following a trace as recorded (addresses are then
        # the real ones, unique); a replay that decides for itself may reuse an address
        self.at: dict[int, Block] = {}
        self.gc_calls = 0

    def insert(self, b: Block) -> None:
        k = b.pool_key = (b.stream, b.size, b.addr)  # unchanged while the block is in the pool
        insort(self.keys, k)
        self.blocks[k] = b
        if self.index_addresses:
            self.at[b.addr] = b
        b.gc_base = self.gc_calls

    def remove(self, b: Block) -> None:
        k = b.pool_key
        del self.keys[bisect_left(self.keys, k)]
        del self.blocks[k]
        if self.index_addresses:
            del self.at[b.addr]

    def insert_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        insort(self.unmapped, k)
        self.unmapped_blocks[k] = b

    def remove_unmapped(self, b: Block) -> None:
        k = (b.stream, b.addr)
        del self.unmapped[bisect_left(self.unmapped, k)]
        del self.unmapped_blocks[k]


@dataclass
class ReplayStats:
    reserved_bytes: int = 0
    peak_reserved_bytes: int = 0
    allocated_bytes: int = 0
    peak_allocated_bytes: int = 0
    cuda_malloc_calls: int = 0
    cuda_free_calls: int = 0
    alloc_retries: int = 0
    ooms: list[tuple[int, int]] = field(default_factory=list)  # (event index, requested bytes)


class OutOfMemory(Exception):
    pass


def segment_address_space(size: int) -> int:
    """The address space a segment of ``size`` bytes takes: whole 2 MiB pages."""
    return -(-size // (2 << 20)) * (2 << 20)


class CachingAllocatorModel:
    """One device's allocator. ``malloc``/``free`` mirror the real calls; ``empty_cache`` is
    ``release_cached_blocks``."""

    def __init__(
        self,
        settings: AllocatorSettings,
        memory_limit: int | None = None,
        limit_is_cap: bool = True,
        follows_trace: bool = False,
    ) -> None:
        self.s = settings
        self.limit = memory_limit  # None: cudaMalloc never fails
        # a per-process cap (set_per_process_memory_fraction), not the device's capacity: the
        # allocator garbage-collects only under a cap
        self.limit_is_cap = limit_is_cap
        self._plain_rounding = not any(d > 1 for d in settings.roundup_power2_divisions)
        # the settings read on every malloc, held here to spare the lookups
        self._expandable = settings.expandable_segments
        self._max_split_size = settings.max_split_size
        self._max_non_split_rounding = settings.max_non_split_rounding
        self._gc = memory_limit is not None and limit_is_cap and settings.garbage_collection_threshold > 0
        self.small = _Pool(True, follows_trace)
        self.large = _Pool(False, follows_trace)
        self._segment_starts: set[int] = set()  # cudaMalloc'd segments alive, by address
        self.stats = ReplayStats()
        self._next_addr = 1 << 40
        self._free_va: list[tuple[int, int]] = []  # (address, length) freed synthetic ranges
        self._segment_ids = itertools.count()
        self.recorded_addresses: dict[int, list[int]] = {}  # size -> recorded segment addresses to reuse
        self._expandable_base: dict[int, int] = {}  # expandable segment id -> start of its address range
        self.page = {True: SMALL_BUFFER, False: LARGE_BUFFER}

    # ----------------------------------------------------------------------- bookkeeping

    def _reserve(self, n: int) -> bool:
        if self.limit is not None and self.stats.reserved_bytes + n > self.limit:
            return False
        self.stats.reserved_bytes += n
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)
        return True

    def _unreserve(self, n: int) -> None:
        self.stats.reserved_bytes -= n

    def _new_address(self, size: int) -> int:
        """Where cudaMalloc puts a new segment. The driver's choice is unknowable; a recorded
        segment of the same size gives the best guess (the driver is deterministic for the same
        sequence), else the lowest freed range that fits, else fresh address space."""
        reuse = self.recorded_addresses.get(size)
        while reuse:
            addr = reuse.pop(0)
            # a scenario may still hold the segment the recording freed there: not that one
            if addr not in self._segment_starts:
                return addr
        need = segment_address_space(size)
        freed = self._take_freed_range(need)
        return freed if freed is not None else self._fresh_range(need)

    def _take_freed_range(self, need: int) -> int | None:
        """The lowest freed range of address space that holds ``need`` bytes (None: none)."""
        for i, (start, length) in enumerate(self._free_va):
            if length >= need:
                if length == need:
                    del self._free_va[i]
                else:
                    self._free_va[i] = (start + need, length - need)
                return start
        return None

    def _fresh_range(self, need: int) -> int:
        """Address space never used yet: above everything so far."""
        addr = self._next_addr
        self._next_addr += need
        return addr

    def _return_address(self, addr: int, size: int) -> None:
        if addr >= 1 << 40 and addr < self._next_addr:  # only synthetic space is recycled
            insort(self._free_va, (addr, segment_address_space(size)))

    def _pool(self, small: bool) -> _Pool:
        return self.small if small else self.large

    @property
    def gc_enabled(self) -> bool:
        return self._gc

    # ----------------------------------------------------------------------- malloc

    def malloc(self, orig_size: int, stream: int, event_index: int = -1) -> Block:
        if self._plain_rounding:
            size = MIN_BLOCK if orig_size < MIN_BLOCK else -(-orig_size // MIN_BLOCK) * MIN_BLOCK
        else:
            size = round_size(orig_size, self.s)
        pool = self.small if size <= SMALL_SIZE else self.large
        block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._new_block(pool, size, stream, event_index)
        # _alloc_found_block, written out here: this runs once per replayed allocation
        remaining = block.size - size
        if block.small or self._expandable:
            split = remaining >= MIN_BLOCK
        else:
            split = size < self._max_split_size and remaining > SMALL_SIZE
        if split:  # _split_after and pool.insert, written out
            rest = Block(block.addr + size, remaining, block.stream, block.small, block.segment)
            rest.mapped = block.mapped
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            key = rest.pool_key = (rest.stream, remaining, rest.addr)
            insort(pool.keys, key)
            pool.blocks[key] = rest
            if pool.index_addresses:
                pool.at[rest.addr] = rest
            rest.gc_base = pool.gc_calls
        block.allocated = True
        stats = self.stats
        stats.allocated_bytes += block.size
        if stats.allocated_bytes > stats.peak_allocated_bytes:
            stats.peak_allocated_bytes = stats.allocated_bytes
        return block

    def _new_block(self, pool: _Pool, size: int, stream: int, event_index: int) -> Block:
        """No cached block serves ``size``: a new segment, after giving cached memory back when
        the limit requires it; OutOfMemory when nothing helps."""
        alloc_size = allocation_size(size)
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, size, alloc_size, stream)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, alloc_size, stream)
        if block is None:
            self.stats.alloc_retries += 1
            self.empty_cache()
            block = self._alloc_block(pool, size, alloc_size, stream)
        if block is None:
            self.stats.ooms.append((event_index, size))
            raise OutOfMemory(size)
        return block

    def _expandable_size(self, b: Block) -> int:
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def _get_free_block(self, pool: _Pool, size: int, stream: int) -> Block | None:
        if self._gc:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        if i == len(keys):
            return None
        key = keys[i]
        if key[0] != stream:
            return None
        b = pool.blocks[key]
        if self._expandable and b.segment in self._expandable_base:
            # best fit by the size a block can grow to (its unmapped neighbour included)
            j = i + 1
            while j < len(keys) and keys[j][0] == stream:
                nb = pool.blocks[keys[j]]
                if self._expandable_size(nb) < self._expandable_size(b):
                    b, i = nb, j
                    j += 1
                else:
                    break
        max_split_size = self._max_split_size
        if size < max_split_size:
            if b.size >= max_split_size:
                return None
        elif b.size >= size + self._max_non_split_rounding:
            return None
        # pool.remove(b), written out: keys[i] is b's key
        del keys[i]
        del pool.blocks[b.pool_key]
        if pool.index_addresses:
            del pool.at[b.addr]
        return b

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int, stream: int) -> Block | None:
        if self.s.expandable_segments:
            return self._try_allocate_expandable(pool, size, stream)
        if not self._reserve(alloc_size):
            return None
        self.stats.cuda_malloc_calls += 1
        addr = self._new_address(alloc_size)
        self._segment_starts.add(addr)
        return Block(addr, alloc_size, stream, pool.small, next(self._segment_ids))

    def _should_split(self, b: Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.s.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.s.max_split_size and remaining > SMALL_SIZE

    @staticmethod
    def _split_after(b: Block, n: int) -> Block:
        """Keep the first ``n`` bytes in ``b``; return the rest, linked right after it."""
        rest = Block(b.addr + n, b.size - n, b.stream, b.small, b.segment)
        rest.mapped = b.mapped
        rest.prev, rest.next = b, b.next
        if b.next is not None:
            b.next.prev = rest
        b.next = rest
        b.size = n
        return rest

    def _alloc_found_block(self, pool: _Pool, b: Block, size: int) -> Block:
        if self._should_split(b, size):
            pool.insert(self._split_after(b, size))
        b.allocated = True
        return b

    # ----------------------------------------------------------------------- free

    def free(self, b: Block) -> None:
        b.allocated = False
        self.stats.allocated_bytes -= b.size
        pool = self.small if b.small else self.large
        # pool.remove and pool.insert written out: this runs once per replayed free
        keys, blocks, at = pool.keys, pool.blocks, pool.at if pool.index_addresses else None
        prev, nxt = b.prev, b.next
        if prev is not None and not prev.allocated:
            if prev.mapped and b.mapped:  # _try_merge(b, prev, pool), written out
                del keys[bisect_left(keys, prev.pool_key)]
                del blocks[prev.pool_key]
                if at is not None:
                    del at[prev.addr]
                b.addr = prev.addr
                b.prev = prev.prev
                if b.prev is not None:
                    b.prev.next = b
                b.size += prev.size
            else:
                self._try_merge(b, prev, pool)
        if nxt is not None and not nxt.allocated:
            if nxt.mapped and b.mapped:  # _try_merge(b, nxt, pool), written out
                del keys[bisect_left(keys, nxt.pool_key)]
                del blocks[nxt.pool_key]
                if at is not None:
                    del at[nxt.addr]
                b.next = nxt.next
                if b.next is not None:
                    b.next.prev = b
                b.size += nxt.size
            else:
                self._try_merge(b, nxt, pool)
        key = b.pool_key = (b.stream, b.size, b.addr)
        insort(keys, key)
        blocks[key] = b
        if at is not None:
            at[b.addr] = b
        b.gc_base = pool.gc_calls

    def _try_merge(self, dst: Block, src: Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # ----------------------------------------------------------------------- release

    def _release_block(self, b: Block, pool: _Pool) -> None:
        pool.remove(b)
        self._segment_starts.discard(b.addr)
        self._unreserve(b.size)
        self._return_address(b.addr, b.size)
        self.stats.cuda_free_calls += 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int, stream: int) -> bool:
        ms = self.s.max_split_size
        if ms == UNLIMITED:
            return False
        want = max(size, ms)
        keys = pool.keys
        i = bisect_left(keys, (stream, want, -1))
        exp = self._expandable_base
        if i == len(keys) or keys[i][0] != stream or pool.blocks[keys[i]].segment in exp:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < want and i >= 0:
                b = pool.blocks[keys[i]]
                if b.size < ms or b.stream != stream:
                    break
                if b.segment not in exp:
                    self._release_block(b, pool)
                    released += b.size
                i -= 1
            return released >= want
        self._release_block(pool.blocks[keys[i]], pool)
        return True

    def empty_cache(self) -> None:
        """``release_cached_blocks``: free every unsplit cached segment; unmap free pages of
        expandable segments."""
        exp = self._expandable_base
        for pool in (self.large, self.small):
            to_unmap = []
            for k in list(pool.keys):
                b = pool.blocks.get(k)
                if b is None:
                    continue
                if b.segment in exp:
                    to_unmap.append(b)
                elif not b.is_split():
                    self._release_block(b, pool)
            for b in to_unmap:
                self._unmap_block(b, pool)

    def _garbage_collect(self) -> None:
        assert self.limit is not None
        threshold = int(self.s.garbage_collection_threshold * self.limit)
        if self.stats.reserved_bytes <= threshold:
            return
        target = self.stats.reserved_bytes - threshold
        pool = self.large
        exp = self._expandable_base
        candidates = [pool.blocks[k] for k in pool.keys if not pool.blocks[k].is_split()]
        if not candidates:
            return
        total_age = sum(pool.gc_calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed = 0
        freed = True
        while reclaimed < target and freed and count > 0:
            threshold_age = total_age / count
            freed = False
            for k in list(pool.keys):
                b = pool.blocks.get(k)
                if b is None or b.is_split() or b.segment in exp:
                    continue
                age = pool.gc_calls - b.gc_base
                if age >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b, pool)

    # ----------------------------------------------------------------------- expandable segments

    def _try_allocate_expandable(self, pool: _Pool, size: int, stream: int) -> Block | None:
        """Grow (or create) the stream's expandable range at the lowest address that fits."""
        page = self.page[pool.small]
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(pool, candidate, min(candidate.size, size), page):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if nxt is None or nxt.mapped:  # larger than the range's whole address space: out of memory
                return None
            if not self._map_block(pool, nxt, min(size - candidate.size, nxt.size), page):
                return None
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _find_expandable_block(self, pool: _Pool, size: int, stream: int) -> Block:
        def allocatable(b: Block | None) -> bool:
            return b is not None and not b.allocated

        i = bisect_left(pool.unmapped, (stream, -1))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = pool.unmapped_blocks[pool.unmapped[i]]
            if allocatable(c.prev) and c.prev is not None:
                c = c.prev
            have = 0
            cur: Block | None = c
            while have < size and cur is not None and allocatable(cur):
                have += cur.size
                cur = cur.next
            if have >= size:
                return c
            i += 1
        # a new range: address space for 1 1/8 of an H100/H200's memory, all unmapped
        seg = next(self._segment_ids)
        span = 1 << 47
        fresh = Block(self._new_address(span), span, stream, pool.small, seg)
        self._expandable_base[seg] = fresh.addr  # pages are counted from the range's start
        fresh.mapped = False
        pool.insert_unmapped(fresh)
        return fresh

    def _map_block(self, pool: _Pool, b: Block, size: int, page: int) -> bool:
        n = -(-size // page) * page
        n = min(n, b.size)
        if not self._reserve(n):
            return False
        self.stats.cuda_malloc_calls += 1
        pool.remove_unmapped(b)
        if n < b.size:
            pool.insert_unmapped(self._split_after(b, n))  # still unmapped, like b so far
        b.mapped = True
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        return True

    def _unmap_block(self, b: Block, pool: _Pool) -> None:
        page = self.page[pool.small]
        base = self._expandable_base[b.segment]
        start = base + -(-(b.addr - base) // page) * page
        end = base + ((b.addr + b.size - base) // page) * page
        if end <= start:
            return
        pool.remove(b)
        if end < b.addr + b.size:  # the partial page after stays mapped and free
            pool.insert(self._split_after(b, end - b.addr))
        if start > b.addr:  # so does the partial page before; b becomes the whole pages
            before, b = b, self._split_after(b, start - b.addr)
            pool.insert(before)
        b.mapped = False
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert_unmapped(b)
        self._unreserve(end - start)
        self.stats.cuda_free_calls += 1

    # ----------------------------------------------------------------------- seeding and following a trace

    def _book(self, n: int) -> None:
        """Reserve without a limit check: memory the recording shows was reserved."""
        self.stats.reserved_bytes += n
        self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self.stats.reserved_bytes)

    def _link(self, chain: list[Block]) -> None:
        for a, b in itertools.pairwise(chain):
            a.next, b.prev = b, a

    def _place(self, chain: list[Block], allocated: set[int]) -> list[Block]:
        """Free blocks of ``chain`` go to their pool; those in ``allocated`` are live."""
        live = []
        for b in chain:
            if not b.mapped:
                self._pool(b.small).insert_unmapped(b)
            elif b.addr in allocated:
                b.allocated = True
                self.stats.allocated_bytes += b.size
                live.append(b)
            else:
                self._pool(b.small).insert(b)
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)
        return live

    def seed_segment(self, addr: int, stream: int, small: bool, blocks: list[tuple[int, int, bool]]) -> list[Block]:
        """A segment that existed before the trace began: ``blocks`` (address, size, allocated)
        tile it. Returns its allocated blocks."""
        seg = next(self._segment_ids)
        chain = [Block(a, n, stream, small, seg) for a, n, _ in blocks]
        self._segment_starts.add(addr)
        self._link(chain)
        self._book(sum(n for _, n, _ in blocks))
        return self._place(chain, {a for a, _, alloc in blocks if alloc})

    def seed_expandable(
        self, stream: int, small: bool, ranges: list[tuple[int, list[tuple[int, int, bool]]]]
    ) -> list[Block]:
        """The mapped ranges of one expandable segment that existed before the trace began, each
        (start, blocks); the address space between and after them is unmapped."""
        seg = next(self._segment_ids)
        ranges = sorted(ranges)
        base = ranges[0][0]
        chain: list[Block] = []
        pos = base
        for start, blocks in ranges:
            if start > pos:
                gap = Block(pos, start - pos, stream, small, seg)
                gap.mapped = False
                chain.append(gap)
            chain.extend(Block(a, n, stream, small, seg) for a, n, _ in blocks)
            pos = start + sum(n for _, n, _ in blocks)
            self._book(pos - start)
        tail = Block(pos, base + (1 << 47) - pos, stream, small, seg)
        tail.mapped = False
        chain.append(tail)
        self._link(chain)
        self._expandable_base[seg] = base
        return self._place(chain, {a for _, blocks in ranges for a, _, alloc in blocks if alloc})

    def free_block_at(self, addr: int) -> Block | None:
        return self.small.at.get(addr) or self.large.at.get(addr)

    def follow_segment_alloc(self, addr: int, size: int, stream: int, small: bool) -> None:
        """cudaMalloc as recorded: a new segment at ``addr``."""
        self._book(size)
        self.stats.cuda_malloc_calls += 1
        self._segment_starts.add(addr)
        self._pool(small).insert(Block(addr, size, stream, small, next(self._segment_ids)))

    def follow_segment_free(self, addr: int) -> bool:
        """cudaFree as recorded; False when no whole free segment starts at ``addr``."""
        b = self.free_block_at(addr)
        if b is None or b.is_split():
            return False
        self._release_block(b, self._pool(b.small))
        return True

    def follow_alloc(self, addr: int, orig_size: int) -> Block | None:
        """An allocation as recorded at ``addr``: the free block starting there is taken and
        split by the allocator's rules. None when the recording and the state disagree."""
        size = round_size(orig_size, self.s)
        b = self.free_block_at(addr)
        if b is None or b.size < size:
            return None
        pool = self._pool(b.small)
        pool.remove(b)
        block = self._alloc_found_block(pool, b, size)
        self.stats.allocated_bytes += block.size
        self.stats.peak_allocated_bytes = max(self.stats.peak_allocated_bytes, self.stats.allocated_bytes)
        return block

    def _unmapped_containing(self, addr: int, stream: int) -> tuple[_Pool, Block] | None:
        """The unmapped block holding ``addr``: of the two pools', the one that starts last. The
        address space after a range's last mapped page is modelled as one block running far past
        it, so the large pool's may span a small-pool range above it (``gaptwin_expandable_wrapped``
        maps the small pool's next page at an address inside the large range's tail)."""
        found: tuple[_Pool, Block] | None = None
        for pool in (self.large, self.small):
            i = bisect_right(pool.unmapped, (stream, addr)) - 1
            if i >= 0 and pool.unmapped[i][0] == stream:
                b = pool.unmapped_blocks[pool.unmapped[i]]
                if b.addr <= addr < b.addr + b.size and (found is None or b.addr > found[1].addr):
                    found = pool, b
        return found

    def follow_map(self, addr: int, size: int, stream: int, small: bool) -> bool:
        """Pages mapped into an expandable segment as recorded (a new segment's address space
        when ``addr`` is in none)."""
        found = self._unmapped_containing(addr, stream)
        if found is None:
            seg = next(self._segment_ids)
            fresh = Block(addr, 1 << 47, stream, small, seg)
            fresh.mapped = False
            self._expandable_base[seg] = addr
            self._pool(small).insert_unmapped(fresh)
            found = (self._pool(small), fresh)
        pool, b = found
        if addr + size > b.addr + b.size:
            return False
        pool.remove_unmapped(b)
        if addr > b.addr:
            before, b = b, self._split_after(b, addr - b.addr)
            pool.insert_unmapped(before)
        if size < b.size:
            pool.insert_unmapped(self._split_after(b, size))
        b.mapped = True
        self._book(size)
        self.stats.cuda_malloc_calls += 1
        self._try_merge(b, b.prev, pool)
        self._try_merge(b, b.next, pool)
        pool.insert(b)
        return True

    def follow_unmap(self, addr: int, size: int) -> bool:
        """Pages unmapped as recorded: they must lie in one free mapped block."""
        for pool in (self.large, self.small):
            for b in pool.blocks.values():
                if b.addr <= addr and addr + size <= b.addr + b.size and b.segment in self._expandable_base:
                    pool.remove(b)
                    if addr + size < b.addr + b.size:
                        pool.insert(self._split_after(b, addr + size - b.addr))
                    if addr > b.addr:
                        before, b = b, self._split_after(b, addr - b.addr)
                        pool.insert(before)
                    b.mapped = False
                    self._try_merge(b, b.prev, pool)
                    self._try_merge(b, b.next, pool)
                    pool.insert_unmapped(b)
                    self._unreserve(size)
                    self.stats.cuda_free_calls += 1
                    return True
        return False

    def needs_release(self, orig_size: int, stream: int) -> bool:
        """Whether a malloc of ``orig_size`` now would make the allocator give memory back first
        (garbage collection, or a cudaMalloc over the limit). Changes nothing."""
        size = round_size(orig_size, self.s)
        small = size <= SMALL_SIZE
        pool = self._pool(small)
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        if i < len(keys) and keys[i][0] == stream:
            b = pool.blocks[keys[i]]
            fits = not (size < self.s.max_split_size and b.size >= self.s.max_split_size) and not (
                size >= self.s.max_split_size and b.size >= size + self.s.max_non_split_rounding
            )
            if fits:
                return False
        if self.gc_enabled:
            assert self.limit is not None
            if self.stats.reserved_bytes > int(self.s.garbage_collection_threshold * self.limit) and any(
                not b.is_split() for b in self.large.blocks.values()
            ):
                return True
        need = size if self.s.expandable_segments else allocation_size(size)
        return self.limit is not None and self.stats.reserved_bytes + need > self.limit

    # ----------------------------------------------------------------------- state

    def segments(self, allocated: list[Block]) -> list[list[Block]]:
        """Mapped segments (or mapped ranges of expandable segments), each its blocks in address
        order; ``allocated`` are the live blocks."""
        everything = [*allocated, *self.small.blocks.values(), *self.large.blocks.values()]
        out = []
        for b in everything:
            if not b.mapped or (b.prev is not None and b.prev.mapped):
                continue
            chain = []
            cur: Block | None = b
            while cur is not None and cur.mapped:
                chain.append(cur)
                cur = cur.next
            out.append(chain)
        return out

    def layout(self, allocated: list[Block]) -> list[list[tuple[int, bool]]]:
        """:meth:`segments` as lists of (block size, allocated)."""
        return [[(b.size, b.allocated) for b in chain] for chain in self.segments(allocated)]
