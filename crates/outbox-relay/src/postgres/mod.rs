//! Every conversation with the database: the ordinary and replication
//! connections and their TLS, what the server is and whether it can stream
//! (readiness, platform, failover, stalls), the relay's position table, and
//! the outbox table's SQL ([`outbox`]).
//!
//! Nothing here knows about destinations or the publishing pipeline: the
//! pipeline calls down into this wing, never the other way.

pub mod check;
mod connection;
pub mod failover;
pub mod lsn;
pub mod monitor;
pub mod outbox;
pub mod platform;
pub mod position;
pub mod readiness;
pub mod setup;
pub mod silence;
pub mod sql;
pub mod stall;
pub mod tls;
pub mod walstream;

pub use connection::*;
