-- Consecutive calls or status checks of an effect that found its provider unavailable
-- (refused connection, 429, 503): none of them counts as an attempt or a check, so this is
-- what the runner's outage backoff grows with. Raised by each such call or check, reset to
-- 0 by anything else that settles the effect.
ALTER TABLE oncely_effects ADD COLUMN unavailable_streak INTEGER NOT NULL DEFAULT 0;
