-- The due effects as PostgreSQL's partial index `oncely_effects_due` has them (provider,
-- available_at WHERE the state is not final), which MySQL and MariaDB cannot declare: a
-- stored generated column that holds `available_at` while the effect is due and NULL once
-- it is final, indexed after the provider. The claim reads this index in order
-- (`due_at`, then the primary key InnoDB appends) and stops after its LIMIT; on the old
-- index `(state, provider, available_at)` the four due states were four ranges, so every
-- claim read and sorted every due row (a backlog of N effects cost N rows per claim).
ALTER TABLE oncely_effects
    ADD COLUMN due_at BIGINT GENERATED ALWAYS AS (
        CASE WHEN state IN ('pending', 'absent', 'unknown', 'in_flight') THEN available_at END
    ) STORED,
    ADD KEY oncely_effects_due_at (provider, due_at);
