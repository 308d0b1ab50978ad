-- The retention sweep of published rows (`OutboxStore::delete_published`) reads them by a
-- B-tree on `published_at` instead of 0005's BRIN index. A BRIN scan returns whole block
-- ranges from the table's first page on, a range without a summary (filled since the last
-- VACUUM) matches every query, and a summary never narrows: a range the sweep emptied keeps
-- matching, and new rows that reuse its space after VACUUM widen it to their times. So each
-- batch of a round re-read the rows the round had already deleted, and the batch that ends
-- a round (fewer rows than its LIMIT) read every such range to the table's end. Measured on
-- 3M rows shaped as `oncely-bench year` preloads them, 600,000 of them expired: a round took
-- 97 s (72 s with every range summarised), its last batch 1.26 s (0.12 s); with this index
-- 10.7 s and 2.6 ms. Inserting 1M rows took the same within noise (16.3 s, 17.1 s with the
-- BRIN index); the index takes about 21 MB per million rows. Building it locks the table
-- against inserts (relays recording published rows wait) while it runs: 2.4 s for 3M rows.
DROP INDEX IF EXISTS oncely_outbox_published_at;
CREATE INDEX IF NOT EXISTS oncely_outbox_published_at ON oncely_outbox_published (published_at);
