"""Run sequences through ``HybridModel.step`` with private pools, the way the engine does."""

from __future__ import annotations

import torch

from kda_sessions.model import ForwardBatch, HybridModel, StatePools


class Runner:
    """One slot and enough pages per sequence; ``feed`` appends tokens and returns last-token logits."""

    def __init__(self, model: HybridModel, num_seqs: int, max_tokens: int, page_size: int = 16) -> None:
        self.model = model
        self.pages_per_seq = -(-max_tokens // page_size)
        self.pools: StatePools = model.allocate_pools(num_seqs, num_seqs * self.pages_per_seq, page_size)
        self.table = torch.arange(num_seqs * self.pages_per_seq, dtype=torch.int32).view(num_seqs, -1)
        self.lengths = [0] * num_seqs

    def feed(self, seqs: list[int], tokens: list[list[int]], checkpoints=None, all_logits=False):
        batch = ForwardBatch(
            input_ids=torch.tensor([t for ts in tokens for t in ts]),
            num_new=[len(ts) for ts in tokens],
            start=[self.lengths[s] for s in seqs],
            slots=torch.tensor(seqs),
            page_table=self.table[seqs],
            checkpoint_positions=checkpoints,
            all_logits=all_logits,
        )
        logits, ck = self.model.step(batch, self.pools)
        for s, ts in zip(seqs, tokens):
            self.lengths[s] += len(ts)
        return logits, ck
