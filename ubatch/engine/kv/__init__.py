"""The KV memory: cells with positions and sequence sets, per-layer K/V storage, and the iSWA pair of caches."""
