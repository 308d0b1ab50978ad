-- Consumer inbox (DESIGN.md "Outbox, relay, inbox"), MySQL 8.0+ / MariaDB 10.6+. A consumer
-- records each message id in the same transaction as its effect; the primary key detects a
-- redelivery (ER_DUP_ENTRY). Unix ms.
CREATE TABLE IF NOT EXISTS oncely_inbox (
    consumer     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id   CHAR(36)     CHARACTER SET ascii NOT NULL,
    received_at  BIGINT NOT NULL,
    PRIMARY KEY (consumer, message_id),
    KEY oncely_inbox_received (received_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- SQL transport: consumer groups subscribed to a topic. Every message queued afterwards is
-- copied into oncely_deliveries once per subscribed consumer (fan-out), so each group gets
-- every message and a retry concerns only the group that failed.
CREATE TABLE IF NOT EXISTS oncely_subscriptions (
    consumer  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    PRIMARY KEY (consumer, topic),
    KEY oncely_subscriptions_topic (topic)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- One row per (consumer, message) until it is acknowledged (deleted) or dead. A claimed row
-- carries a lease (lease_token, locked_until); after the lease it is delivered again.
CREATE TABLE IF NOT EXISTS oncely_deliveries (
    id             BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    consumer       VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    message_id     CHAR(36)     CHARACTER SET ascii NOT NULL,
    topic          VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    partition_key  VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    event_type     VARCHAR(255) CHARACTER SET utf8mb4 NOT NULL,
    headers        MEDIUMTEXT   CHARACTER SET utf8mb4 NOT NULL,
    payload        LONGBLOB     NOT NULL,
    enqueued_at    BIGINT NOT NULL,
    available_at   BIGINT NOT NULL,
    attempts       INT    NOT NULL DEFAULT 0,
    last_error     TEXT   CHARACTER SET utf8mb4,
    state          VARCHAR(16)  CHARACTER SET ascii NOT NULL DEFAULT 'pending',
    lease_token    VARCHAR(64)  CHARACTER SET ascii,
    locked_until   BIGINT,
    UNIQUE KEY oncely_deliveries_consumer_message (consumer, message_id),
    KEY oncely_deliveries_ready (consumer, state, id),
    CONSTRAINT oncely_deliveries_state CHECK (state IN ('pending', 'dead'))
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Fan-out in the publishing transaction, as the PostgreSQL trigger does. INSERT IGNORE is
-- confined to this copy: its only possible conflict is UNIQUE(consumer, message_id) (a
-- republished copy), and every value comes from rows already validated by their own
-- inserts, so no other error can be turned into a warning.
DROP TRIGGER IF EXISTS oncely_queue_fan_out;
CREATE TRIGGER oncely_queue_fan_out AFTER INSERT ON oncely_queue FOR EACH ROW
    INSERT IGNORE INTO oncely_deliveries (consumer, message_id, topic, partition_key,
        event_type, headers, payload, enqueued_at, available_at)
    SELECT s.consumer, NEW.message_id, NEW.topic, NEW.partition_key, NEW.event_type,
        NEW.headers, NEW.payload, NEW.enqueued_at, NEW.enqueued_at
    FROM oncely_subscriptions s WHERE s.topic = NEW.topic;
