"""Sessions: bookkeeping, checkpoints, the snapshot codec and the prefix index."""
