"""Host bookkeeping: the pure block pool, the prefix cache, the scheduler and request state."""
