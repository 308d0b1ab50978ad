-- The outbox row contract for writers outside oncely (docs/publish-from-any-language.md):
-- a `message_id` that is not a lower-case hyphenated UUID, or `headers` that are not a JSON
-- object of strings, cannot become a message; without these checks such a row, written by a
-- service in another language, failed every claim that reached it and stopped the relays.
-- Now its INSERT fails in the writer's own transaction. Rows oncely writes always pass.
ALTER TABLE oncely_outbox
    ADD CONSTRAINT oncely_outbox_message_id_uuid CHECK (
        message_id ~ '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$'),
    ADD CONSTRAINT oncely_outbox_headers_strings CHECK (
        jsonb_typeof(headers::jsonb) = 'object'
        AND NOT jsonb_path_exists(headers::jsonb, '$.* ? (@.type() != "string")'));
