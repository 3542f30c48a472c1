"""The allocator's state at the dump: torch's counters, fragmentation, the OOM and the block layout."""
