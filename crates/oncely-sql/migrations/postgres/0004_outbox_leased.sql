-- Rows leased by `OutboxStore::claim` (rare on PostgreSQL, where relays hold row locks
-- instead): `claim_batch` reads the partitions with a live lease from this small index once
-- per claim, instead of probing every candidate's partition in the heap.
CREATE INDEX IF NOT EXISTS oncely_outbox_leased ON oncely_outbox (partition_key)
    WHERE state = 'pending' AND locked_until IS NOT NULL;
