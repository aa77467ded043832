//! The outbox table's SQL, in one home: its shape ([`table`]), marking rows
//! published ([`marking`]), recording rows failed ([`record`]) and deleting
//! what is done ([`retention`]).

pub(crate) mod marking;
pub(crate) mod record;
pub(crate) mod retention;
pub(crate) mod table;
