//! The preloaded tables and the SQL that fills them: one `INSERT … SELECT` per chunk of a
//! number series (`generate_series` on PostgreSQL, the sequence engine's `seq_a_to_b` on
//! MariaDB), so that rows never cross the wire.
//!
//! Unique keys ascend with the row number `n` (spread evenly over their key space), so the
//! preload appends to each index instead of splitting pages all over it; keys written
//! later (random on the service's side) land anywhere in that space, as in production.

use std::time::Duration;

use oncely_sql::Backend;

/// Live preloaded rows expire at least this long after the preload, so that none turns
/// expired while the benchmark runs.
const LIVE_MARGIN_MS: i64 = 3_600_000;

/// The operation the order service's creates are recorded under.
const OPERATION: &str = "POST /v1/orders";

/// An order as the service stores it and sends it (`"id"` follows).
const ORDER_TAIL: &str = r#"","status":"pending","source":"bench","external_ref":"year","customer_id":"c-1","amount_minor":1999,"currency":"EUR"}"#;

/// A table `year` preloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Table {
    /// `oncely_idempotency`: finished records.
    Idempotency,
    /// Published outbox rows: `oncely_outbox_published` on PostgreSQL (published rows leave
    /// `oncely_outbox` there), `oncely_outbox` in state `published` on MariaDB.
    Outbox,
    /// `oncely_inbox`: the `billing` consumer's rows.
    Inbox,
}

impl Table {
    pub(super) fn name(self, backend: Backend) -> &'static str {
        match (self, backend) {
            (Self::Idempotency, _) => "oncely_idempotency",
            (Self::Outbox, Backend::Postgres) => "oncely_outbox_published",
            (Self::Outbox, _) => "oncely_outbox",
            (Self::Inbox, _) => "oncely_inbox",
        }
    }

    /// What its rows are, for the output.
    pub(super) fn rows(self) -> &'static str {
        match self {
            Self::Idempotency => "idempotency records",
            Self::Outbox => "published outbox rows",
            Self::Inbox => "inbox rows",
        }
    }

    /// The retention sweep that deletes its expired rows, for the output.
    pub(super) fn sweep(self) -> &'static str {
        match self {
            Self::Idempotency => "collector",
            Self::Outbox => "published-outbox",
            Self::Inbox => "inbox",
        }
    }
}

/// One table's preload: `rows` rows, the first `expired` (in time) past `retention`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Plan {
    pub(super) table: Table,
    pub(super) rows: u64,
    spread: Spread,
}

impl Plan {
    pub(super) fn new(
        table: Table,
        (rows, expired): (u64, u64),
        retention: Duration,
        now_ms: i64,
    ) -> Self {
        let spread = Spread {
            rows,
            expired,
            now_ms,
            retention_ms: i64::try_from(retention.as_millis()).unwrap_or(i64::MAX),
        };
        Self {
            table,
            rows,
            spread,
        }
    }

    /// One `INSERT … SELECT` of rows `first..=last`.
    pub(super) fn chunk_sql(&self, backend: Backend, first: u64, last: u64) -> String {
        let sql = Sql {
            backend,
            series: series(backend, first, last),
            rows: last + 1 - first,
        };
        match self.table {
            Table::Idempotency => self.idempotency(&sql),
            Table::Outbox => self.outbox(&sql),
            Table::Inbox => self.inbox(&sql),
        }
    }

