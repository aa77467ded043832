//! The outbox table's SQL, in one home: its shape ([`table`]), marking rows
//! published ([`marking`]), recording rows failed ([`record`]) and deleting
//! what is done ([`retention`]).

pub mod marking;
pub mod record;
pub mod retention;
pub mod table;
