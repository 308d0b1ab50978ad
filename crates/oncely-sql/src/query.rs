//! A user's own SQL on any backend without a macro: [`query`] builds a [`Query`] (one SQL
//! text with `$n` placeholders and its [`Value`]s), which [`Tx`] and [`Database`] run and
//! decode into any `T: sqlx::FromRow` ([`FromBackendRow`]).

use std::borrow::Cow;

use crate::{on_pool, on_tx, on_writer, Backend, Database, StoreError, Tx};

/// A value bound to a [`Query`] placeholder.
///
/// PostgreSQL types each parameter: `I64` is `int8`, `F64` `float8`, `Bool` `bool`, `Text`
/// `text`, `Bytes` `bytea`, and `Null` is sent as a `text` NULL — cast it in the SQL
/// (`$3::bigint`) where the column is not text. An `int4` column takes an `I64` in an
/// `INSERT` or `UPDATE` (assignment cast).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// A 64-bit integer.
    I64(i64),
    /// A double.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// Text.
    Text(String),
    /// Bytes.
    Bytes(Vec<u8>),
    /// SQL NULL.
    Null,
}

macro_rules! value_from {
    ($($t:ty => |$v:ident| $e:expr),* $(,)?) => {
        $(impl From<$t> for Value {
            fn from($v: $t) -> Self {
                $e
            }
        })*
    };
}

value_from! {
    i64 => |v| Self::I64(v),
    i32 => |v| Self::I64(i64::from(v)),
    u32 => |v| Self::I64(i64::from(v)),
    i16 => |v| Self::I64(i64::from(v)),
    f64 => |v| Self::F64(v),
    bool => |v| Self::Bool(v),
    String => |v| Self::Text(v),
    &str => |v| Self::Text(v.to_owned()),
    &String => |v| Self::Text(v.clone()),
    Vec<u8> => |v| Self::Bytes(v),
    &[u8] => |v| Self::Bytes(v.to_vec()),
}

impl<T: Into<Value>> From<Option<T>> for Value {
    fn from(v: Option<T>) -> Self {
        v.map_or(Self::Null, Into::into)
    }
}

/// One SQL statement with `$1, $2, …` placeholders and the values bound to them, run on
/// whichever backend the [`Tx`] or [`Database`] is (MySQL gets the placeholders rewritten
/// to `?`). Build it with [`query`].
///
/// MySQL binds `?` by position, so the text must use `$1, $2, …` each exactly once and in
/// that order; and a `$` followed by a digit is taken for a placeholder wherever it is
/// (inside a string literal too) — bind such values instead.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    sql: String,
    args: Vec<Value>,
}

/// A [`Query`] of `sql` (placeholders `$1, $2, …`), without values yet.
///
/// ```text
/// let n = tx.execute(oncely_sql::query("UPDATE t SET a = $1 WHERE id = $2").bind(a).bind(id)).await?;
/// ```
pub fn query(sql: impl Into<String>) -> Query {
    Query {
        sql: sql.into(),
        args: Vec::new(),
    }
}

impl Query {
    /// Binds the next placeholder (`$1` first).
    #[must_use]
    pub fn bind(mut self, value: impl Into<Value>) -> Self {
        self.args.push(value.into());
        self
    }

    /// The SQL text as given.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The bound values, in placeholder order.
    pub fn values(&self) -> &[Value] {
        &self.args
    }

    /// The text as `backend` spells it.
    fn text(&self, backend: Backend) -> Cow<'_, str> {
        if backend.uses_question_marks() {
            Cow::Owned(crate::dialect::question_marks(&self.sql))
        } else {
            Cow::Borrowed(&self.sql)
        }
    }
}

