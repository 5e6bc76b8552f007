"""Model families: HF checkpoints -> torch models over a paged KV cache (see docs/contracts.md)."""
