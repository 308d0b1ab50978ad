//! The `orders` binary: the reference order service and its workers (commands in
//! [`orders::cli`]).

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    orders::cli::run().await
}