/// Binds `$args` (a `&[Value]`) to the sqlx query `$q`, in order. A macro so one text
/// serves every backend's query type inside [`on_tx!`] and friends.
macro_rules! bind_values {
    ($q:expr, $args:expr) => {{
        let mut q = $q;
        for v in $args {
            q = match v {
                Value::I64(n) => q.bind(*n),
                Value::F64(x) => q.bind(*x),
                Value::Bool(b) => q.bind(*b),
                Value::Text(s) => q.bind(s.as_str()),
                Value::Bytes(b) => q.bind(b.as_slice()),
                Value::Null => q.bind(None::<&str>),
            };
        }
        q
    }};
}

/// A row type every enabled backend can decode: `T: sqlx::FromRow` for the SQLite,
/// PostgreSQL and MySQL rows (those whose feature is on), which `#[derive(sqlx::FromRow)]`
/// gives. Implemented for every such `T`.
pub trait FromBackendRow: Send + Unpin + row::Sqlite + row::Postgres + row::MySql {}

impl<T: Send + Unpin + row::Sqlite + row::Postgres + row::MySql> FromBackendRow for T {}

/// One bound of [`FromBackendRow`] per backend: `FromRow` of its row when its feature is
/// on, nothing when it is off.
#[doc(hidden)]
pub mod row {
    macro_rules! row_bound {
        ($name:ident, $feature:literal, $row:ty) => {
            /// `FromRow` of this backend's row (implemented for every such type; for every
            /// type when the backend's feature is off).
            #[cfg(feature = $feature)]
            pub trait $name: for<'r> sqlx::FromRow<'r, $row> {}
            #[cfg(feature = $feature)]
            impl<T: for<'r> sqlx::FromRow<'r, $row>> $name for T {}
            /// Nothing: this backend's feature is off.
            #[cfg(not(feature = $feature))]
            pub trait $name {}
            #[cfg(not(feature = $feature))]
            impl<T> $name for T {}
        };
    }
    row_bound!(Sqlite, "sqlite", sqlx::sqlite::SqliteRow);
    row_bound!(Postgres, "postgres", sqlx::postgres::PgRow);
    row_bound!(MySql, "mysql", sqlx::mysql::MySqlRow);
}

impl Tx {
    /// Runs `query` in this transaction; returns the rows affected.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails (a unique violation included).
    ///
    /// # Panics
    /// In debug builds on MySQL, when the placeholders are not `$1, $2, …` in order.
    pub async fn execute(&mut self, query: Query) -> Result<u64, StoreError> {
        let sql = query.text(self.backend());
        let n = on_tx!(self, |c| bind_values!(sqlx::query(&sql), &query.args)
            .execute(c)
            .await
            .map(|r| r.rows_affected()))?;
        Ok(n)
    }

    /// Runs `insert` (an `INSERT … VALUES (…)`, no conflict clause) in this transaction,
    /// inserting nothing when a row with the same `target` key exists — `target` is the
    /// conflict target as SQLite and PostgreSQL spell it, e.g. `"(tenant, source,
    /// external_ref)"`, naming a UNIQUE constraint or the primary key. Returns `true` when
    /// the row was inserted, `false` when the key was taken.
    ///
    /// SQLite and PostgreSQL run `… ON CONFLICT target DO NOTHING`; MySQL runs the plain
    /// insert and counts its duplicate-key error (`ER_DUP_ENTRY`, 1062) as "taken" —
    /// `INSERT IGNORE` would also silence truncation and other errors — so on MySQL any
    /// unique key of the table counts, not only `target`. Never SELECT-then-INSERT.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails. A lock wait on a concurrent insert of the
    /// same key that ran out is [`StoreError::is_lock_conflict`] (and unavailable: 503).
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn insert_ignoring_duplicate(
        &mut self,
        insert: Query,
        target: &str,
    ) -> Result<bool, StoreError> {
        let backend = self.backend();
        let sql = backend.insert_ignoring_duplicate_sql(&insert.sql, target);
        let n = on_tx!(self, |c| bind_values!(sqlx::query(&sql), &insert.args)
            .execute(c)
            .await
            .map(|r| r.rows_affected()));
        Ok(backend.duplicate_ignored(n)?)
    }

