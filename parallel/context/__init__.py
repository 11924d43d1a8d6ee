"""Context parallelism: each sequence cut over the cp group, and attention that still sees all of it.

``sharding`` says which tokens a cp rank holds (two of the 2 x cp chunks, balanced for causal work);
``local_attention`` decides which keys a query sees (causal, sliding window, documents) from global
token indices and runs attention over keys a rank holds in full; ``block_attention`` is the exact unit
the ring merges (a block of queries on a block of keys, with its log-sum-exp); ``ring_attention``
(p2p), ``ulysses_attention`` (a2a) and ``allgather_attention`` are the three ways to see the other
ranks' keys and values; ``attention`` picks one per layer. ``document_blocks``: packed documents through
FlexAttention's block masks where a rank holds whole sequences on a GPU.
"""

from parallel.context.attention import COMM_TYPES, ContextParallel, context_attention
from parallel.context.document_blocks import DocumentBlocks
from parallel.context.local_attention import ScoreOptions, attend, sequence_mask, visible
from parallel.context.sharding import chunk_ids, shard_sequence, token_indices

__all__ = ["COMM_TYPES", "ContextParallel", "DocumentBlocks", "ScoreOptions", "attend", "chunk_ids",
           "context_attention",
           "sequence_mask", "shard_sequence", "token_indices", "visible"]