    /// Finished records, keys ascending, each with a 170-byte stored body; `c` is
    /// `completed_at`, ascending with `n`.
    fn idempotency(&self, sql: &Sql) -> String {
        let r = self.spread.retention_ms;
        let headers = r#"[["content-type","application/json"]]"#;
        let completed = self.spread.at("n", sql.backend);
        let body = format!(r#"{{"id":"0190c8a2-7d1e-7c4b-9a55-3f1e0b6c2d11{ORDER_TAIL}"#);
        let pg = sql.backend == Backend::Postgres;
        let (key_column, key, fingerprint, route, body) = if pg {
            (
                "key",
                "'year-' || lpad(n::text, 10, '0')",
                "sha256(int8send(n))",
                "sha256('POST /v1/orders'::bytea)",
                format!("convert_to('{body}', 'UTF8')"),
            )
        } else {
            (
                "`key`",
                "CONCAT('year-', LPAD(n, 10, '0'))",
                "UNHEX(SHA2(n, 256))",
                "UNHEX(SHA2('POST /v1/orders', 256))",
                format!("'{body}'"),
            )
        };
        format!(
            "INSERT INTO oncely_idempotency (tenant, operation, {key_column}, fingerprint, \
             route_digest, state, owner, response_status, response_headers, response_body, \
             created_at, completed_at, expires_at) \
             SELECT 'bench', '{OPERATION}', {key}, {fingerprint}, {route}, 'succeeded', \
             'year-preload', 201, '{headers}', {body}, c - 5, c, c + {r} \
             FROM (SELECT n, {completed} AS c FROM {series} s) t",
            series = sql.series
        )
    }

    /// Published `order.created` events as the order service writes them: the order as
    /// payload (about 170 bytes), its four headers (about 190 bytes), ids from the outbox's
    /// sequence (PostgreSQL) or auto-increment (MariaDB); `p` is `published_at`, ascending
    /// with `n` (rows are published in id order, roughly).
    fn outbox(&self, sql: &Sql) -> String {
        let published = self.spread.at("n", sql.backend);
        let inner = format!(
            "SELECT n, {m} AS m, {o} AS o, {published} AS p FROM {series} s{fence}",
            m = sql.ascending_hex(self.rows, "m"),
            o = sql.ascending_hex(self.rows, "o"),
            series = sql.series,
            fence = sql.fence(),
        );
        let fence = sql.fence();
        let (m, o) = (sql.uuid("m"), sql.uuid("o"));
        let key = sql.concat(&["'year-'", &sql.lpad("n")]);
        let payload = sql.concat(&[r#"'{"id":"'"#, "o", &format!("'{ORDER_TAIL}'")]);
        let headers = sql.concat(&[
            r#"'{"correlation-id":"'"#,
            "o",
            r#"'","traceparent":"00-'"#,
            "t.m",
            "'-'",
            "RIGHT(t.m, 16)",
            r#"'-01","tenant":"bench","idempotency-key":"'"#,
            &key,
            r#"'"}'"#,
        ]);
        if sql.backend == Backend::Postgres {
            format!(
                "INSERT INTO oncely_outbox_published (id, message_id, topic, partition_key, \
                 event_type, payload, headers, created_at, available_at, attempts, \
                 published_at) \
                 SELECT nextval('oncely_outbox_id_seq'), {m}, 'orders', o, 'order.created', \
                 convert_to({payload}, 'UTF8'), {headers}, p - 40, p - 40, 1, p \
                 FROM (SELECT n, m, {o} AS o, p FROM ({inner}) i{fence}) t"
            )
        } else {
            format!(
                "INSERT INTO oncely_outbox (message_id, topic, partition_key, event_type, \
                 payload, headers, created_at, available_at, attempts, state, published_at) \
                 SELECT {m}, 'orders', o, 'order.created', {payload}, {headers}, p - 40, \
                 p - 40, 1, 'published', p \
                 FROM (SELECT n, m, {o} AS o, p FROM ({inner}) i{fence}) t"
            )
        }
    }

    /// The `billing` consumer's rows, message ids ascending with `n`; `received_at` from a
    /// permutation of `n` (`(n · P) mod rows`), so that the expired rows are scattered over
    /// the primary key as random message ids scatter them in production.
    fn inbox(&self, sql: &Sql) -> String {
        let rows = self.rows.max(1);
        let prime = if rows % 1_000_003 == 0 {
            999_983
        } else {
            1_000_003
        };
        let modulo = if sql.backend == Backend::Postgres {
            format!("(n * {prime}) % {rows}")
        } else {
            format!("MOD(n * {prime}, {rows})")
        };
        format!(
            "INSERT INTO oncely_inbox (consumer, message_id, received_at) \
             SELECT '{consumer}', {m}, p FROM (SELECT {id} AS m, {received} AS p \
             FROM (SELECT n, {modulo} AS k FROM {series} s) s{fence}) t",
            consumer = orders::BILLING_CONSUMER,
            m = sql.uuid("m"),
            id = sql.ascending_hex(self.rows, "i"),
            received = self.spread.at("k", sql.backend),
            series = sql.series,
            fence = sql.fence(),
        )
    }
}

/// The chunk's number series (`n`, signed) and the backend's spelling of a few functions.
struct Sql {
    backend: Backend,
    series: String,
    /// Rows in the series.
    rows: u64,
}

impl Sql {
    /// Ends a derived table so that the planner computes its columns once per row rather
    /// than merging it into the outer query, which copies each column's expression (two
    /// digests) into every place that uses it: on MariaDB that held the outbox preload to
    /// 18,000 rows/s, 45,000 with the fence. PostgreSQL: `OFFSET 0`; MariaDB: a `LIMIT` of
    /// all the rows (`derived_merge` skips a derived table with a `LIMIT`).
    fn fence(&self) -> String {
        if self.backend == Backend::Postgres {
            " OFFSET 0".to_owned()
        } else {
            format!(" LIMIT {}", self.rows)
        }
    }

    fn concat(&self, parts: &[&str]) -> String {
        if self.backend == Backend::Postgres {
            parts.join(" || ")
        } else {
            format!("CONCAT({})", parts.join(", "))
        }
    }

    /// `n` as ten digits.
    fn lpad(&self, n: &str) -> String {
        if self.backend == Backend::Postgres {
            format!("lpad({n}::text, 10, '0')")
        } else {
            format!("LPAD({n}, 10, '0')")
        }
    }

    /// 32 lower-case hex digits: 12 that ascend with `n` over the whole 48-bit space (for
    /// `rows` rows), 20 from a digest of `salt` and `n`.
    fn ascending_hex(&self, rows: u64, salt: &str) -> String {
        let step = (1_u64 << 48) / rows.max(1);
        if self.backend == Backend::Postgres {
            format!("lpad(to_hex(n * {step}), 12, '0') || left(md5('{salt}' || n), 20)")
        } else {
            format!(
                "CONCAT(LPAD(LOWER(HEX(n * {step})), 12, '0'), \
                 LEFT(MD5(CONCAT('{salt}', n)), 20))"
            )
        }
    }

    /// The 32 hex digits in column `h` as a UUID string (8-4-4-4-12).
    fn uuid(&self, h: &str) -> String {
        if self.backend == Backend::Postgres {
            format!("{h}::uuid::text")
        } else {
            format!(
                "CONCAT_WS('-', SUBSTR({h}, 1, 8), SUBSTR({h}, 9, 4), SUBSTR({h}, 13, 4), \
                 SUBSTR({h}, 17, 4), SUBSTR({h}, 21, 12))"
            )
        }
    }
}

/// Rows `first..=last` as a derived table of one signed column `n`.
fn series(backend: Backend, first: u64, last: u64) -> String {
    if backend == Backend::Postgres {
        format!("(SELECT g AS n FROM generate_series({first}::bigint, {last}) g)")
    } else {
        // The sequence engine's `seq` is unsigned; the arithmetic is signed.
        format!("(SELECT CAST(seq AS SIGNED) AS n FROM seq_{first}_to_{last})")
    }
}

/// Where row `m` of a series falls in time (Unix ms): the first `expired` evenly over the
/// retention window before the last one (so they are past retention), the others evenly
/// over the last window from [`LIVE_MARGIN_MS`] after its start.
#[derive(Debug, Clone, Copy)]
struct Spread {
    rows: u64,
    expired: u64,
    now_ms: i64,
    retention_ms: i64,
}

impl Spread {
    /// SQL for the time of the row at position `m` (a column).
    fn at(&self, m: &str, backend: Backend) -> String {
        let Self {
            rows,
            expired,
            now_ms,
            retention_ms: r,
        } = *self;
        let div = if backend == Backend::Postgres {
            "/"
        } else {
            "DIV"
        };
        let old_start = now_ms - 2 * r;
        let live_start = now_ms - r + LIVE_MARGIN_MS;
        let live_span = r - LIVE_MARGIN_MS;
        format!(
            "CASE WHEN {m} < {expired} THEN {old_start} + {m} * {r} {div} {e} \
             ELSE {live_start} + ({m} - {expired}) * {live_span} {div} {l} END",
            e = expired.max(1),
            l = (rows - expired).max(1),
        )
    }
}