    /// Runs `query` in this transaction and decodes its first row, if any, as `T`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row does not decode as `T`.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn fetch_optional<T: FromBackendRow>(
        &mut self,
        query: Query,
    ) -> Result<Option<T>, StoreError> {
        let sql = query.text(self.backend());
        Ok(on_tx!(self, |c| bind_values!(
            sqlx::query_as(&sql),
            &query.args
        )
        .fetch_optional(c)
        .await)?)
    }

    /// Runs `query` in this transaction and decodes its one row as `T`.
    ///
    /// # Errors
    /// [`StoreError::Database`] with [`sqlx::Error::RowNotFound`] when there is no row;
    /// [`StoreError`] when the database fails or the row does not decode.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn fetch_one<T: FromBackendRow>(&mut self, query: Query) -> Result<T, StoreError> {
        let sql = query.text(self.backend());
        Ok(on_tx!(self, |c| bind_values!(
            sqlx::query_as(&sql),
            &query.args
        )
        .fetch_one(c)
        .await)?)
    }

    /// Runs `query` in this transaction and decodes every row as `T`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row does not decode.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn fetch_all<T: FromBackendRow>(
        &mut self,
        query: Query,
    ) -> Result<Vec<T>, StoreError> {
        let sql = query.text(self.backend());
        Ok(on_tx!(self, |c| bind_values!(
            sqlx::query_as(&sql),
            &query.args
        )
        .fetch_all(c)
        .await)?)
    }
}

impl Database {
    /// Runs `query` on the write side, outside any transaction (autocommit; SQLite's single
    /// writer); returns the rows affected.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn execute(&self, query: Query) -> Result<u64, StoreError> {
        let sql = query.text(self.backend());
        let n = on_writer!(self, |p| bind_values!(sqlx::query(&sql), &query.args)
            .execute(p)
            .await
            .map(|r| r.rows_affected()))?;
        Ok(n)
    }

    /// [`Tx::insert_ignoring_duplicate`] outside any transaction (autocommit, one round
    /// trip): `true` when `insert` inserted, `false` when a row with the same `target` key
    /// exists (a concurrent insert of that key is waited for until it commits or rolls
    /// back, by the unique index).
    ///
    /// # Errors
    /// [`StoreError`] when the database fails.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn insert_ignoring_duplicate(
        &self,
        insert: Query,
        target: &str,
    ) -> Result<bool, StoreError> {
        let backend = self.backend();
        let sql = backend.insert_ignoring_duplicate_sql(&insert.sql, target);
        let n = on_writer!(self, |p| bind_values!(sqlx::query(&sql), &insert.args)
            .execute(p)
            .await
            .map(|r| r.rows_affected()));
        Ok(backend.duplicate_ignored(n)?)
    }

    /// Runs `query` on the read pool (SQLite's readers) and decodes the first row, if any.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or the row does not decode as `T`.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn fetch_optional<T: FromBackendRow>(
        &self,
        query: Query,
    ) -> Result<Option<T>, StoreError> {
        let sql = query.text(self.backend());
        Ok(on_pool!(self, |p| bind_values!(
            sqlx::query_as(&sql),
            &query.args
        )
        .fetch_optional(p)
        .await)?)
    }

    /// Runs `query` on the read pool and decodes every row as `T`.
    ///
    /// # Errors
    /// [`StoreError`] when the database fails or a row does not decode.
    ///
    /// # Panics
    /// As [`Tx::execute`].
    pub async fn fetch_all<T: FromBackendRow>(&self, query: Query) -> Result<Vec<T>, StoreError> {
        let sql = query.text(self.backend());
        Ok(on_pool!(self, |p| bind_values!(
            sqlx::query_as(&sql),
            &query.args
        )
        .fetch_all(p)
        .await)?)
    }
}
