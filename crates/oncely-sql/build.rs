//! Rebuilds the crate when a file under `migrations/` changes: `sqlx::migrate!` embeds that
//! directory at compile time, and cargo does not watch it otherwise (a new migration file
//! alone left the embedded set unchanged).

fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
