//! `StoreFailure`: every store error is an RFC 9457 answer, 503 `store-unavailable` (fail
//! closed, with `Retry-After`) when the store cannot be reached, 500 `store-error`
//! otherwise, never a 2xx, and never with driver text in the body.

use std::borrow::Cow;
use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use axum::response::IntoResponse;
use http::StatusCode;
use oncely_sql::sqlx::error::{DatabaseError, ErrorKind};
use oncely_sql::sqlx::migrate::MigrateError;
use oncely_sql::{sqlx, Backend, StoreError};
use proptest::prelude::*;

use super::{config, problem_of};
use crate::answer::store_problem;
use crate::{kind, StoreFailure, PROBLEM_JSON};

/// Marks text that came from a driver: it must never reach a problem body.
const DRIVER: &str = "DRIVERTEXT";

/// A database error with a drawn SQLSTATE, of no particular driver.
#[derive(Debug)]
struct Sqlstate(String);

impl fmt::Display for Sqlstate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{DRIVER} error {}", self.0)
    }
}

impl StdError for Sqlstate {}

impl DatabaseError for Sqlstate {
    fn message(&self) -> &str {
        DRIVER
    }
    fn code(&self) -> Option<Cow<'_, str>> {
        Some(Cow::Borrowed(&self.0))
    }
    fn as_error(&self) -> &(dyn StdError + Send + Sync + 'static) {
        self
    }
    fn as_error_mut(&mut self) -> &mut (dyn StdError + Send + Sync + 'static) {
        self
    }
    fn into_error(self: Box<Self>) -> Box<dyn StdError + Send + Sync + 'static> {
        self
    }
    fn kind(&self) -> ErrorKind {
        ErrorKind::Other
    }
}

/// A drawn `sqlx::Error` (sqlx errors are not `Clone`, so this describes one).
#[derive(Debug, Clone)]
enum Sqlx {
    Io(std::io::ErrorKind),
    Tls,
    Protocol,
    PoolTimedOut,
    PoolClosed,
    WorkerCrashed,
    RowNotFound,
    ColumnNotFound,
    Decode,
    Database(String),
}

impl Sqlx {
    fn build(&self) -> sqlx::Error {
        let text = || format!("{DRIVER} detail");
        match self {
            Self::Io(kind) => sqlx::Error::Io(std::io::Error::new(*kind, text())),
            Self::Tls => sqlx::Error::Tls(text().into()),
            Self::Protocol => sqlx::Error::Protocol(text()),
            Self::PoolTimedOut => sqlx::Error::PoolTimedOut,
            Self::PoolClosed => sqlx::Error::PoolClosed,
            Self::WorkerCrashed => sqlx::Error::WorkerCrashed,
            Self::RowNotFound => sqlx::Error::RowNotFound,
            Self::ColumnNotFound => sqlx::Error::ColumnNotFound(text()),
            Self::Decode => sqlx::Error::Decode(text().into()),
            Self::Database(code) => sqlx::Error::Database(Box::new(Sqlstate(code.clone()))),
        }
    }

    /// Whether the store could not be reached or gave up on the transaction for a
    /// transient reason, as oncely-sql documents it: I/O, TLS, protocol, pool timeout or
    /// closed, a crashed worker; SQLSTATE class 08, 57P0x, 53300, 55P03, 57014, 40001,
    /// 40P01.
    fn unavailable(&self) -> bool {
        match self {
            Self::Io(_)
            | Self::Tls
            | Self::Protocol
            | Self::PoolTimedOut
            | Self::PoolClosed
            | Self::WorkerCrashed => true,
            Self::Database(c) => {
                c.starts_with("08")
                    || c.starts_with("57P0")
                    || ["53300", "55P03", "57014", "40001", "40P01"].contains(&c.as_str())
            }
            Self::RowNotFound | Self::ColumnNotFound | Self::Decode => false,
        }
    }
}

/// A drawn `StoreError`, every variant, with drawn data.
#[derive(Debug, Clone)]
enum Drawn {
    /// Through `From<sqlx::Error>`, which classifies it.
    From(Sqlx),
    Unavailable(Sqlx),
    TimedOut(Duration),
    Database(Sqlx),
    Migrate(Option<Sqlx>, i64),
    Corrupt,
    NotHeld,
    Fenced(i64, i64),
    AlreadyPublished,
    SchemaMissing(Vec<i64>),
    NoMigrations(Backend),
    NotFound,
    Conflict,
    UnsupportedUrl,
}

