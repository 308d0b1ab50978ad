-- When the latest call of an effect was allowed out (the claim that made it in_flight),
-- Unix ms. A status check's settle time counts from it: a lookup that lags writes proves
-- nothing until that long after the last create may have reached the provider. Counting
-- from the effect's last update instead would move the window with every check.
ALTER TABLE oncely_effects ADD COLUMN sent_at BIGINT;
