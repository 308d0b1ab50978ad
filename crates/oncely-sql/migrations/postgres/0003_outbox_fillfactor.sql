-- Leave room on each page so that leasing a row (locked_by, locked_until: no indexed column
-- changes) is a HOT update, without new index entries. Measured by `oncely bench relay`.
ALTER TABLE oncely_outbox SET (fillfactor = 50);
