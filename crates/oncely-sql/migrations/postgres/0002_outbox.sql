-- Transactional outbox (DESIGN.md "Outbox, relay, inbox"). Timestamps are Unix milliseconds.
-- Rows are claimed by state (never by an "id > cursor" scan); a relay holds a claimed row
-- through a lease (locked_by, locked_until) until it marks it published or reschedules it.
CREATE TABLE IF NOT EXISTS oncely_outbox (
    id             BIGSERIAL PRIMARY KEY,
    message_id     TEXT     NOT NULL UNIQUE,
    topic          TEXT     NOT NULL,
    partition_key  TEXT     NOT NULL,
    event_type     TEXT     NOT NULL,
    payload        BYTEA    NOT NULL,
    headers        TEXT     NOT NULL,
    created_at     BIGINT   NOT NULL,
    available_at   BIGINT   NOT NULL,
    attempts       INTEGER  NOT NULL DEFAULT 0,
    last_error     TEXT,
    state          TEXT     NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'published', 'dead')),
    published_at   BIGINT,
    locked_by      TEXT,
    locked_until   BIGINT
);
-- The head of each partition (its oldest pending row) is found through this index.
CREATE INDEX IF NOT EXISTS oncely_outbox_pending ON oncely_outbox (partition_key, id)
    WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS oncely_outbox_pending_id ON oncely_outbox (id)
    WHERE state = 'pending';
CREATE INDEX IF NOT EXISTS oncely_outbox_published ON oncely_outbox (published_at)
    WHERE state = 'published';
CREATE INDEX IF NOT EXISTS oncely_outbox_dead ON oncely_outbox (id) WHERE state = 'dead';

-- Every committed insert wakes listening relays (NOTIFY is delivered at commit, once per
-- transaction and channel however many rows it inserted).
CREATE OR REPLACE FUNCTION oncely_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('oncely_outbox', '');
    RETURN NULL;
END;
$$;
DROP TRIGGER IF EXISTS oncely_outbox_notify ON oncely_outbox;
CREATE TRIGGER oncely_outbox_notify AFTER INSERT ON oncely_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION oncely_outbox_notify();

-- The SQL transport's queue (the embedded broker): one row per message until a consumer
-- takes it. UNIQUE(message_id) drops a republished copy while the first is still queued.
CREATE TABLE IF NOT EXISTS oncely_queue (
    id             BIGSERIAL PRIMARY KEY,
    topic          TEXT     NOT NULL,
    message_id     TEXT     NOT NULL UNIQUE,
    partition_key  TEXT     NOT NULL,
    event_type     TEXT     NOT NULL,
    headers        TEXT     NOT NULL,
    payload        BYTEA    NOT NULL,
    enqueued_at    BIGINT   NOT NULL
);
CREATE INDEX IF NOT EXISTS oncely_queue_topic ON oncely_queue (topic, id);
