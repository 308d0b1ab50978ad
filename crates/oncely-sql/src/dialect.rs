//! One SQL text for every backend: `$n` placeholders rewritten to `?` for MySQL.

use std::borrow::Cow;

/// A connection or pool whose database decides how placeholders are spelled. Implemented
/// for the connection and pool types [`on_tx!`](crate::on_tx), [`on_pool!`](crate::on_pool)
/// and [`on_writer!`](crate::on_writer) hand to their bodies.
pub trait Dialect {
    /// `true` when placeholders are MySQL's positional `?`.
    const QUESTION_MARKS: bool;
}

#[cfg(feature = "sqlite")]
impl Dialect for sqlx::SqliteConnection {
    const QUESTION_MARKS: bool = false;
}
#[cfg(feature = "postgres")]
impl Dialect for sqlx::PgConnection {
    const QUESTION_MARKS: bool = false;
}
#[cfg(feature = "mysql")]
impl Dialect for sqlx::MySqlConnection {
    const QUESTION_MARKS: bool = true;
}
impl<DB: sqlx::Database> Dialect for sqlx::Pool<DB>
where
    DB::Connection: Dialect,
{
    const QUESTION_MARKS: bool = <DB::Connection as Dialect>::QUESTION_MARKS;
}

/// `?, ?, …` for `n` values: the MySQL spelling of an `IN (…)` list of `n` binds (MySQL has
/// no array parameter like PostgreSQL's `= ANY($1)`).
pub fn in_list(n: usize) -> String {
    vec!["?"; n].join(", ")
}

/// `sql` as the database behind `conn` spells it: unchanged for SQLite and PostgreSQL;
/// for MySQL every `$n` placeholder becomes `?`.
///
/// MySQL binds `?` by position, so a text shared with MySQL must use `$1, $2, …` each
/// exactly once and in that order (the binds then line up on every backend); statements
/// that reuse a placeholder, or need another syntax (`ON CONFLICT`, `RETURNING` on an
/// `UPDATE`, `= ANY($1)`), have their own MySQL text instead.
///
/// The texts are the crate's own constants, never user input, so a `$` inside a string
/// literal does not occur.
///
/// # Panics
/// In debug builds, when a MySQL text's placeholders are not `$1, $2, …` in order.
pub fn sql_text<'a, C: Dialect + ?Sized>(_conn: &C, sql: &'a str) -> Cow<'a, str> {
    if C::QUESTION_MARKS {
        Cow::Owned(question_marks(sql))
    } else {
        Cow::Borrowed(sql)
    }
}

/// Rewrites `$1`, `$2`, … to `?`.
pub(crate) fn question_marks(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut chars = sql.chars().peekable();
    let mut expected = 1u32;
    while let Some(ch) = chars.next() {
        if ch == '$' && chars.peek().is_some_and(char::is_ascii_digit) {
            let mut n = 0u32;
            while let Some(d) = chars.peek().and_then(|c| c.to_digit(10)) {
                n = n * 10 + d;
                chars.next();
            }
            debug_assert_eq!(
                n, expected,
                "MySQL binds by position: placeholders must be $1, $2, … in order in {sql:?}"
            );
            expected += 1;
            out.push('?');
        } else {
            out.push(ch);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::question_marks;

    #[test]
    fn placeholders_become_question_marks_in_order() {
        assert_eq!(
            question_marks("UPDATE t SET a = $1 WHERE id = $2 AND b = $3"),
            "UPDATE t SET a = ? WHERE id = ? AND b = ?"
        );
        assert_eq!(question_marks("SELECT 1"), "SELECT 1");
    }

    #[test]
    #[should_panic(expected = "in order")]
    #[cfg(debug_assertions)]
    fn reused_placeholders_are_refused() {
        let _ = question_marks("SELECT $1, $1");
    }
}
