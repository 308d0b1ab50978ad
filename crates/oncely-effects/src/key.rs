//! The keys of outgoing calls live in oncely-core (`oncely_core::derive_key`,
//! `oncely_core::next_key`), so the HTTP layer can hand a handler the key of its outgoing
//! call without depending on this crate; they are re-exported here under their old names.

pub use oncely_core::{derive_key, next_key};
