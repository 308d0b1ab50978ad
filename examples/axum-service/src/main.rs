//! `DATABASE_URL=postgres://… cargo run -p oncely-example-axum`: the transfers service on
//! `LISTEN` (default `127.0.0.1:3000`), with its PostgreSQL pool from `DATABASE_URL`
//! (required: the example creates tables, so it never picks a database by itself) and one
//! API key, `demo-key` (tenant `demo`).

use std::collections::BTreeMap;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL to a PostgreSQL database of the example's own")?;
    let listen = std::env::var("LISTEN").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let pool = sqlx::PgPool::connect(&url).await?; // the pool your service already has
    let keys = BTreeMap::from([("demo-key".to_owned(), oncely_core::TenantId::parse("demo")?)]);
    let router = oncely_example_axum::app(pool, keys).await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("transfers service listening on http://{listen}");
    axum::serve(listener, router).await?;
    Ok(())
}
