-- Transactional outbox (DESIGN.md "Outbox, relay, inbox"), MySQL 8.0+ / MariaDB 10.6+.
-- Timestamps are Unix milliseconds. Rows are claimed by state (never by an "id > cursor"
-- scan) with FOR UPDATE SKIP LOCKED; a relay holds a claimed row through a lease
-- (locked_by, locked_until). message_id is a canonical (lower-case) UUID; topic and
-- partition_key compare byte for byte (binary collation) as on the other backends.
CREATE TABLE IF NOT EXISTS oncely_outbox (
    id             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    message_id     CHAR(36)     CHARACTER SET ascii NOT NULL,
    topic          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    partition_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_type     VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    payload        LONGBLOB     NOT NULL,
    headers        MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    created_at     BIGINT NOT NULL,
    available_at   BIGINT NOT NULL,
    attempts       INT    NOT NULL DEFAULT 0,
    last_error     TEXT   CHARACTER SET utf8mb4,
    state          VARCHAR(16)  CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    published_at   BIGINT,
    locked_by      VARCHAR(64)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin,
    locked_until   BIGINT,
    UNIQUE KEY oncely_outbox_message_id (message_id),
    -- No partial indexes on MySQL: state leads, so pending rows are one index range.
    KEY oncely_outbox_pending (state, partition_key, id),
    KEY oncely_outbox_state_id (state, id),
    KEY oncely_outbox_published (state, published_at),
    CONSTRAINT oncely_outbox_state CHECK (state IN ('pending', 'published', 'dead'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- The SQL transport's queue (the embedded broker): one row per message until a consumer
-- takes it. UNIQUE(message_id) drops a republished copy while the first is still queued.
CREATE TABLE IF NOT EXISTS oncely_queue (
    id             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    topic          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id     CHAR(36)     CHARACTER SET ascii NOT NULL,
    partition_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_type     VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    headers        MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    payload        LONGBLOB     NOT NULL,
    enqueued_at    BIGINT NOT NULL,
    UNIQUE KEY oncely_queue_message_id (message_id),
    KEY oncely_queue_topic (topic, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;