impl Drawn {
    fn build(&self) -> StoreError {
        let text = || format!("{DRIVER} {self:?}");
        match self {
            Self::From(e) => e.build().into(),
            Self::Unavailable(e) => StoreError::Unavailable(e.build()),
            Self::TimedOut(d) => StoreError::TimedOut(*d),
            Self::Database(e) => StoreError::Database(e.build()),
            Self::Migrate(Some(e), _) => StoreError::Migrate(MigrateError::Execute(e.build())),
            Self::Migrate(None, v) => StoreError::Migrate(MigrateError::VersionMissing(*v)),
            Self::Corrupt => StoreError::Corrupt(text()),
            Self::NotHeld => StoreError::NotHeld,
            Self::Fenced(held, current) => StoreError::Fenced {
                held: *held,
                current: *current,
            },
            Self::AlreadyPublished => StoreError::AlreadyPublished(text()),
            Self::SchemaMissing(missing) => StoreError::SchemaMissing {
                missing: missing.clone(),
            },
            Self::NoMigrations(b) => StoreError::NoMigrations(*b),
            Self::NotFound => StoreError::NotFound(text()),
            Self::Conflict => StoreError::Conflict(text()),
            Self::UnsupportedUrl => StoreError::UnsupportedUrl(text()),
        }
    }

    /// 503 when the store is unreachable, else 500.
    fn expected_status(&self) -> StatusCode {
        let unavailable = match self {
            Self::From(e) => e.unavailable(),
            Self::Unavailable(_) | Self::TimedOut(_) => true,
            _ => false,
        };
        if unavailable {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

fn sqlx_error() -> impl Strategy<Value = Sqlx> {
    use std::io::ErrorKind as Io;
    let sqlstate = prop_oneof![
        prop::sample::select(vec![
            "08000", "08006", "08001", "57P01", "57P02", "57P03", "53300", "55P03", "57014",
            "40001", "40P01", "23505", "23503", "42P01", "42601", "22001", "53100", "58030",
            "XX000", "",
        ])
        .prop_map(str::to_owned),
        "[0-9A-Z]{5}",
    ];
    prop_oneof![
        prop::sample::select(vec![
            Io::ConnectionRefused,
            Io::ConnectionReset,
            Io::BrokenPipe,
            Io::TimedOut,
            Io::UnexpectedEof,
            Io::Other,
        ])
        .prop_map(Sqlx::Io),
        Just(Sqlx::Tls),
        Just(Sqlx::Protocol),
        Just(Sqlx::PoolTimedOut),
        Just(Sqlx::PoolClosed),
        Just(Sqlx::WorkerCrashed),
        Just(Sqlx::RowNotFound),
        Just(Sqlx::ColumnNotFound),
        Just(Sqlx::Decode),
        sqlstate.prop_map(Sqlx::Database),
    ]
}

fn store_error() -> impl Strategy<Value = Drawn> {
    prop_oneof![
        4 => sqlx_error().prop_map(Drawn::From),
        1 => sqlx_error().prop_map(Drawn::Unavailable),
        1 => (any::<u64>(), 0_u32..1_000_000_000)
            .prop_map(|(s, n)| Drawn::TimedOut(Duration::new(s, n))),
        1 => sqlx_error().prop_map(Drawn::Database),
        1 => (prop::option::of(sqlx_error()), any::<i64>()).prop_map(|(e, v)| Drawn::Migrate(e, v)),
        1 => Just(Drawn::Corrupt),
        1 => Just(Drawn::NotHeld),
        1 => (any::<i64>(), any::<i64>()).prop_map(|(h, c)| Drawn::Fenced(h, c)),
        1 => Just(Drawn::AlreadyPublished),
        1 => prop::collection::vec(any::<i64>(), 0..5).prop_map(Drawn::SchemaMissing),
        1 => prop::sample::select(vec![Backend::Sqlite, Backend::Postgres, Backend::MySql])
            .prop_map(Drawn::NoMigrations),
        1 => Just(Drawn::NotFound),
        1 => Just(Drawn::Conflict),
        1 => Just(Drawn::UnsupportedUrl),
    ]
}

proptest! {
    #![proptest_config(config(2048))]

    /// Every store error, through `StoreFailure` and through the layer's `store_problem`:
    /// 503 `store-unavailable` with the given `Retry-After` when the store is unreachable,
    /// else 500 `store-error` without one; `application/problem+json`, a stable `type`
    /// URI among the crate's kinds, a title and a detail, and no driver text.
    #[test]
    fn every_store_error_is_a_problem_and_unreachable_is_503(
        drawn in store_error(),
        retry_after in any::<u32>(),
    ) {
        let expected = drawn.expected_status();
        let answers = [
            StoreFailure::from(drawn.build()).retry_after(retry_after).into_response(),
            store_problem(drawn.build(), retry_after),
        ];
        for res in answers {
            let (status, content_type, header, body) = problem_of(res);
            prop_assert!(status.is_client_error() || status.is_server_error());
            prop_assert_eq!(status, expected);
            prop_assert_eq!(content_type.as_deref(), Some(PROBLEM_JSON));
            let kind = if status == StatusCode::SERVICE_UNAVAILABLE {
                prop_assert_eq!(header, Some(retry_after.to_string()));
                kind::STORE_UNAVAILABLE
            } else {
                prop_assert_eq!(header, None);
                kind::STORE_ERROR
            };
            prop_assert!(kind::ALL.contains(&kind));
            prop_assert_eq!(&body["type"], &format!("urn:oncely:problem:{kind}"));
            prop_assert!(body["title"].is_string() && body["detail"].is_string());
            prop_assert!(!body.to_string().contains(DRIVER), "{}", body);
        }
    }
}
