-- Fingerprint parts (docs/gateway.md "Fingerprint parts"): a route whose fingerprint covers
-- request headers stores their digest apart, so a retry that differs only there is told
-- `differs: headers`. NULL for every record whose fingerprint covers no header (all
-- records before this migration): their `fingerprint` digest is unchanged.
ALTER TABLE oncely_idempotency ADD COLUMN headers_digest BLOB NULL;
