//! [`DbArgs`]: the database every command connects to.

use std::time::Duration;

use anyhow::Context as _;
use clap::Args;
use oncely_sql::{Database, DbOptions};

/// The database every command connects to (`--database-url` and the pool settings).
/// `global`: also accepted after a subcommand's own subcommand (`oncely outbox stats
/// --database-url …` as well as `oncely outbox --database-url … stats`).
#[derive(Debug, Clone, Args)]
pub struct DbArgs {
    /// Database URL: sqlite://FILE, postgres://… or mysql://… (MySQL 8.0+ / MariaDB 10.6+)
    #[arg(
        long,
        env = "ONCELY_DATABASE_URL",
        default_value = "sqlite://oncely.db",
        global = true
    )]
    pub database_url: String,
    /// Largest number of pooled database connections.
    #[arg(
        long,
        env = "ONCELY_DB_MAX_CONNECTIONS",
        default_value_t = 16,
        global = true
    )]
    pub db_max_connections: u32,
    /// PostgreSQL / MySQL: seconds a request may wait for pool acquire + BEGIN + the key
    /// claim before it answers 503 (a frozen or paused database).
    #[arg(
        long,
        env = "ONCELY_DB_STORE_TIMEOUT_SECS",
        default_value_t = DbOptions::default().store_timeout.as_secs(),
        global = true
    )]
    pub db_store_timeout_secs: u64,
    /// Seconds the database lets a session idle inside a transaction before it ends the
    /// session, freeing the keys of a process that died or lost its path mid-request.
    #[arg(
        long,
        env = "ONCELY_DB_IDLE_TRANSACTION_TIMEOUT_SECS",
        default_value_t = DbOptions::default().idle_transaction_timeout.as_secs(),
        global = true
    )]
    pub db_idle_transaction_timeout_secs: u64,
}

impl DbArgs {
    /// The pool options these arguments describe.
    pub fn options(&self) -> DbOptions {
        DbOptions {
            max_connections: self.db_max_connections,
            store_timeout: Duration::from_secs(self.db_store_timeout_secs.max(1)),
            idle_transaction_timeout: Duration::from_secs(
                self.db_idle_transaction_timeout_secs.max(1),
            ),
            ..DbOptions::default()
        }
    }

    /// Refuses a pool too small for one of `users`, the parts of the command that share it:
    /// prints a usage error that names `--db-max-connections`, the part and the minimum, and
    /// exits with status 2. A pool that small would start, then wait on itself and report
    /// the database unavailable in a loop. SQLite is not checked: its writes go through one
    /// connection of their own whatever the flag says (it sizes the readers, at least 1).
    pub fn require_pool(&self, users: &[PoolUser]) {
        if self.database_url.starts_with("sqlite:") {
            return;
        }
        let url = self.database_url.as_str();
        let Some(user) = users.iter().copied().max_by_key(|u| u.connections(url)) else {
            return;
        };
        let need = user.connections(url);
        if self.db_max_connections < need {
            let connections = if need == 1 {
                "connection"
            } else {
                "connections"
            };
            let message = format!(
                "--db-max-connections {} is too small: {} holds up to {need} {connections} \
                 at once; give it at least {need}\n",
                self.db_max_connections,
                user.name()
            );
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, message).exit();
        }
    }

    /// Connects (creating a SQLite file that does not exist yet), migrating nothing: for a
    /// service that applies its own migrations with oncely's.
    ///
    /// # Errors
    /// The database cannot be reached.
    pub async fn connect(&self) -> anyhow::Result<Database> {
        Ok(oncely_runtime::connect(&self.database_url, &self.options()).await?)
    }

    /// Connects and applies oncely's own migrations only (the relay: outbox and queue).
    ///
    /// # Errors
    /// The database cannot be reached or migrated.
    pub async fn connect_oncely(&self) -> anyhow::Result<Database> {
        let db = oncely_runtime::connect(&self.database_url, &self.options()).await?;
        db.migrate().await.context("applying migrations")?;
        Ok(db)
    }

    /// Connects to a database a service set up, migrating nothing (operator commands).
    ///
    /// # Errors
    /// The database cannot be reached, or a SQLite file does not exist.
    pub async fn connect_existing(&self) -> anyhow::Result<Database> {
        Ok(oncely_runtime::connect_existing(&self.database_url, &self.options()).await?)
    }
}

/// A part of a command that holds connections of the command's pool
/// ([`DbArgs::require_pool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolUser {
    /// A service's HTTP requests.
    Service,
    /// The outbox relay.
    Relay,
    /// An inbox consumer.
    Consumer,
    /// The effect runner.
    Runner,
}

impl PoolUser {
    /// The most connections it holds at once on the database of `database_url`, so the
    /// smallest pool it makes progress on. On PostgreSQL the relay holds three: its
    /// `LISTEN` connection, the transaction that keeps its claimed batch locked, and one
    /// more to publish that batch through the SQL transport (or to update its gauges);
    /// with two it stalls on the pool's acquire timeout, round after round. Everything
    /// else makes progress on one (measured: each waits its turn for the pool, never on
    /// itself).
    pub fn connections(self, database_url: &str) -> u32 {
        match self {
            PoolUser::Relay if database_url.starts_with("postgres") => 3,
            _ => 1,
        }
    }

    /// How a message names it: `the relay`.
    fn name(self) -> &'static str {
        match self {
            PoolUser::Service => "the service",
            PoolUser::Relay => "the relay",
            PoolUser::Consumer => "a consumer",
            PoolUser::Runner => "the effect runner",
        }
    }
}
