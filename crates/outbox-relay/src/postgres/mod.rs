//! Every conversation with the database: the ordinary and replication
//! connections and their TLS, what the server is and whether it can stream
//! (readiness, platform, failover, stalls), the relay's position table, and
//! the outbox table's SQL ([`outbox`]).
//!
//! Nothing here knows about destinations or the publishing pipeline: the
//! pipeline calls down into this wing, never the other way.

pub mod check;
mod connection;
pub(crate) mod failover;
pub(crate) mod lsn;
pub(crate) mod monitor;
pub(crate) mod outbox;
pub(crate) mod platform;
pub(crate) mod position;
pub(crate) mod readiness;
pub mod setup;
pub(crate) mod silence;
pub(crate) mod sql;
pub(crate) mod stall;
pub(crate) mod tls;
pub(crate) mod walstream;

pub use connection::*;
