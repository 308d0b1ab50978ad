-- Published events (PostgreSQL): the relay's claim deletes a row from `oncely_outbox` and,
-- once the broker confirmed it, the same transaction records it here, so the hot table
-- holds only pending and dead rows and a published row costs no second version of itself.
-- Kept for the relay's retention (`RelayConfig::retention`), then deleted in small batches.
-- The partial index of published rows in the hot table goes (no row there is `published` any
-- more), and frees its name for the table.
DROP INDEX IF EXISTS oncely_outbox_published;
CREATE TABLE IF NOT EXISTS oncely_outbox_published (
    id             BIGINT   PRIMARY KEY,
    -- Also the guard against enqueueing a published event's id again (`enqueue` checks it).
    message_id     TEXT     NOT NULL UNIQUE,
    topic          TEXT     NOT NULL,
    partition_key  TEXT     NOT NULL,
    event_type     TEXT     NOT NULL,
    payload        BYTEA    NOT NULL,
    headers        TEXT     NOT NULL,
    created_at     BIGINT   NOT NULL,
    available_at   BIGINT   NOT NULL,
    attempts       INTEGER  NOT NULL,
    last_error     TEXT,
    published_at   BIGINT   NOT NULL
);
-- Rows arrive in roughly `published_at` order: a BRIN index serves the retention's range
-- delete at almost no cost per insert.
CREATE INDEX IF NOT EXISTS oncely_outbox_published_at ON oncely_outbox_published
    USING brin (published_at);

-- Rows published before this migration move over.
INSERT INTO oncely_outbox_published (id, message_id, topic, partition_key, event_type,
    payload, headers, created_at, available_at, attempts, last_error, published_at)
SELECT id, message_id, topic, partition_key, event_type, payload, headers, created_at,
    available_at, attempts, last_error, COALESCE(published_at, created_at)
FROM oncely_outbox WHERE state = 'published'
ON CONFLICT DO NOTHING;
DELETE FROM oncely_outbox WHERE state = 'published';

-- No row of the hot table is updated in place any more (claims delete, failures re-insert),
-- so the room that fillfactor 50 left for HOT lease updates (0003) only spreads it out.
ALTER TABLE oncely_outbox SET (fillfactor = 100);
