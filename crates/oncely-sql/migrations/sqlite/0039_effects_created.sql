-- Reconciliation reads the effects of a provider's operation created since its window's
-- start (`ReconcileStore::created_since`). Effects are never deleted, and no index led with
-- (provider, operation, created_at): SQLite read every effect of the provider from the unique
-- (provider, operation, reference) index, or after ANALYZE the whole table, and sorted them,
-- so each run cost more than the last. This index gives the window's rows in order.
CREATE INDEX IF NOT EXISTS oncely_effects_created
    ON oncely_effects (provider, operation, created_at);
