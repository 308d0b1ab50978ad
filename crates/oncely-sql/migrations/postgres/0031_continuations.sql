-- Continuations. An effect's outcome decided outside the service's runner (an operator's resolution from the
-- `oncely` CLI, a generic reconciliation run) whose business update the service's own
-- runner still owes: `continuation` is the outcome as JSON (what the runner hands to its
-- EffectHandler), `continuation_at` when it was recorded (Unix ms) — both NULL once the
-- runner has continued it, in the transaction that ran the handler.
ALTER TABLE oncely_effects ADD COLUMN continuation TEXT;
ALTER TABLE oncely_effects ADD COLUMN continuation_at BIGINT;
CREATE INDEX IF NOT EXISTS oncely_effects_continuation
    ON oncely_effects (continuation_at) WHERE continuation_at IS NOT NULL;

-- A saga's parked local step an operator asked to run again from outside the service
-- (`oncely saga retry`): the service's orchestrator runs it in its sweep and clears this,
-- in one transaction (Unix ms).
ALTER TABLE oncely_sagas ADD COLUMN rerun_at BIGINT;
CREATE INDEX IF NOT EXISTS oncely_sagas_rerun ON oncely_sagas (rerun_at) WHERE rerun_at IS NOT NULL;
