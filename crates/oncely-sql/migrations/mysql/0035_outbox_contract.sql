-- The outbox row contract for writers outside oncely (docs/publish-from-any-language.md):
-- a `message_id` that is not a hyphenated UUID, or `headers` that are not a JSON object of
-- strings, cannot become a message; without this check such a row, written by a service in
-- another language, failed every claim that reached it and stopped the relays. Now its
-- INSERT fails in the writer's own transaction (SQLSTATE 45000). Rows oncely writes always
-- pass. A trigger, because a CHECK cannot look at each value of a JSON object here
-- (MariaDB before 11.1 has no JSON_SCHEMA_VALID). `message_id` is ascii_general_ci, so the
-- pattern matches either case, as does its unique key.
DROP TRIGGER IF EXISTS oncely_outbox_contract;
CREATE TRIGGER oncely_outbox_contract BEFORE INSERT ON oncely_outbox FOR EACH ROW
BEGIN
    DECLARE vals LONGTEXT DEFAULT NULL;
    DECLARE i INT DEFAULT 0;
    IF NEW.message_id IS NULL
        OR NEW.message_id NOT REGEXP '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'
        OR NOT JSON_VALID(NEW.headers)
        OR JSON_TYPE(NEW.headers) <> 'OBJECT' THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT =
            'oncely_outbox: message_id must be a UUID and headers a JSON object of strings';
    END IF;
    SET vals = JSON_EXTRACT(NEW.headers, '$.*');
    WHILE vals IS NOT NULL AND i < JSON_LENGTH(vals) DO
        IF JSON_TYPE(JSON_EXTRACT(vals, CONCAT('$[', i, ']'))) <> 'STRING' THEN
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT =
                'oncely_outbox: headers must be a JSON object of strings';
        END IF;
        SET i = i + 1;
    END WHILE;
END;
