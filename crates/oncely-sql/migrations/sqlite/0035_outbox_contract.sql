-- The outbox row contract for writers outside oncely (docs/publish-from-any-language.md):
-- a `message_id` that is not a lower-case hyphenated UUID, or `headers` that are not a JSON
-- object of strings, cannot become a message; without this check such a row, written by a
-- service in another language, failed every claim that reached it and stopped the relays.
-- Now its INSERT fails in the writer's own transaction. Rows oncely writes always pass.
-- A trigger, because SQLite cannot add a CHECK constraint to an existing table.
CREATE TRIGGER IF NOT EXISTS oncely_outbox_contract BEFORE INSERT ON oncely_outbox
WHEN NOT (
    length(NEW.message_id) = 36
    AND NEW.message_id GLOB '[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]'
    AND json_valid(NEW.headers)
    AND json_type(NEW.headers) = 'object'
    AND NOT EXISTS (SELECT 1 FROM json_each(NEW.headers) WHERE type <> 'text'))
BEGIN
    SELECT RAISE(ABORT, 'oncely_outbox: message_id must be a lower-case UUID and headers a JSON object of strings');
END;
