-- Consumer inbox (DESIGN.md "Outbox, relay, inbox"). A consumer records each message id in
-- the same transaction as its effect; the primary key detects a redelivery. Unix ms.
CREATE TABLE IF NOT EXISTS oncely_inbox (
    consumer     TEXT    NOT NULL,
    message_id   TEXT    NOT NULL,
    received_at  BIGINT  NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS oncely_inbox_received ON oncely_inbox (received_at);

-- SQL transport: consumer groups subscribed to a topic. Every message queued afterwards is
-- copied into oncely_deliveries once per subscribed consumer (fan-out), so each group gets
-- every message and a retry concerns only the group that failed.
CREATE TABLE IF NOT EXISTS oncely_subscriptions (
    consumer  TEXT NOT NULL,
    topic     TEXT NOT NULL,
    PRIMARY KEY (consumer, topic)
);

-- One row per (consumer, message) until it is acknowledged (deleted) or dead.
-- A claimed row carries a lease (lease_token, locked_until); after the lease it is delivered
-- again (at least once).
CREATE TABLE IF NOT EXISTS oncely_deliveries (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    consumer       TEXT     NOT NULL,
    message_id     TEXT     NOT NULL,
    topic          TEXT     NOT NULL,
    partition_key  TEXT     NOT NULL,
    event_type     TEXT     NOT NULL,
    headers        TEXT     NOT NULL,
    payload        BLOB     NOT NULL,
    enqueued_at    BIGINT   NOT NULL,
    available_at   BIGINT   NOT NULL,
    attempts       INTEGER  NOT NULL DEFAULT 0,
    last_error     TEXT,
    state          TEXT     NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'dead')),
    lease_token    TEXT,
    locked_until   BIGINT,
    UNIQUE (consumer, message_id)
);
CREATE INDEX IF NOT EXISTS oncely_deliveries_ready ON oncely_deliveries (consumer, id)
    WHERE state = 'pending';

CREATE TRIGGER IF NOT EXISTS oncely_queue_fan_out AFTER INSERT ON oncely_queue
BEGIN
    INSERT OR IGNORE INTO oncely_deliveries (consumer, message_id, topic, partition_key,
        event_type, headers, payload, enqueued_at, available_at)
    SELECT s.consumer, NEW.message_id, NEW.topic, NEW.partition_key, NEW.event_type,
        NEW.headers, NEW.payload, NEW.enqueued_at, NEW.enqueued_at
    FROM oncely_subscriptions s WHERE s.topic = NEW.topic;
END;
