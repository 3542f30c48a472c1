"""The caching allocator: a model of it, its state rebuilt from a snapshot, the what-if replays and who
released memory."""
